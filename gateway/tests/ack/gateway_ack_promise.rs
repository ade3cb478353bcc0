//! An acknowledgement is a promise: every notification the gateway
//! acknowledged on an ack-then-deliver route is delivered, whatever happens
//! between the acknowledgement and the delivery. Each test runs the built
//! binary against a real upstream on loopback:
//!
//! - a Stripe notification that waited past its signature's tolerance, or
//!   whose secret was rotated out, or that was replayed from the dead
//!   letters, is still delivered (verified once, at ingest);
//! - on an unverified Alipay route, a forged first copy with another amount
//!   does not keep the genuine one out;
//! - an entry whose route is synchronous now (or matched by no route) is
//!   still delivered (or kept and reported);
//! - an entry the gateway cannot decode is set aside, and the others are
//!   delivered, on the embedded queue and on Redis Streams.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;

use common::upstream::{Replies, Upstream};
use common::vectors::{fixture, ALIPAY_SUCCESS, WECHAT_SUCCESS};
use common::{client, free_addr, post};
use gateway_support::{gateway_bin, get, stripe_signature, temp_path, Gateway};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const STRIPE_BODY: &str = "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json";
const ALIPAY_BODY: &str = "alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form";
const SECRET: &str = "whsec_test_secret";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A config file with one Stripe ack-then-deliver route verified with
/// `secret` (tolerance 3 s); returns its path.
fn stripe_config(dir: &Path, secret: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("gateway.toml");
    let text = format!(
        "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmode = \"ack-then-deliver\"\n\
         verify = {{ secrets = [\"{secret}\"], tolerance = \"3s\" }}\n"
    );
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// An upstream answering 503 for its first `fail` calls (or while `down`),
/// then 200.
fn failing_first(fail: usize, down: Arc<AtomicBool>) -> Replies {
    let calls = AtomicUsize::new(0);
    Replies::default().status(move |_| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        if n < fail || down.load(Ordering::SeqCst) {
            503
        } else {
            200
        }
    })
}

