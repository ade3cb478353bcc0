//! The gateway binary against a hostile sender: timestamps past 2^63, long
//! signature lists, bodies that say only what the sender needs, and store
//! and queue passwords that never reach the log or a start error. Each test
//! starts the gateway binary.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;

use common::upstream::Upstream;
use common::vectors::fixture;
use common::{client, post};
use gateway_support::{gateway_bin, temp_path, Proc};
use ring::hmac;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const STRIPE_BODY: &str = "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json";
const STRIPE_SECRET: &str = "whsec_test_secret";
const SW_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const WECHAT_SERIAL: &str = "D7CE59D1F522D701";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn hex_mac(secret: &str, t: &str, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    hmac::sign(&key, &msg)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A folder holding `gateway.toml` with `upstream`, `listen` and `routes`.
fn config(routes: &str, upstream: &str, files: &[(&str, &[u8])]) -> PathBuf {
    let dir = temp_path("hostile");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let text = format!("listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n{routes}");
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    dir
}

fn routes() -> String {
    format!(
        "[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"] }}\n\
         [[route]]\nprefix = \"/hooks\"\npreset = \"standard-webhooks\"\n\
         verify = {{ secrets = [\"{SW_SECRET}\"] }}\n\
         [[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         verify = {{ platform_keys = {{ \"{WECHAT_SERIAL}\" = \"platform.pem\" }} }}\n"
    )
}

