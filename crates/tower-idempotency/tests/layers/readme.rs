//! The README's first example, exactly as the README shows it (this file
//! includes it and checks that the README holds it verbatim), serving a real
//! WeChat Pay v3 notification (wechatpay-go's test vector); and the warning a
//! channel route without verification gives.

use test_support::common;
use test_support::verify_support;

use common::vectors::{WECHAT_FAIL, WECHAT_SUCCESS};
use common::{read, request};
use std::io::Write;
use std::sync::{Arc, Mutex};
use tower::ServiceExt;
use verify_support::{at, meta, wechatpay_v3, wechatpay_v3_keys};

include!("readme/first_example.rs");

#[test]
fn the_readme_opens_with_this_example() {
    let readme = include_str!("../../README.md");
    let example = include_str!("readme/first_example.rs");
    let first = readme
        .split("```rust\n")
        .nth(1)
        .expect("a rust block in README.md");
    assert!(
        first.starts_with(example),
        "README.md's first Rust block no longer starts with tests/readme/first_example.rs"
    );
}

/// Log lines, captured from a tracing subscriber set for this thread.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let logs = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || logs.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn pairs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn the_readme_route_hands_the_decrypted_resource_to_its_handler() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let case = wechatpay_v3();
    let now = case.now;
    // The README's route, with the clock at the vector's signing time.
    let router = app(VerifyLayer::new(wechatpay_v3_keys()).clock(move || at(now)));
    let headers = pairs(&case.headers);
    for copy in 0..2 {
        let res = router
            .clone()
            .oneshot(request("/notify/wechatpay", &headers, case.body.clone()))
            .await
            .unwrap();
        let a = read(res).await;
        assert_eq!(
            (a.status, a.text()),
            (200, WECHAT_SUCCESS.to_owned()),
            "copy {copy}"
        );
        assert_eq!(a.replayed(), copy == 1, "copy {copy}");
    }
    // The handler read the plaintext through the extractor, once.
    let plain: serde_json::Value = serde_json::from_str(
        meta("wechatpay_v3_notify_wechatpay-go.meta.json")["expected"]["resource_plaintext"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let text = logs.text();
    let paid: Vec<&str> = text.lines().filter(|l| l.contains(" paid")).collect();
    assert_eq!(paid.len(), 1, "{text}");
    assert!(paid[0].contains(&format!("tx={plain}")), "{text}");
    assert!(paid[0].contains(r#""out_contract_code":"21640bdbd08e473e828f3206a2741c6e""#));
    // A forged copy (one byte of the body changed) never reaches it.
    let forged = String::from_utf8(case.body.clone())
        .unwrap()
        .replace(case.tamper.0, case.tamper.1);
    let res = router
        .clone()
        .oneshot(request("/notify/wechatpay", &headers, forged))
        .await
        .unwrap();
    let a = read(res).await;
    assert_eq!((a.status, a.text()), (401, WECHAT_FAIL.to_owned()));
    // With the README's own keys (the system clock) the 2021 vector is stale.
    let pem = std::fs::read("tests/fixtures/wechatpay_v3_platform_cert.pem").unwrap();
    let keys = WechatPayV3Keys::new()
        .platform_key("D7CE59D1F522D701", pem)
        .unwrap()
        .api_v3_key("testMchAPIv3Key0")
        .unwrap();
    let res = app(keys)
        .oneshot(request("/notify/wechatpay", &headers, case.body.clone()))
        .await
        .unwrap();
    assert_eq!(read(res).await.status, 401);
    assert_eq!(
        logs.text().lines().filter(|l| l.contains(" paid")).count(),
        1
    );
}

#[tokio::test(flavor = "current_thread")]
async fn without_an_apiv3_key_the_extractor_fails_and_wechat_retries() {
    use tower_idempotency::verify::DecryptedResource;
    async fn maybe(resource: Option<DecryptedResource>) -> String {
        format!("{}", resource.is_some())
    }
    let case = wechatpay_v3();
    let now = case.now;
    let keys = || {
        let pem = std::fs::read("tests/fixtures/wechatpay_v3_platform_cert.pem").unwrap();
        let keys = WechatPayV3Keys::new().platform_key("D7CE59D1F522D701", pem);
        VerifyLayer::new(keys.unwrap()).clock(move || at(now))
    };
    let router: Router = Router::new()
        .route(
            "/needs",
            post(on_wechat_paid).layer(IdempotencyLayer::wechatpay_v3().verify(keys())),
        )
        .route("/maybe", post(maybe));
    let headers = pairs(&case.headers);
    let res = router
        .clone()
        .oneshot(request("/needs", &headers, case.body.clone()))
        .await
        .unwrap();
    let a = read(res).await;
    // 500: the WeChat Pay failure reply, the claim released: retried, not lost.
    assert_eq!((a.status, a.text()), (500, WECHAT_FAIL.to_owned()));
    let res = router
        .oneshot(request("/maybe", &headers, case.body.clone()))
        .await
        .unwrap();
    assert_eq!(read(res).await.text(), "false");
}

#[test]
fn a_channel_route_without_verification_warns_once() {
    use tower::Layer;
    let logs = Logs::default();
    let _guard = logs.capture();
    let warnings = |logs: &Logs| {
        logs.text()
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("without verification"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let handler = tower::service_fn(
        |_req: http::Request<http_body_util::Full<bytes::Bytes>>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        },
    );
    let unverified = IdempotencyLayer::wechatpay_v3();
    let _a = unverified.layer(handler);
    let _b = unverified.clone().layer(handler);
    let got = warnings(&logs);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].contains("wechatpay-v3"), "{got:?}");
    // Verified channels and client APIs say nothing.
    let _c = IdempotencyLayer::wechatpay_v3()
        .verify(wechatpay_v3_keys())
        .layer(handler);
    let _d = IdempotencyLayer::idempotency_key().layer(handler);
    let _e = IdempotencyLayer::client_token().layer(handler);
    assert_eq!(warnings(&logs).len(), 1, "{}", logs.text());
    // Another unverified layer warns for itself.
    let _f = IdempotencyLayer::alipay().layer(handler);
    let got = warnings(&logs);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[1].contains("alipay"), "{got:?}");
}