/// How many calls the upstream answered 200.
fn delivered(up: &Upstream) -> usize {
    up.seen().iter().filter(|s| s.status == 200).count()
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `name{queue="gateway"} VALUE` of `/metrics`.
fn gauge(metrics: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("queue=\"gateway\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `gateway dlq --offline ARGS --data-dir DIR`: exit status and stdout.
fn dlq(queue: &[&str], args: &[&str]) -> (i32, String) {
    let out = Command::new(gateway_bin())
        .args(["dlq", "--offline"])
        .args(args)
        .args(queue)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

async fn send_stripe(gw: &Gateway, secret: &str) {
    let body = fixture(STRIPE_BODY);
    let sig = stripe_signature(secret, now(), &body);
    let headers = [
        ("content-type", "application/json"),
        ("stripe-signature", &sig),
    ];
    let a = post(&client(), gw.addr, "/stripe/hook", &headers, body).await;
    assert_eq!(a.status, 200, "acknowledged: {}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_then_retried_past_the_signature_tolerance_is_delivered() {
    let _beside = crate::gateway_support::beside_storms().await;
    let up = Upstream::with(failing_first(3, Arc::default())).await;
    let dir = temp_path("ack-tolerance");
    let config = stripe_config(&dir, SECRET);
    let data = dir.join("data");
    let gw = Gateway::start(
        &up.url(),
        &[
            "--config",
            &config,
            "--data-dir",
            data.to_str().unwrap(),
            "--retry-backoff",
            "1s",
        ],
    );
    send_stripe(&gw, SECRET).await;
    // Attempts at about 0, 1, 3 s fail; the fourth, at about 7 s, is past the
    // 3 s tolerance.
    wait_until("the delivery", Duration::from_secs(25), || {
        delivered(&up) == 1
    })
    .await;
    assert_eq!(up.total(), 4, "{:?}", up.seen());
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_then_secret_rotated_out_or_dead_lettered_is_still_delivered() {
    let _beside = crate::gateway_support::beside_storms().await;
    let down = Arc::new(AtomicBool::new(true));
    let up = Upstream::with(failing_first(0, down.clone())).await;
    let dir = temp_path("ack-rotated");
    let data = dir.join("data");
    let queue = ["--data-dir", data.to_str().unwrap()];
    let metrics = free_addr().to_string();
    // Two attempts, then a dead letter.
    let config = stripe_config(&dir, SECRET);
    let mut args = vec!["--config", &config, "--retry-backoff", "200ms"];
    args.extend_from_slice(&queue);
    let dead = [
        &args[..],
        &["--max-attempts", "1", "--metrics-listen", &metrics],
    ]
    .concat();
    let mut gw = Gateway::start(&up.url(), &dead);
    send_stripe(&gw, SECRET).await;
    let m: SocketAddr = metrics.parse().unwrap();
    wait_until("a dead letter", Duration::from_secs(20), || {
        gauge(m, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    // Past the tolerance, the secret rotated out: replayed, then delivered.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (code, out) = dlq(&queue, &["replay", "--all"]);
    assert_eq!((code, out.trim()), (0, "replayed 1"));
    let rotated = stripe_config(&dir, "whsec_the_next_secret");
    down.store(false, Ordering::SeqCst);
    let mut args = vec!["--config", &rotated, "--retry-backoff", "200ms"];
    args.extend_from_slice(&queue);
    let gw = Gateway::start(&up.url(), &args);
    wait_until("the delivery", Duration::from_secs(20), || {
        delivered(&up) == 1
    })
    .await;
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// The Alipay fixture with `total_amount` set to `amount`.
fn alipay(amount: &str) -> String {
    let form = String::from_utf8(fixture(ALIPAY_BODY).to_vec()).unwrap();
    form.replace("total_amount=0.10", &format!("total_amount={amount}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_first_copy_does_not_keep_the_genuine_one_out() {
    let _beside = crate::gateway_support::beside_storms().await;
    // The upstream verifies: the forged amount gets 401.
    let up = Upstream::with(Replies::default().status(|seen| {
        if String::from_utf8_lossy(&seen.body).contains("total_amount=999.00") {
            401
        } else {
            200
        }
    }))
    .await;
    let dir = temp_path("ack-forged");
    let metrics = free_addr().to_string();
    let queue = ["--data-dir", dir.to_str().unwrap()];
    let mut args = vec![
        "--route",
        "/ali=alipay",
        "--ack-then-deliver",
        "/ali",
        "--retry-backoff",
        "200ms",
        "--metrics-listen",
        &metrics,
    ];
    args.extend_from_slice(&queue);
    let mut gw = Gateway::start(&up.url(), &args);
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let a = post(&client(), gw.addr, "/ali/notify", &form, alipay("999.00")).await;
    assert_eq!(a.text(), ALIPAY_SUCCESS, "the forged copy is queued");
    let mut acked = false;
    for _ in 0..5 {
        let a = post(&client(), gw.addr, "/ali/notify", &form, alipay("0.10")).await;
        if a.text() == ALIPAY_SUCCESS {
            acked = true;
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(acked, "the genuine copy was never acknowledged");
    wait_until("the genuine delivery", Duration::from_secs(20), || {
        delivered(&up) == 1
    })
    .await;
    // The forged entry's next attempt finds the key done with another
    // payload: a dead letter at once, with that reason.
    let m: SocketAddr = metrics.parse().unwrap();
    wait_until(
        "the forged copy's dead letter",
        Duration::from_secs(20),
        || gauge(m, "idempotency_queue_dead_letters") == Some(1.0),
    )
    .await;
    assert!(
        gw.log().contains("without `verify`"),
        "a warning at start: {}",
        gw.log()
    );
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    let (code, listed) = dlq(&queue, &["list"]);
    assert_eq!(code, 0);
    assert!(listed.contains("different"), "{listed}");
    assert!(
        listed.contains("attempts=1") || listed.contains("attempts=2"),
        "{listed}"
    );
    assert_eq!(delivered(&up), 1, "{:?}", up.seen());
    let _ = std::fs::remove_dir_all(dir);
}

fn wechat(id: &str) -> String {
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String(id.to_owned());
    v.to_string()
}

async fn send_wechat(gw: &Gateway, id: &str) {
    let headers = [("content-type", "application/json")];
    let a = post(&client(), gw.addr, "/wx/notify", &headers, wechat(id)).await;
    assert_eq!(a.text(), WECHAT_SUCCESS, "acknowledged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_of_a_route_now_synchronous_is_delivered_and_an_unrouted_one_kept() {
    let _beside = crate::gateway_support::beside_storms().await;
    let down = Arc::new(AtomicBool::new(true));
    let up = Upstream::with(failing_first(0, down.clone())).await;
    let dir = temp_path("ack-stranded");
    let queue = ["--data-dir", dir.to_str().unwrap()];
    let acked = [
        &queue[..],
        &["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"],
    ]
    .concat();
    let mut gw = Gateway::start(&up.url(), &acked);
    send_wechat(&gw, "EV-STRANDED-1").await;
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    down.store(false, Ordering::SeqCst);
    // No route matches the entry's path: kept and reported, not delivered.
    let metrics = free_addr().to_string();
    let other = [
        &queue[..],
        &["--route", "/other=stripe", "--metrics-listen", &metrics],
    ]
    .concat();
    let mut gw = Gateway::start(&up.url(), &other);
    let m: SocketAddr = metrics.parse().unwrap();
    wait_until("the stranded gauge", Duration::from_secs(20), || {
        gauge(m, "idempotency_queue_stranded") == Some(1.0)
    })
    .await;
    assert!(gw.log().contains("stranded"), "{}", gw.log());
    assert_eq!(up.total(), 0);
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    let (code, listed) = dlq(&queue, &["list"]);
    assert_eq!((code, listed.as_str()), (0, ""), "never dead-lettered");
    // The route is synchronous now: delivered through its dedup layer.
    let sync = [&queue[..], &["--route", "/wx=wechatpay-v3"]].concat();
    let gw = Gateway::start(&up.url(), &sync);
    wait_until("the delivery", Duration::from_secs(20), || {
        delivered(&up) == 1
    })
    .await;
    // A copy sent synchronously now is replayed, not run again.
    send_wechat(&gw, "EV-STRANDED-1").await;
    assert_eq!(delivered(&up), 1);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// Queues one notification with the upstream down, lets `inject` add an
/// entry the gateway cannot decode, queues three more, and waits for the
/// four deliveries and one dead letter.
async fn undecodable_entry_set_aside(queue: &[&str], inject: impl FnOnce()) {
    let down = Arc::new(AtomicBool::new(true));
    let up = Upstream::with(failing_first(0, down.clone())).await;
    let acked = [
        queue,
        &["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"],
    ]
    .concat();
    let mut gw = Gateway::start(&up.url(), &acked);
    send_wechat(&gw, "EV-BEFORE").await;
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    inject();
    let metrics = free_addr().to_string();
    let args = [
        &acked[..],
        &["--retry-backoff", "200ms", "--metrics-listen", &metrics],
    ]
    .concat();
    let mut gw = Gateway::start(&up.url(), &args);
    for id in ["EV-AFTER-1", "EV-AFTER-2", "EV-AFTER-3"] {
        send_wechat(&gw, id).await;
    }
    down.store(false, Ordering::SeqCst);
    wait_until("four deliveries", Duration::from_secs(15), || {
        delivered(&up) == 4
    })
    .await;
    let m: SocketAddr = metrics.parse().unwrap();
    wait_until("one dead letter", Duration::from_secs(15), || {
        gauge(m, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    let (code, listed) = dlq(queue, &["list"]);
    assert_eq!(code, 0, "the dead letters list");
    assert!(listed.contains("undecodable"), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_entry_is_dead_lettered_and_the_rest_delivered_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let (url, port) = (redis.url(), redis.port());
    undecodable_entry_set_aside(
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        || {
            let got =
                support_redis::raw_command(port, "XADD {gateway}:s * m not-a-message a 0 t 0");
            assert!(got.unwrap().starts_with('$'), "the stray entry was added");
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_entry_is_dead_lettered_and_the_rest_delivered_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    const STATE: redb::TableDefinition<'_, u64, &[u8]> = redb::TableDefinition::new("state");
    const MESSAGES: redb::TableDefinition<'_, u64, &[u8]> = redb::TableDefinition::new("messages");
    let dir = temp_path("ack-undecodable");
    let file = dir.join("queue.redb");
    undecodable_entry_set_aside(&["--data-dir", dir.to_str().unwrap()], || {
        // As another version could write it: an entry whose message this
        // version cannot read, due now.
        let db = redb::Database::create(&file).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let id = 1 << 40;
            let mut state = [0u8; 36];
            state[20..28].copy_from_slice(&1u64.to_le_bytes());
            txn.open_table(STATE)
                .unwrap()
                .insert(id, &state[..])
                .unwrap();
            let mut messages = txn.open_table(MESSAGES).unwrap();
            messages.insert(id, &b"\x07not-a-message"[..]).unwrap();
        }
        txn.commit().unwrap();
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_replicas_hold_the_acknowledgement_and_memory_store_is_warned_about() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let up = Upstream::start().await;
    let route = ["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"];
    // No replica: the notification is not acknowledged (the channel retries).
    let args = [
        &route[..],
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
            "--queue-replicas",
            "1",
        ],
    ]
    .concat();
    let gw = Gateway::start(&up.url(), &args);
    let headers = [("content-type", "application/json")];
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &headers,
        wechat("EV-REPLICAS"),
    )
    .await;
    assert_eq!(a.text(), common::vectors::WECHAT_FAIL, "not acknowledged");
    // Several instances on this queue would each keep their own records.
    assert!(gw.log().contains("--store memory"), "{}", gw.log());
    drop(gw);
    let status = Command::new(gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .args(route)
        .args(["--queue-replicas", "1", "--data-dir", "/tmp/unused-ack-dir"])
        .output()
        .unwrap()
        .status;
    assert_eq!(
        status.code(),
        Some(2),
        "replicas need a Redis Streams queue"
    );
}

/// The test binary's own check that the gateway it runs is current.
#[test]
fn gateway_binary_is_built() {
    assert!(gateway_bin().exists());
}
