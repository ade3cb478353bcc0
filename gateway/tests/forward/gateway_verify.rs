//! The gateway verifying signatures from its config file's `verify`
//! tables. Each test starts the
//! gateway binary.
//!
//! The Stripe and Standard Webhooks fixtures are signed at fixed old
//! timestamps and the gateway reads the system clock, so the tests re-sign the
//! fixture bodies with the fixtures' secrets at the current time, with the
//! channels' own algorithm (HMAC-SHA256).

use crate::gateway_support;
use test_support::common;

use base64::Engine;
use bytes::Bytes;
use common::upstream::Upstream;
use common::vectors::{self, fixture, STRIPE};
use common::{all_at_once, client, post, Answer, HttpClient};
use gateway_support::{gateway_bin, stripe_signature, temp_path, Proc};
use ring::hmac;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

const STRIPE_BODY: &str = "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json";
const STRIPE_SECRET: &str = "whsec_test_secret";
const SW_BODY: &str = "standard_webhooks_standard-webhooks_rust_test.json";
const SW_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const WECHAT_CERT: &str = "wechatpay_v3_platform_cert.pem";
const WECHAT_SERIAL: &str = "D7CE59D1F522D701";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `webhook-signature` for `id.t.body`: `v1,` and the base64 HMAC-SHA256
/// keyed with the base64-decoded secret after `whsec_`.
fn standard_signature(secret: &str, id: &str, t: u64, body: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let raw = b64.decode(secret.strip_prefix("whsec_").unwrap()).unwrap();
    let key = hmac::Key::new(hmac::HMAC_SHA256, &raw);
    let mut msg = format!("{id}.{t}.").into_bytes();
    msg.extend_from_slice(body);
    format!("v1,{}", b64.encode(hmac::sign(&key, &msg)))
}

/// A folder holding `gateway.toml` (with `upstream` and `listen` set) and
/// the given extra files.
fn config_dir(routes: &str, upstream: &str, files: &[(&str, &[u8])]) -> PathBuf {
    let dir = temp_path("verify");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let text = format!("listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n{routes}");
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    dir
}

