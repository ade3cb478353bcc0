//! Fencing tokens through the gateway binary, over real TCP: the upstream
//! gets `idempotency-fencing-token` and `idempotency-key` beside each other,
//! a client cannot choose the token, and a retry that takes over the lease
//! of a gateway that died gets a larger token for the same key.

use crate::gateway_support;
use test_support::common;
use test_support::support_sql;

use common::client;
use common::upstream::{Seen, Upstream};
use common::vectors::{WECHATPAY_V3_VECTORS, WECHAT_SUCCESS};
use gateway_support::raw::raw;
use gateway_support::storm::{headers_with, send};
use gateway_support::Gateway;
use std::time::Duration;
use support_sql::SqliteFile;

const FENCE: &str = "idempotency-fencing-token";

fn fence(seen: &Seen) -> u64 {
    seen.headers
        .get(FENCE)
        .unwrap_or_else(|| panic!("no {FENCE} upstream: {:?}", seen.headers))
        .to_str()
        .unwrap()
        .parse()
        .expect("a decimal token")
}

fn key(seen: &Seen) -> String {
    seen.headers
        .get("idempotency-key")
        .unwrap_or_else(|| panic!("no idempotency-key upstream: {:?}", seen.headers))
        .to_str()
        .unwrap()
        .to_owned()
}

/// 64 lowercase hex digits: a SHA-256.
fn assert_hash(key: &str) {
    assert_eq!(key.len(), 64, "{key}");
    assert!(
        key.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{key}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_gets_the_key_hash_and_the_fencing_token() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &["--route", "/notify=auto", "--route", "/api=idempotency-key"],
    );
    // A channel notification: the key is the stored key's SHA-256, and a
    // token the sender made up is replaced by the claim's.
    let v = &WECHATPAY_V3_VECTORS[0];
    let headers = headers_with(v, &[(FENCE, "18446744073709551615")]);
    let r = send(&client(), &gw.url("/notify/fence"), &headers, v.base().body).await;
    assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
    let seen = up.last("/notify/fence");
    let first = fence(&seen);
    assert!(first > 0 && first < u64::MAX, "{first}");
    let hash = key(&seen);
    assert_hash(&hash);
    // Another notification is another stored key, with a token of its own:
    // a client-sent `idempotency-key` (here the first one's) replaces
    // nothing, it goes upstream as `idempotency-client-key`, and a
    // client-sent `idempotency-client-key` is dropped.
    let w = &WECHATPAY_V3_VECTORS[1];
    let headers = headers_with(
        w,
        &[
            ("idempotency-key", &hash),
            ("idempotency-client-key", "forged"),
        ],
    );
    let r = send(
        &client(),
        &gw.url("/notify/fence2"),
        &headers,
        w.base().body,
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
    let other = up.last("/notify/fence2");
    assert_hash(&key(&other));
    assert_ne!(key(&other), hash, "the stored key's hash, not the client's");
    assert_eq!(other.headers.get_all("idempotency-key").iter().count(), 1);
    let client_key: Vec<_> = other
        .headers
        .get_all("idempotency-client-key")
        .iter()
        .collect();
    assert_eq!(client_key, [hash.as_str()]);
    assert!(fence(&other) > 0);

    // A client's own Idempotency-Key goes upstream as
    // `idempotency-client-key`; `idempotency-key` is the stored key's hash.
    let json = ("content-type", "application/json");
    let a = raw(
        gw.addr,
        "POST",
        b"/api/pay",
        &[("idempotency-key", "pay-1"), json, (FENCE, "7")],
        b"{}",
    );
    assert_eq!(a.status, 200, "{a:?}");
    let seen = up.last("/api/pay");
    assert_hash(&key(&seen));
    assert_eq!(seen.headers["idempotency-client-key"], "pay-1");
    assert!(fence(&seen) > 7, "the client's token is not forwarded");

    // A request no preset guards carries no token, not even the client's.
    let a = raw(gw.addr, "GET", b"/plain", &[(FENCE, "9")], b"");
    assert_eq!(a.status, 200, "{a:?}");
    assert!(up.last("/plain").headers.get(FENCE).is_none());
}

/// Two tenants that both send `Idempotency-Key: order-1001` each run once
/// and reach the upstream with different `idempotency-key`s (the scoped
/// keys' hashes), so the upstream's unique index on it does not collide
/// across tenants; each one's own key is in `idempotency-client-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_principals_with_one_client_key_reach_the_upstream_with_different_keys() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/api=idempotency-key",
            "--principal-header",
            "x-tenant-id",
        ],
    );
    let mut seen = Vec::new();
    for tenant in ["tenant-a", "tenant-b"] {
        let h = [
            ("idempotency-key", "order-1001"),
            ("x-tenant-id", tenant),
            ("content-type", "application/json"),
        ];
        let a = raw(gw.addr, "POST", b"/api/orders", &h, b"{}");
        assert_eq!(a.status, 200, "{tenant}: {a:?}");
        seen.push(up.last("/api/orders"));
    }
    assert_eq!(up.calls("/api/orders"), 2, "each tenant ran once");
    assert_ne!(key(&seen[0]), key(&seen[1]), "one upstream key per tenant");
    for s in &seen {
        assert_hash(&key(s));
        assert_eq!(s.headers["idempotency-client-key"], "order-1001");
    }
}

