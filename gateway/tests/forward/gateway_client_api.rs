//! The client API through the gateway binary, over real TCP: the
//! fingerprint covers the query, the `Idempotency-Key` string form is the
//! same key, refusals are `application/problem+json` (channel replies stay
//! byte-exact), and `--principal-cookie` scopes keys by session.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::vectors::STRIPE_VECTORS;
use gateway_support::raw::{raw, Raw};
use gateway_support::{gateway_bin, temp_path, Gateway};
use std::path::PathBuf;
use std::time::Duration;

/// A config file with `text` (given to the gateway with `--config`).
fn config(text: &str) -> PathBuf {
    let path = temp_path("client.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn problem(a: &Raw, status: u16, title: &str) -> serde_json::Value {
    assert_eq!(a.status, status, "{a:?}");
    assert_eq!(
        a.header("content-type").as_deref(),
        Some("application/problem+json"),
        "{a:?}"
    );
    let json: serde_json::Value = serde_json::from_str(&a.body).unwrap_or_else(|e| {
        panic!("not JSON ({e}): {a:?}");
    });
    for field in ["type", "title", "detail"] {
        assert!(json[field].is_string(), "`{field}` in {json}");
    }
    assert_eq!(json["title"], title, "{json}");
    json
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_keys_cover_the_query_take_the_string_form_and_refuse_as_problem_details() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &["--route", "/api=idempotency-key", "--wait", "0s"],
    );
    let json = ("content-type", "application/json");
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay?amount=1",
        &[("idempotency-key", "pay-1"), json],
        b"{}",
    );
    assert_eq!(a.status, 200, "{a:?}");
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay?amount=1000",
        &[("idempotency-key", "pay-1"), json],
        b"{}",
    );
    problem(&a, 422, "Idempotency-Key is already used");
    assert_eq!(up.total(), 1);
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay?amount=1",
        &[("idempotency-key", "pay-1"), json],
        b"{}",
    );
    assert!(a.replayed(), "{a:?}");

    // The structured-field string form is the same key.
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay?amount=1",
        &[("idempotency-key", "\"pay-1\""), json],
        b"{}",
    );
    assert_eq!(a.status, 200, "{a:?}");
    assert!(a.replayed(), "`\"pay-1\"` is the key `pay-1`: {a:?}");
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay",
        &[("idempotency-key", "\"unclosed"), json],
        b"{}",
    );
    problem(&a, 400, "Idempotency-Key is malformed");
    // A bare key is visible ASCII: a space is refused, never taken as a key;
    // inside the string form's quotes it is part of the key.
    let calls = up.total();
    for bare in ["a b", "a\tb"] {
        let a = raw(
            gw.addr,
            "POST",
            b"/api/pay",
            &[("idempotency-key", bare), json],
            b"{}",
        );
        let p = problem(&a, 400, "Idempotency-Key is malformed");
        assert!(
            p["detail"].as_str().unwrap().contains("visible ASCII"),
            "{p}"
        );
    }
    assert_eq!(
        up.total(),
        calls,
        "a malformed key never reaches the upstream"
    );
    for (value, replayed) in [("\"a b\"", false), ("\"a b\"", true)] {
        let a = raw(
            gw.addr,
            "POST",
            b"/api/pay",
            &[("idempotency-key", value), json],
            b"{}",
        );
        assert_eq!((a.status, a.replayed()), (200, replayed), "{a:?}");
    }
    assert_eq!(up.total(), calls + 1);
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay",
        &[
            ("idempotency-key", "123e4567-e89b-12d3-a456-426614174000"),
            json,
        ],
        b"{}",
    );
    assert_eq!(a.status, 200, "a UUID (digits first) is a key: {a:?}");

    let a = raw(gw.addr, "POST", b"/api/pay", &[json], b"{}");
    let p = problem(&a, 400, "Idempotency-Key is missing");
    assert!(
        p["detail"].as_str().unwrap().contains("Idempotency-Key"),
        "{p}"
    );

    // In flight: the first copy holds the key for 1.5 s.
    let slow = [("idempotency-key", "slow-1"), ("x-delay-ms", "1500"), json];
    let addr = gw.addr;
    let first = std::thread::spawn(move || raw(addr, "POST", b"/api/slow", &slow, b"{}"));
    while up.calls("/api/slow") == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a = raw(gw.addr, "POST", b"/api/slow", &slow, b"{}");
    problem(&a, 409, "A request is outstanding for this Idempotency-Key");
    assert!(a.header("retry-after").is_some(), "{a:?}");
    assert_eq!(first.join().unwrap().status, 200);
    assert_eq!(up.calls("/api/slow"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_replies_stay_byte_exact() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &["--route", "/n=stripe"]);
    let v = &STRIPE_VECTORS[0];
    let base = v.base();
    let headers = base.header_refs();
    let a = raw(gw.addr, "POST", b"/n", &headers, &base.body);
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.body, r#"{"received":true}"#);
    // A body without the key: a plain refusal, not problem details.
    let a = raw(gw.addr, "POST", b"/n", &headers, b"{}");
    assert_eq!(a.status, 400, "{a:?}");
    assert_ne!(
        a.header("content-type").as_deref(),
        Some("application/problem+json")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principal_cookie_scopes_client_keys_by_session() {
    let up = Upstream::start().await;
    let cfg = config(
        "principal_cookie = \"sid\"\n[[route]]\nprefix = \"/cfg\"\npreset = \"idempotency-key\"\n",
    );
    let flag = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/flag=idempotency-key",
            "--principal-cookie",
            "sid",
        ],
    );
    let file = Gateway::start(&up.url(), &["--config", cfg.to_str().unwrap()]);
    for (gw, path) in [(&flag, "/flag"), (&file, "/cfg")] {
        let send = |cookie: &str| {
            let mut h = vec![
                ("idempotency-key", "order-1"),
                ("content-type", "application/json"),
            ];
            if !cookie.is_empty() {
                h.push(("cookie", cookie));
            }
            raw(gw.addr, "POST", path.as_bytes(), &h, b"{\"sku\":\"tea\"}")
        };
        let alice = send("theme=dark; sid=alice");
        assert_eq!(
            alice.body,
            format!("upstream call 1 for {path}"),
            "{alice:?}"
        );
        let bob = send("sid=bob");
        assert_eq!(bob.body, format!("upstream call 2 for {path}"), "{bob:?}");
        let again = send("sid=alice; theme=light");
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, format!("upstream call 1 for {path}"));
        // Without the cookie (and without Authorization) the key is scoped
        // to the route alone: a scope of its own, apart from every session.
        let anonymous = send("");
        assert_eq!(
            anonymous.body,
            format!("upstream call 3 for {path}"),
            "{anonymous:?}"
        );
        assert_eq!(up.calls(path), 3);
    }
    let _ = std::fs::remove_file(cfg);
}

#[test]
fn a_bad_principal_cookie_name_exits_2() {
    for args in [
        vec!["--principal-cookie", "s id"],
        vec!["--principal-cookie", "s;id"],
    ] {
        let out = std::process::Command::new(gateway_bin())
            .args([
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
            ])
            .args(&args)
            .arg("--check-config")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("not a cookie name"), "{args:?}: {stderr}");
    }
    let cfg = config("principal_cookie = \"a=b\"\n");
    let out = std::process::Command::new(gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
            "--check-config",
        ])
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(":1:") && stderr.contains("principal_cookie"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(cfg);
}
