//! One view of a request through the gateway binary, over real TCP: the
//! path is normalised once at the entrance and routed, scoped, verified and
//! forwarded in that one form; what cannot be normalised safely is refused
//! on guarded routes; `auto` never accepts a preset another route verifies;
//! channel routes take POST only and are never scoped to a principal. The
//! client API's side is in `gateway_client_api.rs`.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::vectors::fixture;
use gateway_support::raw::{raw, Raw};
use gateway_support::{stripe_signature, temp_path, Gateway};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

const STRIPE_BODY: &str = "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json";
const STRIPE_SECRET: &str = "whsec_test_secret";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
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
    // The log writer is non-blocking: wait (up to 10 s) for the line.
    let names_it = |log: &str| {
        log.lines().any(|l| {
            l.contains("stripe") && l.contains("/notify/stripe") && l.contains("/elsewhere")
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !names_it(&gw.log()) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let log = gw.log();
    assert!(
        names_it(&log),
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

/// Every spelling that a framework behind the gateway would route to a
/// verified prefix is verified or refused, never forwarded unverified: an
/// escaped reserved character of the prefix (`%3A` is `:`), escapes cut by
/// a multi-byte character, a control escape ending a segment, a suffix
/// (Spring's `stripe.json`), a letter that folds to ASCII (`ſ` is `s` in
/// Java's and .NET's case-insensitive compare); and on a verified route, no
/// non-ASCII path. No catch-all: an unrouted path is forwarded as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_verified_prefix_is_verified_or_refused() {
    let up = Upstream::start().await;
    let cfg = config(&format!(
        "[[route]]\nprefix = \"/hooks/pay:stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n\
         [[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = {{ secrets = [\"{STRIPE_SECRET}\"], tolerance = \"300s\" }}\n"
    ));
    let gw = Gateway::start(&up.url(), &["--config", cfg.to_str().unwrap()]);
    let body = fixture(STRIPE_BODY);
    let forged = stripe_signature("whsec_forger", now(), &body);
    for (target, status) in [
        ("/hooks/pay:stripe", 401),
        ("/hooks/pay%3Astripe", 401),
        ("/hooks/pay%3astripe", 401),
        ("/HOOKS/pay%3Astripe/x", 401),
        ("/a%C\u{e9}%2F..%2Fnotify/stripe", 400),
        ("/a%C\u{e9}%2F..%2Fhooks/pay%3Astripe", 400),
        ("/notify/stripe%00", 400),
        ("/notify/stripe%09", 400),
        ("/notify/stripe%00.json", 400),
        ("/notify/stripe.json", 400),
        ("/notify/stripe.", 400),
        ("/notify/\u{17f}tripe", 400),
        ("/notify/STRIPE%2Ejson", 400),
        ("/notify/stripe%20", 400),
        ("/notify/stripe/\u{e9}", 400),
        ("/notify/stripe/%C3%A9", 400),
        ("/notify/%2573tripe", 400),
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
    // The genuine copy under the escaped spelling is the route's: it runs
    // once, and the plain spelling replays it.
    let genuine = stripe_signature(STRIPE_SECRET, now(), &body);
    let a = stripe_post(gw.addr, "/hooks/pay%3Astripe", &genuine, &body);
    assert_eq!(a.status, 200, "the genuine copy: {a:?}");
    let a = stripe_post(gw.addr, "/hooks/pay:stripe", &genuine, &body);
    assert_eq!(a.status, 200, "{a:?}");
    assert!(a.replayed(), "{a:?}");
    assert_eq!(up.total(), 1, "{:?}", up.seen());
    // Elsewhere (unrouted) such paths are forwarded.
    for target in ["/files/report.json", "/files/caf%C3%A9", "/files/\u{17f}"] {
        let a = raw(gw.addr, "POST", target.as_bytes(), &[], b"");
        assert_eq!(a.status, 200, "POST {target}: {a:?}");
    }
    let _ = std::fs::remove_file(cfg);
}
