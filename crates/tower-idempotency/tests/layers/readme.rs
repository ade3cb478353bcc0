//! The README's quick start, exactly as the README shows it (this file
//! includes its two `main.rs` and checks that the README holds them
//! verbatim, and that its `cargo add` lines name every crate and feature
//! they use): an `Idempotency-Key` API, and a route serving a real WeChat
//! Pay v3 notification (wechatpay-go's test vector) whose refusals are
//! logged with the request's id; and the warning a channel route without
//! verification gives.

use test_support::common;
use test_support::verify_support;

use common::vectors::{WECHAT_FAIL, WECHAT_SUCCESS};
use common::{read, request};
use std::io::Write;
use std::sync::{Arc, Mutex};
use tower::ServiceExt;
use verify_support::{at, meta, wechatpay_v3, wechatpay_v3_keys};

use tower_idempotency::IdempotencyLayer;

/// The README's first `main.rs`, and what it does.
#[allow(dead_code)]
mod key_example {
    include!("readme/key_example.rs");

    use super::{read, request, Logs, ServiceExt};

    /// The first program: one order per key, the retry answered from the
    /// record; a key with a space is refused.
    #[tokio::test(flavor = "current_thread")]
    async fn the_readme_key_example_runs_one_order_per_key() {
        let router = app();
        let send = |key: &'static str, body: &'static str| {
            let router = router.clone();
            async move {
                let req = request("/orders", &[("idempotency-key", key)], body);
                read(router.oneshot(req).await.unwrap()).await
            }
        };
        let first = send("7f1c-order-1", "book").await;
        assert_eq!(
            (first.status, first.text()),
            (200, "order created from book\n".to_owned())
        );
        assert!(!first.replayed());
        let again = send("7f1c-order-1", "book").await;
        assert!(again.replayed(), "{}", again.text());
        assert_eq!(again.text(), first.text());
        assert_eq!(send("7f1c-order-1", "two books").await.status, 422);
        assert_eq!(send("a b", "book").await.status, 400);
    }

    /// A refusal for a reused key is logged with the request's id, as the
    /// verify layer's refusals are.
    #[tokio::test(flavor = "current_thread")]
    async fn a_reused_key_is_logged_with_the_request_id() {
        let logs = Logs::default();
        let _guard = logs.capture();
        let router = app();
        for (body, status) in [("book", 200), ("two books", 422)] {
            let headers = [("idempotency-key", "k-9"), ("x-request-id", "req-9")];
            let res = router
                .clone()
                .oneshot(request("/orders", &headers, body))
                .await
                .unwrap();
            assert_eq!(read(res).await.status, status);
        }
        let text = logs.text();
        let line = text
            .lines()
            .find(|l| l.contains("reused with a different payload"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains("request_id=\"req-9\""), "{line}");
    }
}

/// The README's second `main.rs`, and what it does.
#[allow(dead_code)]
mod channel_example {
    include!("readme/channel_example.rs");

    use super::*;

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
        // With the README's own keys (the system clock) the 2021 vector is stale:
        // refused, and the reason is logged with the request's id, the sender's
        // or a new one, which the answer carries too.
        let keys = || {
            WechatPayV3Keys::new()
                .platform_key(PLATFORM_SERIAL, PLATFORM_CERT)
                .unwrap()
                .api_v3_key(API_V3_KEY)
                .unwrap()
        };
        let mut with_id = headers.clone();
        with_id.push(("x-request-id", "replay-7"));
        let res = app(keys())
            .oneshot(request("/notify/wechatpay", &with_id, case.body.clone()))
            .await
            .unwrap();
        let a = read(res).await;
        assert_eq!((a.status, a.text()), (401, WECHAT_FAIL.to_owned()));
        assert_eq!(a.headers["x-request-id"], "replay-7");
        let refused = |id: &str| {
            logs.text()
                .lines()
                .filter(|l| {
                    l.contains("unverified request refused")
                        && l.contains(&format!("request_id=\"{id}\""))
                })
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let lines = refused("replay-7");
        assert_eq!(lines.len(), 1, "{}", logs.text());
        assert!(
            lines[0].contains("timestamp outside the tolerance"),
            "{lines:?}"
        );
        let res = app(keys())
            .oneshot(request("/notify/wechatpay", &headers, case.body.clone()))
            .await
            .unwrap();
        let a = read(res).await;
        assert_eq!(a.status, 401);
        let generated = a.headers["x-request-id"].to_str().unwrap().to_owned();
        assert_eq!(generated.len(), 36, "a UUID: {generated}");
        assert_eq!(refused(&generated).len(), 1, "{}", logs.text());
        assert_eq!(
            logs.text().lines().filter(|l| l.contains(" paid")).count(),
            1
        );
    }

