//! One view of a request through the gateway binary, over real TCP: the
//! path is normalised once at the entrance and routed, scoped, verified and
//! forwarded in that one form; what cannot be normalised safely is refused
//! on guarded routes; `auto` never accepts a preset another route verifies;
//! channel routes take POST only and are never scoped to a principal; the
//! client API's fingerprint covers the query, its refusals are
//! `application/problem+json`, and cookie sessions can scope its keys.
//!
//! Build the binary first when running this file alone:
//! `cargo build --all-features --example gateway && cargo test --all-features --test gateway_paths`.

mod common;
mod gateway_support;

use common::upstream::Upstream;
use common::vectors::{fixture, STRIPE_VECTORS};
use gateway_support::{gateway_bin, temp_path, Gateway};
use ring::hmac;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const STRIPE_BODY: &str = "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json";
const STRIPE_SECRET: &str = "whsec_test_secret";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `Stripe-Signature` for `body` at `t` (hex HMAC-SHA256 of `t.body`).
fn stripe_signature(secret: &str, t: u64, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    let hex: String = hmac::sign(&key, &msg)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={hex}")
}

/// A config file with `routes` (given to the gateway with `--config`).
fn config(routes: &str) -> PathBuf {
    let path = temp_path("paths.toml");
    std::fs::write(&path, routes).unwrap();
    path
}

/// The issue's config: a verified Stripe route and a catch-all `auto`.
fn stripe_and_auto() -> PathBuf {
    config(&format!(
        "[[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n\
         [[route]]\nprefix = \"/\"\npreset = \"auto\"\n"
    ))
}

/// An answer read off the wire.
#[derive(Debug)]
struct Raw {
    status: u16,
    head: String,
    body: String,
}

impl Raw {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }
}