/// `gateway --check-config --config DIR/gateway.toml`: exit status, stderr.
fn check(dir: &Path) -> (i32, String) {
    let out = Command::new(gateway_bin())
        .arg("--check-config")
        .arg("--config")
        .arg(dir.join("gateway.toml"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `copies` copies of one request at once.
async fn storm(
    client: &HttpClient,
    addr: SocketAddr,
    path: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    copies: usize,
) -> Vec<Answer> {
    all_at_once(copies, |_| {
        let (client, headers, body) = (client.clone(), headers.clone(), body.clone());
        async move {
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            post(&client, addr, path, &h, body).await
        }
    })
    .await
}

fn stripe_headers(signature: String) -> Vec<(String, String)> {
    vec![
        ("content-type".into(), "application/json".into()),
        ("stripe-signature".into(), signature),
    ]
}

fn assert_stripe_success(a: &Answer, what: &str) {
    vectors::check(a, STRIPE.success.expect("a fixed reply"), what);
}

fn assert_refused(a: &Answer, what: &str) {
    assert_eq!(a.status, 401, "{what}: a refusal, got {}", a.text());
    assert!(!a.replayed(), "{what}: never a replay");
}

#[tokio::test(flavor = "multi_thread")]
async fn stripe_genuine_copies_run_once_and_forged_or_stale_ones_never_reach_the_upstream() {
    let up = Upstream::start().await;
    let routes = format!(
        "[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n"
    );
    let dir = config_dir(&routes, &up.url(), &[]);
    assert_eq!(check(&dir).0, 0, "{}", check(&dir).1);
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[],
        Stdio::null(),
    );
    let client = client();
    let body = fixture(STRIPE_BODY).to_vec();

    // A forged copy (the real event id, a bad signature) first: refused, and
    // it claims nothing, so the genuine copies that follow run at once.
    let mut forged = stripe_signature(STRIPE_SECRET, now(), &body);
    forged.replace_range(forged.len() - 4.., "0000");
    for a in storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(forged),
        body.clone(),
        3,
    )
    .await
    {
        assert_refused(&a, "forged signature");
    }
    let wrong_key = stripe_signature("whsec_not_the_secret", now(), &body);
    let a = &storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(wrong_key),
        body.clone(),
        1,
    )
    .await[0];
    assert_refused(a, "signed with another secret");
    let stale = stripe_signature(STRIPE_SECRET, now() - 3600, &body);
    let a = &storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(stale),
        body.clone(),
        1,
    )
    .await[0];
    assert_refused(a, "stale timestamp");
    let mut tampered = body.clone();
    tampered.extend_from_slice(b" ");
    let sig = stripe_signature(STRIPE_SECRET, now(), &body);
    let a = &storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(sig),
        tampered,
        1,
    )
    .await[0];
    assert_refused(a, "body changed after signing");
    assert_eq!(up.total(), 0, "a refused copy reached the upstream");

    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    let answers = storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(genuine),
        body.clone(),
        7,
    )
    .await;
    for (i, a) in answers.iter().enumerate() {
        assert_stripe_success(a, &format!("genuine copy {i}"));
    }
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "one copy ran, the others were replayed"
    );
    assert_eq!(up.total(), 1, "the upstream ran once");

    // A forged copy after the genuine one is still refused, not replayed.
    let forged = stripe_signature("whsec_forger", now(), &body);
    let a = &storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(forged),
        body,
        1,
    )
    .await[0];
    assert_refused(a, "forged after the genuine one");
    assert_eq!(up.total(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn standard_webhooks_rotation_either_secret_verifies_from_env_or_file() {
    let up = Upstream::start().await;
    let new_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let routes = "[[route]]\nprefix = \"/hooks\"\npreset = \"standard-webhooks\"\n\
                  verify = { secrets = [{ env = \"GW_VERIFY_TEST_OLD\" }, { file = \"new.secret\" }], tolerance = \"5m\" }\n";
    let dir = config_dir(
        routes,
        &up.url(),
        &[("new.secret", format!("{new_secret}\n").as_bytes())],
    );
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[("GW_VERIFY_TEST_OLD", SW_SECRET)],
        Stdio::null(),
    );
    let client = client();
    let body = fixture(SW_BODY).to_vec();
    let send = |secret: &str, id: &str, t: u64| {
        let headers = vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("webhook-id".to_owned(), id.to_owned()),
            ("webhook-timestamp".to_owned(), t.to_string()),
            (
                "webhook-signature".to_owned(),
                standard_signature(secret, id, t, &body),
            ),
        ];
        storm(&client, gw.addr, "/hooks", headers, body.clone(), 1)
    };
    let a = &send(SW_SECRET, "msg_old_key", now()).await[0];
    assert_eq!(a.status, 204, "the old secret verifies: {}", a.text());
    let a = &send(new_secret, "msg_new_key", now()).await[0];
    assert_eq!(a.status, 204, "the new secret verifies: {}", a.text());
    assert_eq!(up.total(), 2);

    let a = &send(
        "whsec_dGhpcyBpcyBub3QgYSBjb25maWd1cmVkIGtleQ==",
        "msg_other",
        now(),
    )
    .await[0];
    assert_refused(a, "a third secret");
    let a = &send(SW_SECRET, "msg_stale", now() - 600).await[0];
    assert_refused(a, "stale timestamp");
    assert_eq!(up.total(), 2, "a refused copy reached the upstream");
    let _ = std::fs::remove_dir_all(dir);
}

/// The WeChat Pay v3 table of the issue, with a platform certificate file and
/// an APIv3 key file next to the config file.
fn wechat_routes(extra: &str) -> String {
    format!(
        "[[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{WECHAT_SERIAL}\" = \"wechatpay_platform.pem\" }}, \
         api_v3_key_file = \"apiv3.key\", tolerance = \"5m\"{extra} }}\n"
    )
}

/// What is wrong, the routes, the files beside the config, what the error names.
type BadCase<'a> = (&'a str, String, Vec<(&'a str, &'a [u8])>, &'a str);

const API_V3_KEY: &[u8] = b"0123456789abcdef0123456789abcdef\n";