    /// Without a request id (no tower-http layer) the refusal's line has no
    /// empty `request_id=""`.
    #[tokio::test(flavor = "current_thread")]
    async fn a_refusal_without_a_request_id_logs_none() {
        let logs = Logs::default();
        let _guard = logs.capture();
        let case = wechatpay_v3();
        let router: Router = Router::new().route(
            "/n",
            post(on_wechat_paid)
                .layer(IdempotencyLayer::wechatpay_v3().verify(wechatpay_v3_keys())),
        );
        let res = router
            .oneshot(request("/n", &pairs(&case.headers), case.body.clone()))
            .await
            .unwrap();
        assert_eq!(read(res).await.status, 401);
        let text = logs.text();
        let line = text
            .lines()
            .find(|l| l.contains("unverified request refused"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(!line.contains("request_id"), "{line}");
        assert!(line.contains("timestamp outside the tolerance"), "{line}");
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
}

const README: &str = include_str!("../../README.md");

/// The README's blocks of `lang` (`rust` matches `rust,no_run`), in order.
fn blocks(lang: &str) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut rest = README;
    while let Some(at) = rest.find("\n```") {
        let fence = &rest[at + 4..];
        let line_end = fence.find('\n').unwrap();
        let info = &fence[..line_end];
        let body = &fence[line_end + 1..];
        let end = body.find("\n```").expect("a closed block");
        if info.split(',').next() == Some(lang) {
            out.push(&body[..end + 1]);
        }
        rest = &body[end + 4..];
    }
    out
}

#[test]
fn the_readme_opens_with_these_two_programs() {
    let rust = blocks("rust");
    assert_eq!(
        rust[0],
        include_str!("readme/key_example.rs"),
        "README.md's first Rust block is no longer tests/layers/readme/key_example.rs"
    );
    assert_eq!(
        rust[1],
        include_str!("readme/channel_example.rs"),
        "README.md's second Rust block is no longer tests/layers/readme/channel_example.rs"
    );
    let fence = |body: &str| {
        README[..README.find(body).unwrap()]
            .rsplit("```")
            .next()
            .unwrap()
            .to_owned()
    };
    for body in &rust[..2] {
        assert!(
            fence(body).starts_with("rust,no_run"),
            "a whole program: no_run, not a snippet"
        );
    }
}

/// The `cargo add` lines before the examples name every crate they use,
/// with the features they need; the layers' own line is the path form
/// (the crates are not published yet).
#[test]
fn the_readme_install_lines_add_every_crate_the_examples_use() {
    let install = blocks("sh")[0];
    let adds: Vec<Vec<&str>> = install
        .lines()
        .filter_map(|l| {
            l.split('#')
                .next()
                .unwrap()
                .trim()
                .strip_prefix("cargo add ")
        })
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(!adds.is_empty(), "{install}");
    let added = |krate: &str| adds.iter().find(|words| words.contains(&krate));
    let features = |krate: &str| -> Vec<String> {
        let words = added(krate).unwrap_or_else(|| panic!("`cargo add {krate}` in {install}"));
        let at = words.iter().position(|w| *w == "--features" || *w == "-F");
        at.map(|i| words[i + 1].split(',').map(str::to_owned).collect())
            .unwrap_or_default()
    };
    let rust = blocks("rust");
    for program in &rust[..2] {
        for line in program.lines() {
            let Some(path) = line.strip_prefix("use ") else {
                continue;
            };
            let krate = path.split("::").next().unwrap().replace('_', "-");
            assert!(
                added(&krate).is_some(),
                "`use {path}`: no `cargo add {krate}` in {install}"
            );
        }
        for krate in ["tokio", "serde_json", "tracing", "tracing_subscriber"] {
            if program.contains(&format!("{krate}::")) {
                let krate = krate.replace('_', "-");
                let krate = if krate == "serde-json" {
                    "serde_json".to_owned()
                } else {
                    krate
                };
                assert!(
                    added(&krate).is_some(),
                    "{krate}: no `cargo add {krate}` in {install}"
                );
            }
        }
    }
    let ours = added("tower-idempotency").unwrap();
    assert!(ours.contains(&"--path"), "the path form: {install}");
    // axum's `Handler` error cannot name these: the line must.
    let ours = features("tower-idempotency");
    for feature in ["axum", "verify", "tracing"] {
        assert!(ours.iter().any(|f| f == feature), "`{feature}` in {ours:?}");
    }
    assert!(features("tower-http").iter().any(|f| f == "request-id"));
    let tokio = features("tokio");
    assert!(
        tokio.iter().any(|f| f == "full")
            || ["macros", "rt-multi-thread", "net"]
                .iter()
                .all(|f| tokio.iter().any(|t| t == f)),
        "{tokio:?}"
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