/// CGI and WSGI servers read `Idempotency_Fencing_Token` as
/// `HTTP_IDEMPOTENCY_FENCING_TOKEN`, the same as the gateway's header: a
/// client's underscore spelling of a header the gateway sets never reaches
/// the upstream (a maximal token would make the fencing recipe refuse every
/// later write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscore_spellings_of_the_gateways_headers_are_dropped() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &["--route", "/notify=auto", "--route", "/api=idempotency-key"],
    );
    let spoofed = [
        ("Idempotency_Fencing_Token", "18446744073709551615"),
        ("idempotency_key", "chosen"),
        ("Idempotency_Client_Key", "chosen"),
        ("idempotent_replayed", "true"),
        ("X_Forwarded_For", "10.0.0.1"),
        ("x_forwarded_proto", "https"),
        ("x_forwarded_host", "bank.example"),
    ];
    let mut h = vec![
        ("idempotency-key", "pay-2"),
        ("content-type", "application/json"),
        ("x_tenant_note", "kept"),
    ];
    h.extend(spoofed);
    let a = raw(gw.addr, "POST", b"/api/pay", &h, b"{}");
    assert_eq!(a.status, 200, "{a:?}");
    let seen = up.last("/api/pay");
    for (name, _) in spoofed {
        let name = name.to_ascii_lowercase();
        assert!(
            seen.headers.get(name.as_str()).is_none(),
            "{name} reached the upstream: {:?}",
            seen.headers
        );
    }
    assert!(fence(&seen) < u64::MAX);
    assert_eq!(
        seen.headers["x_tenant_note"], "kept",
        "other underscores pass"
    );
    // An unguarded request too.
    let a = raw(gw.addr, "GET", b"/plain", &spoofed, b"");
    assert_eq!(a.status, 200, "{a:?}");
    let seen = up.last("/plain");
    for (name, _) in spoofed {
        assert!(
            seen.headers
                .get(name.to_ascii_lowercase().as_str())
                .is_none(),
            "{name}"
        );
    }
}

/// Two gateways over one SQLite file. The first dies (SIGKILL) while the
/// upstream still works on a notification; once its lease ran out, the
/// channel's retry reaches the second, which takes the key over: the
/// upstream sees the same key with a larger token, so its own
/// `UPDATE … WHERE fence < :token` refuses the dead owner's late write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_lease_takeover_gets_a_larger_token() {
    let file = SqliteFile::new();
    let store = file.url();
    let up = Upstream::start().await;
    let args = ["--store", store.as_str(), "--lease", "300ms"];
    let first = Gateway::start(&up.url(), &args);
    let second = Gateway::start(&up.url(), &args);
    let v = &WECHATPAY_V3_VECTORS[0];
    let path = "/notify/takeover";
    let slow = headers_with(v, &[("x-delay-ms", "10000")]);
    let url = first.url(path);
    let lost = tokio::spawn(async move { send(&client(), &url, &slow, v.base().body).await });
    up.wait_for_call(path).await;
    let stale = up.last(path);
    first.signal(libc::SIGKILL);
    let _ = lost.await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let r = send(
        &client(),
        &second.url(path),
        &v.base().headers,
        v.base().body,
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
    assert_eq!(up.calls(path), 2, "the retry ran after the takeover");
    let newer = up.last(path);
    assert_eq!(key(&newer), key(&stale), "one stored key");
    assert!(
        fence(&newer) > fence(&stale),
        "takeover token {} after {}",
        fence(&newer),
        fence(&stale)
    );
}

/// On an acknowledge-then-deliver route the delivery from the queue is a
/// guarded call too: the upstream gets the key's hash and a fencing token,
/// so its own unique index catches a delivery the queue repeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_from_the_queue_carry_the_key_hash_and_the_token() {
    let up = Upstream::start().await;
    let dir = gateway_support::temp_path("fence-ack");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.to_str().unwrap().to_owned();
    let gw = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
            "--data-dir",
            &data,
        ],
    );
    let v = &WECHATPAY_V3_VECTORS[0];
    let r = send(
        &client(),
        &gw.url("/wx/notify"),
        &v.base().headers,
        v.base().body,
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
    up.wait_for_call("/wx/notify").await;
    let seen = up.last("/wx/notify");
    assert!(fence(&seen) > 0);
    let hash = key(&seen);
    assert_eq!(hash.len(), 64, "{hash}");
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}