#[test]
fn wechatpay_v3_verify_table_is_checked_at_check_config() {
    let cert = fixture(WECHAT_CERT).to_vec();
    let up = "http://127.0.0.1:9";
    let dir = config_dir(
        &wechat_routes(""),
        up,
        &[("wechatpay_platform.pem", &cert), ("apiv3.key", API_V3_KEY)],
    );
    let (code, err) = check(&dir);
    assert_eq!(code, 0, "a good verify table: {err}");

    // Each bad table exits 2 naming the config file's line 6 (the route's
    // `verify`) and the reason.
    let bad_pem: &[u8] = b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n";
    let cases: [BadCase<'_>; 6] = [
        (
            "a platform key file that is no certificate",
            wechat_routes(""),
            vec![
                ("wechatpay_platform.pem", bad_pem),
                ("apiv3.key", API_V3_KEY),
            ],
            "",
        ),
        (
            "a missing platform key file",
            wechat_routes(""),
            vec![("apiv3.key", API_V3_KEY)],
            "wechatpay_platform.pem",
        ),
        (
            "an APIv3 key of the wrong length",
            wechat_routes(""),
            vec![("wechatpay_platform.pem", &cert), ("apiv3.key", b"short")],
            "APIv3",
        ),
        (
            "an unknown field",
            wechat_routes(", platfrom_keys = {}"),
            vec![("wechatpay_platform.pem", &cert), ("apiv3.key", API_V3_KEY)],
            "platfrom_keys",
        ),
        (
            "a field the preset does not read",
            wechat_routes(", secrets = [\"whsec_x\"]"),
            vec![("wechatpay_platform.pem", &cert), ("apiv3.key", API_V3_KEY)],
            "secrets",
        ),
        (
            "a bad tolerance",
            wechat_routes("").replace("\"5m\"", "\"soon\""),
            vec![("wechatpay_platform.pem", &cert), ("apiv3.key", API_V3_KEY)],
            "tolerance",
        ),
    ];
    for (what, routes, files, needle) in cases {
        let dir = config_dir(&routes, up, &files);
        let (code, err) = check(&dir);
        assert_eq!(code, 2, "{what}: {err}");
        assert!(err.contains("gateway.toml:6:"), "{what}: the line: {err}");
        assert!(err.contains("verify"), "{what}: {err}");
        assert!(err.contains(needle), "{what}: the reason {needle:?}: {err}");
        // The server refuses to start the same way.
        let out = Command::new(gateway_bin())
            .arg("--config")
            .arg(dir.join("gateway.toml"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{what}: the server starts");
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_verify_table_on_an_auto_route_or_a_preset_without_verifier_exits_2() {
    let up = "http://127.0.0.1:9";
    for (preset, needle) in [("auto", "auto"), ("idempotency-key", "idempotency-key")] {
        let routes = format!(
            "[[route]]\nprefix = \"/\"\npreset = \"{preset}\"\n\
             verify = {{ secrets = [\"{STRIPE_SECRET}\"] }}\n"
        );
        let dir = config_dir(&routes, up, &[]);
        let (code, err) = check(&dir);
        assert_eq!(code, 2, "{preset}: {err}");
        assert!(err.contains("gateway.toml:6:"), "{preset}: the line: {err}");
        assert!(err.contains(needle), "{preset}: {err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// On an ack-then-deliver route the signature is checked before the
/// notification is queued: a forged copy (tampered body, bad signature) is
/// refused and never queued, so the one delivery the upstream sees carries
/// the genuine body.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_notification_on_a_verified_ack_route_is_never_queued() {
    let up = Upstream::start().await;
    let data = temp_path("verify-ack");
    let routes = format!(
        "data_dir = \"{}\"\n[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         mode = \"ack-then-deliver\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n",
        data.display()
    );
    let dir = config_dir(&routes, &up.url(), &[]);
    assert_eq!(check(&dir).0, 0, "{}", check(&dir).1);
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[],
        Stdio::null(),
    );
    let client = client();
    let body = fixture(STRIPE_BODY).to_vec();

    // Forged first: the real event id, a changed body, a signature of the
    // genuine body. Were it queued, its body would be the one delivered.
    let mut tampered = body.clone();
    tampered.extend_from_slice(b" ");
    let sig = stripe_signature(STRIPE_SECRET, now(), &body);
    for a in storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(sig),
        tampered,
        3,
    )
    .await
    {
        assert_refused(&a, "forged copy on an ack route");
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(up.total(), 0, "a forged copy was delivered");

    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    for a in storm(
        &client,
        gw.addr,
        "/notify/stripe",
        stripe_headers(genuine),
        body.clone(),
        7,
    )
    .await
    {
        assert_stripe_success(&a, "genuine copy on an ack route");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while up.total() == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let delivered = up.seen();
    assert_eq!(delivered.len(), 1, "one delivery for 7 genuine copies");
    assert_eq!(
        delivered[0].body,
        Bytes::from(body),
        "the genuine body was delivered"
    );
}