/// `METHOD target` exactly as written (no client-side normalisation), with
/// `headers` and `body`, over a fresh connection.
fn raw(
    addr: SocketAddr,
    method: &str,
    target: &[u8],
    headers: &[(&str, &str)],
    body: &[u8],
) -> Raw {
    let mut req = format!("{method} ").into_bytes();
    req.extend_from_slice(target);
    req.extend_from_slice(b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    req.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    req.extend_from_slice(body);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(&req).unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Raw {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

fn stripe_post(addr: SocketAddr, target: &str, signature: &str, body: &[u8]) -> Raw {
    raw(
        addr,
        "POST",
        target.as_bytes(),
        &[
            ("content-type", "application/json"),
            ("stripe-signature", signature),
        ],
        body,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_spellings_of_a_verified_path_never_pass_and_the_genuine_copy_runs() {
    let up = Upstream::start().await;
    let cfg = stripe_and_auto();
    let gw = Gateway::start(&up.url(), &["--config", cfg.to_str().unwrap()]);
    let body = fixture(STRIPE_BODY);
    let forged = stripe_signature("whsec_forger", now(), &body);
    for (target, status) in [
        ("/notify/%73tripe", 401),
        ("/notify/./stripe", 401),
        ("//notify/stripe", 401),
        ("/notify/x/../stripe", 401),
        ("/notify/stripe/", 401),
        ("/notify/stripe;x", 400),
        ("/NOTIFY/stripe", 401),
        ("/Notify/%53tripe", 401),
    ] {
        let a = stripe_post(gw.addr, target, &forged, &body);
        assert_eq!(a.status, status, "forged POST {target}: {a:?}");
        assert!(!a.replayed(), "forged POST {target}: replayed");
    }
    assert_eq!(
        up.total(),
        0,
        "a forged copy reached the upstream: {:?}",
        up.seen()
    );

    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    let a = stripe_post(gw.addr, "/notify/stripe", &genuine, &body);
    assert_eq!(a.status, 200, "the genuine copy: {a:?}");
    assert_eq!(a.body, r#"{"received":true}"#);
    assert!(
        !a.replayed(),
        "the genuine copy was answered from a forged one"
    );
    assert_eq!(up.calls("/notify/stripe"), 1);
    assert_eq!(up.last("/notify/stripe").body, body);

    // Another spelling of the genuine copy is the same route and the same
    // key: replayed, and the upstream still ran once.
    let a = stripe_post(gw.addr, "/notify/./%73tripe", &genuine, &body);
    assert_eq!(a.status, 200, "{a:?}");
    assert!(a.replayed(), "{a:?}");
    assert_eq!(up.total(), 1, "{:?}", up.seen());
    let _ = std::fs::remove_file(cfg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_gets_the_normal_path_and_unsafe_paths_are_refused_where_guarded() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &["--route", "/api=idempotency-key"]);
    let key = [
        ("idempotency-key", "k-norm"),
        ("content-type", "application/json"),
    ];
    let a = raw(gw.addr, "POST", b"//api/./orders/%31/?x=1", &key, b"{}");
    assert_eq!(a.status, 200, "{a:?}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].uri, "/api/orders/1?x=1", "forwarded as normalised");
    assert_eq!(a.body, "upstream call 1 for /api/orders/1");

    for target in [
        &b"/api/orders;jsessionid=1"[..],
        b"/api/a%2Fb",
        b"/api/a%2fb",
        b"/api/a%00",
        b"/api/a%5Cb",
        b"/api/%FF",
        b"/api/%C3%28",
        b"/api/a%zz",
        b"/API/orders;x",
    ] {
        let shown = String::from_utf8_lossy(target).into_owned();
        let a = raw(gw.addr, "POST", target, &key, b"{}");
        assert_eq!(a.status, 400, "POST {shown}: {a:?}");
        assert!(a.body.contains("path"), "POST {shown}: {a:?}");
    }
    assert_eq!(up.total(), 1, "an unsafe path reached the upstream");

    // Unguarded requests (a safe method on a client API, unrouted paths)
    // are forwarded in their (lenient) normal form.
    let a = raw(gw.addr, "GET", b"/api/orders;jsessionid=1", &[], b"");
    assert_eq!(a.status, 200, "{a:?}");
    let a = raw(gw.addr, "POST", b"/files//a%2fb", &[], b"");
    assert_eq!(a.status, 200, "{a:?}");
    let seen = up.seen();
    assert_eq!(seen[1].uri, "/api/orders;jsessionid=1");
    assert_eq!(seen[2].uri, "/files/a%2Fb");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_refuses_a_preset_that_another_route_verifies() {
    let up = Upstream::start().await;
    let cfg = stripe_and_auto();
    let gw = Gateway::start(&up.url(), &["--config", cfg.to_str().unwrap()]);
    let body = fixture(STRIPE_BODY);
    // Even a genuine signature: the catch-all does not verify.
    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    for target in ["/elsewhere", "/notify/stripex", "/notify"] {
        let a = stripe_post(gw.addr, target, &genuine, &body);
        assert_eq!(a.status, 401, "POST {target}: {a:?}");
        assert!(!a.replayed());
    }
    assert_eq!(up.total(), 0, "{:?}", up.seen());
    let log = gw.log();
    assert!(
        log.lines().any(|l| l.contains("stripe")
            && l.contains("/notify/stripe")
            && l.contains("/elsewhere")),
        "the log names the route that verifies stripe:\n{log}"
    );
    // Other channels are still detected on the catch-all.
    let a = raw(
        gw.addr,
        "POST",
        b"/other",
        &[("idempotency-key", "k-1")],
        b"{}",
    );
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(up.total(), 1);
    // And the verified route itself takes the genuine copy.
    let a = stripe_post(gw.addr, "/notify/stripe", &genuine, &body);
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(up.calls("/notify/stripe"), 1);
    let _ = std::fs::remove_file(cfg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_routes_take_post_only_and_are_never_scoped_to_a_principal() {
    let up = Upstream::start().await;
    let cfg = config(&format!(
        "principal_header = \"x-tenant-id\"\n\
         [[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n\
         [[route]]\nprefix = \"/notify/any\"\npreset = \"stripe\"\n"
    ));
    let gw = Gateway::start(&up.url(), &["--config", cfg.to_str().unwrap()]);
    let body = fixture(STRIPE_BODY);
    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    for method in ["GET", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS"] {
        for target in ["/notify/stripe", "/notify/any/x"] {
            let a = raw(
                gw.addr,
                method,
                target.as_bytes(),
                &[("stripe-signature", &genuine)],
                &body,
            );
            assert_eq!(a.status, 405, "{method} {target}: {a:?}");
            assert_eq!(
                a.header("allow").as_deref(),
                Some("POST"),
                "{method} {target}"
            );
        }
    }
    assert_eq!(up.total(), 0, "{:?}", up.seen());
    for (i, tenant) in ["a", "b", ""].into_iter().enumerate() {
        let mut headers = vec![
            ("content-type", "application/json"),
            ("stripe-signature", genuine.as_str()),
        ];
        if !tenant.is_empty() {
            headers.push(("x-tenant-id", tenant));
        }
        let a = raw(gw.addr, "POST", b"/notify/stripe", &headers, &body);
        assert_eq!(a.status, 200, "tenant {tenant:?}: {a:?}");
        assert_eq!(a.replayed(), i > 0, "tenant {tenant:?}: {a:?}");
    }
    assert_eq!(up.total(), 1, "one notification, one upstream call");
    let _ = std::fs::remove_file(cfg);
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