fn start(dir: &std::path::Path, log: &std::path::Path) -> Proc {
    Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[],
        Stdio::from(std::fs::File::create(log).unwrap()),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timestamp_past_2_63_is_refused_as_malformed_and_the_connection_answers() {
    let up = Upstream::start().await;
    let cert = fixture("wechatpay_v3_platform_cert.pem");
    let dir = config(&routes(), &up.url(), &[("platform.pem", &cert)]);
    let log = dir.join("stderr.log");
    let gw = start(&dir, &log);
    let client = client();
    let huge = "9223372036854775808";
    let body = fixture(STRIPE_BODY).to_vec();
    let sig = format!("t={huge},v1={}", hex_mac(STRIPE_SECRET, huge, &body));
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("/notify/stripe", vec![("stripe-signature", sig)]),
        (
            "/hooks",
            vec![
                ("webhook-id", "msg_1".into()),
                ("webhook-timestamp", huge.into()),
                ("webhook-signature", "v1,AAAA".into()),
            ],
        ),
        (
            "/notify/wechat",
            vec![
                ("wechatpay-serial", WECHAT_SERIAL.into()),
                ("wechatpay-timestamp", u64::MAX.to_string()),
                ("wechatpay-nonce", "n".into()),
                ("wechatpay-signature", "AAAA".into()),
            ],
        ),
    ];
    for (path, headers) in cases {
        let mut h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        h.push(("content-type", "application/json"));
        let a = post(&client, gw.addr, path, &h, body.clone()).await;
        assert_eq!(a.status, 401, "{path}: {}", a.text());
        let text = a.text();
        assert!(
            !text.contains("timestamp") && !text.contains("malformed"),
            "{path}: {text}"
        );
        if path == "/notify/stripe" {
            assert_eq!(
                text, "signature invalid\n",
                "{path}: the body names no check"
            );
        }
    }
    assert_eq!(up.total(), 0);
    let text = log_with(&log, "malformed timestamp");
    assert!(!text.contains("panicked"), "no panic in the log:\n{text}");
    assert!(
        text.contains("malformed timestamp"),
        "the reason is logged:\n{text}"
    );
    assert!(text.contains("request_id"), "with the request id:\n{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn more_than_16_signature_candidates_are_refused_even_with_a_genuine_one() {
    let up = Upstream::start().await;
    let cert = fixture("wechatpay_v3_platform_cert.pem");
    let dir = config(&routes(), &up.url(), &[("platform.pem", &cert)]);
    let log = dir.join("stderr.log");
    let gw = start(&dir, &log);
    let client = client();
    let body = fixture(STRIPE_BODY).to_vec();
    let t = now().to_string();
    let genuine = hex_mac(STRIPE_SECRET, &t, &body);
    let send = |candidates: usize| {
        let mut header = format!("t={t}");
        for _ in 1..candidates {
            header.push_str(",v1=00");
        }
        header.push_str(&format!(",v1={genuine}"));
        let (client, body) = (client.clone(), body.clone());
        async move {
            let h = [
                ("content-type", "application/json"),
                ("stripe-signature", header.as_str()),
            ];
            post(&client, gw.addr, "/notify/stripe", &h, body).await
        }
    };
    let a = send(17).await;
    assert_eq!(a.status, 401, "17 candidates: {}", a.text());
    assert_eq!(up.total(), 0);
    let a = send(16).await;
    assert_eq!(
        a.status,
        200,
        "16 candidates, the last genuine: {}",
        a.text()
    );
    assert_eq!(up.total(), 1);

    // The 400 KB header of the issue: refused, and the gateway answers the
    // next request at once.
    let mut long = format!("t={t},");
    while long.len() < 400 * 1024 {
        long.push_str("v1=,");
    }
    let h = [
        ("content-type", "application/json"),
        ("stripe-signature", long.as_str()),
    ];
    let a = post(&client, gw.addr, "/notify/stripe", &h, body.clone()).await;
    assert_eq!(a.status, 401, "{}", a.text());
    let text = log_with(&log, "more than 16");
    assert!(text.contains("more than 16"), "the log says why:\n{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_upstream_answers_bad_gateway_and_logs_the_error_chain() {
    // A port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let upstream = format!("http://127.0.0.1:{port}");
    let dir = config("", &upstream, &[]);
    let log = dir.join("stderr.log");
    let gw = start(&dir, &log);
    let h = [
        ("content-type", "application/json"),
        ("x-request-id", "req-502-test"),
    ];
    let a = post(&client(), gw.addr, "/anything", &h, "{}").await;
    assert_eq!(a.status, 502);
    assert_eq!(a.text(), "bad gateway\n", "the body carries no error chain");
    let mut text = String::new();
    for _ in 0..100 {
        text = std::fs::read_to_string(&log).unwrap();
        if text.contains("req-502-test") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        text.contains("req-502-test"),
        "the request id is logged:\n{text}"
    );
    assert!(
        text.contains("Connection refused") || text.contains("connect"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn run_to_exit(args: &[&str]) -> (i32, String) {
    let out = Command::new(gateway_bin())
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stdout));
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_store_or_queue_password_is_never_echoed_in_a_start_error() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let url = format!("redis://:s3cr3t-pw@127.0.0.1:{port}");
    let (code, text) = run_to_exit(&[
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--store",
        &url,
    ]);
    assert_ne!(code, 0, "an unreachable store stops the start: {text}");
    assert!(!text.contains("s3cr3t-pw"), "the password leaked:\n{text}");
    assert!(
        text.contains(&format!("redis://:***@127.0.0.1:{port}")),
        "{text}"
    );

    let data = temp_path("hostile-data");
    let (code, text) = run_to_exit(&[
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--route",
        "/notify/stripe=stripe",
        "--ack-then-deliver",
        "/notify/stripe",
        "--queue",
        &format!("redis://user:s3cr3t-pw@127.0.0.1:{port}/0"),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "an unreachable queue stops the start: {text}");
    assert!(!text.contains("s3cr3t-pw"), "the password leaked:\n{text}");
    assert!(text.contains("redis://user:***@127.0.0.1"), "{text}");
    let _ = std::fs::remove_dir_all(data);
}

#[test]
fn a_store_password_is_never_logged_when_the_gateway_starts() {
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let reply =
        support_redis::raw_command(redis.port(), "CONFIG SET requirepass s3cr3t-pw").unwrap();
    assert!(reply.contains("OK"), "{reply}");
    let url = format!("redis://:s3cr3t-pw@127.0.0.1:{}", redis.port());
    let log = temp_path("hostile-log");
    let data = temp_path("hostile-data");
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--store",
            &url,
            "--route",
            "/notify/stripe=stripe",
            "--ack-then-deliver",
            "/notify/stripe",
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let mut text = String::new();
    for _ in 0..100 {
        text = std::fs::read_to_string(&log).unwrap();
        if text.contains("gateway started") && text.contains("delivering queued") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(gw);
    assert!(text.contains("gateway started"), "{text}");
    assert!(!text.contains("s3cr3t-pw"), "the password leaked:\n{text}");
    assert!(
        text.contains("redis://:***@127.0.0.1"),
        "the queue is named, redacted:\n{text}"
    );
    let _ = std::fs::remove_file(log);
    let _ = std::fs::remove_dir_all(data);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_signed_body_read_two_ways_is_refused_before_the_claim_and_the_genuine_copy_runs() {
    let up = Upstream::start().await;
    let routes = "[[route]]\nprefix = \"/notify/adyen\"\npreset = \"adyen\"\n\
                  verify = { hmac_keys = [\"74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174\"] }\n";
    let dir = config(routes, &up.url(), &[]);
    let log = dir.join("stderr.log");
    let gw = start(&dir, &log);
    let client = client();
    let genuine = fixture("adyen_notify_adyen-python_colon_ENVELOPED.json");
    let text = String::from_utf8(genuine.to_vec()).unwrap();
    // The captured genuine item, and before it a second `notificationItems`
    // with an invented item: the verifier of old checked the last, the key
    // read the first.
    let forged = text.replacen(
        "\"notificationItems\"",
        "\"notificationItems\": [{\"NotificationRequestItem\": {\"pspReference\": \"INVENTED\", \
         \"eventCode\": \"AUTHORISATION\", \"success\": \"true\"}}], \"notificationItems\"",
        1,
    );
    let h = [("content-type", "application/json")];
    let a = post(&client, gw.addr, "/notify/adyen", &h, forged).await;
    assert_eq!(a.status, 401, "{}", a.text());
    assert_eq!(up.total(), 0, "the forged copy never reached the upstream");
    let a = post(&client, gw.addr, "/notify/adyen", &h, genuine.to_vec()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        !a.replayed(),
        "the genuine copy runs: the forged one claimed nothing"
    );
    assert_eq!(up.total(), 1);
    let text = log_with(&log, "repeated JSON member");
    assert!(text.contains("repeated JSON member"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Alipay signs the sorted `k=v` pairs of the decoded values joined with
/// `&`: folding `notify_time` into `notify_id` (`%26notify_time%3D…`) keeps
/// the signed string byte for byte and changes the key. Refused: a decoded
/// value holding `&` and then `=` would read as a field boundary.
#[tokio::test(flavor = "multi_thread")]
async fn an_alipay_field_folded_into_another_is_refused_and_the_payment_runs_once() {
    let up = Upstream::start().await;
    let pem = fixture("alipay_public_key_trade_status_sync.pem");
    let routes = "[[route]]\nprefix = \"/notify/alipay\"\npreset = \"alipay\"\n\
                  verify = { public_keys = [\"alipay.pem\"] }\n";
    let dir = config(routes, &up.url(), &[("alipay.pem", &pem)]);
    let log = dir.join("stderr.log");
    let gw = start(&dir, &log);
    let client = client();
    let genuine = String::from_utf8(
        fixture("alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form").to_vec(),
    )
    .unwrap();
    let id = "notify_id=2019081500222155624068450559358070";
    let time = "&notify_time=2019-08-15%2015%3A56%3A25";
    assert!(genuine.contains(id) && genuine.contains(time));
    let folded = genuine.replacen(time, "", 1).replacen(
        id,
        &format!("{id}%26notify_time%3D2019-08-15+15%3A56%3A25"),
        1,
    );
    let h = [("content-type", "application/x-www-form-urlencoded")];
    let a = post(&client, gw.addr, "/notify/alipay", &h, genuine.clone()).await;
    assert_eq!((a.status, a.text().as_str()), (200, "success"));
    assert_eq!(up.total(), 1);
    let a = post(&client, gw.addr, "/notify/alipay", &h, folded.clone()).await;
    assert_eq!(
        a.status,
        401,
        "the folded copy is refused, not run under a new key: {}",
        a.text()
    );
    assert_eq!(up.total(), 1, "one payment, one run upstream");
    let text = log_with(&log, "field boundary");
    assert!(text.contains("field boundary"), "the log says why:\n{text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The log once it holds `needle` (its writer is non-blocking: a line may
/// reach the file a little after the answer), or as it is after 10 s.
fn log_with(log: &std::path::Path, needle: &str) -> String {
    let mut text = String::new();
    for _ in 0..500 {
        text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    text
}
