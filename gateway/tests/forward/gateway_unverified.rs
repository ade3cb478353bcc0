//! The gateway warns once at start per channel route that does not
//! verify the sender.

use crate::gateway_support;
use test_support::common;

use gateway_support::{temp_path, Gateway};
use std::time::{Duration, Instant};

#[test]
fn the_gateway_warns_once_per_unverified_channel_route() {
    let dir = temp_path("unverified");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         [[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = { secrets = [\"whsec_test_secret\"] }\n\
         [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n\
         [[route]]\nprefix = \"/\"\npreset = \"auto\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    // Two serving threads, each with its own routes: still one warning per route.
    let gw = Gateway::start(
        "http://127.0.0.1:9",
        &["--config", &config, "--workers", "2"],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.log().contains("gateway started") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = gw.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("without verification"))
        .collect();
    assert_eq!(warnings.len(), 2, "{log}");
    assert_eq!(
        warnings
            .iter()
            .filter(|l| l.contains("route=/notify/wechat ") && l.contains("wechatpay-v3"))
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        warnings
            .iter()
            .filter(|l| l.contains("route=/ ") && l.contains("auto"))
            .count(),
        1,
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// On an acknowledge-then-deliver route that does not verify its sender,
/// forged copies of a key with other payloads can fill the entries queued
/// beside it: the next copy (perhaps the genuine one) gets the channel's
/// retryable failure, which the channel retries, not a 422 it would not,
/// and is counted as `too_many_copies`.
#[test]
fn a_copy_past_the_forged_ones_gets_the_retryable_failure() {
    let dir = temp_path("unverified-ack");
    let metrics = common::free_addr();
    let gw = Gateway::start(
        "http://127.0.0.1:9",
        &[
            "--route",
            "/notify/stripe=stripe",
            "--ack-then-deliver",
            "/notify/stripe",
            "--data-dir",
            dir.to_str().unwrap(),
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    let post = |kind: &str| {
        let body = format!(r#"{{"id":"evt_copies","object":"event","type":"{kind}"}}"#);
        gateway_support::raw_http(
            gw.addr,
            format!(
                "POST /notify/stripe HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nStripe-Signature: t=1,v1=00\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    for kind in ["forged.a", "forged.b", "forged.c", "forged.d"] {
        let a = post(kind);
        assert!(a.starts_with("HTTP/1.1 200"), "{kind}: {a}");
    }
    let a = post("charge.succeeded");
    assert!(
        a.starts_with("HTTP/1.1 500"),
        "the copy past the limit gets Stripe's retryable failure: {a}"
    );
    let (_, text) = gateway_support::get(metrics, "/metrics");
    assert!(
        text.lines()
            .any(|l| l.starts_with("idempotency_requests_total{")
                && l.contains("outcome=\"too_many_copies\"")
                && l.ends_with(" 1")),
        "{text}"
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}
