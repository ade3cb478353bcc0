//! A route that delivers each notification to several named upstreams
//! (`deliver = [...]`): acknowledged once it is queued for every destination
//! it matches, each destination delivered on its own and exactly once (one
//! that is down never holds another), filtered by what the notification
//! says; `--check-config` refuses `deliver` where it cannot hold.

use crate::gateway_support;
use test_support::common;

use common::upstream::{Replies, Upstream};
use common::{client, post};
use gateway_support::{exits_2, gateway_bin, stripe_signature, temp_path, Proc};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SECRET: &str = "whsec_destinations";

/// A Stripe event of `id` and `kind`.
fn event(id: &str, kind: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","object":"event","type":"{kind}"}}"#).into_bytes()
}

/// Posts a signed Stripe event; answers the status and body.
async fn send(addr: std::net::SocketAddr, body: Vec<u8>) -> (u16, String) {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let sig = stripe_signature(SECRET, t, &body);
    let headers = [
        ("content-type", "application/json"),
        ("stripe-signature", sig.as_str()),
    ];
    let a = post(&client(), addr, "/stripe/hook", &headers, body).await;
    (a.status, a.text())
}

/// The config: the upstreams `orders` and `ledger`, and a Stripe
/// ack-then-deliver route with `deliver` as given.
fn config(dir: &Path, orders: &Upstream, ledger: &Upstream, deliver: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let text = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\ndata_dir = \"{}\"\nretry_backoff = \"200ms\"\n\
         [[upstreams]]\nname = \"orders\"\nurl = \"{}\"\n\
         [[upstreams]]\nname = \"ledger\"\nurl = \"{}\"\n\
         [[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmode = \"ack-then-deliver\"\n\
         verify = {{ secrets = [\"{SECRET}\"] }}\n{deliver}\n",
        orders.url(),
        dir.join("data").display(),
        orders.url(),
        ledger.url(),
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn answered(up: &Upstream, status: u16) -> usize {
    up.seen().iter().filter(|s| s.status == status).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_is_down_never_holds_another_and_each_gets_it_once() {
    let _beside = crate::gateway_support::beside_storms().await;
    let orders = Upstream::start().await;
    let down = Arc::new(AtomicBool::new(true));
    let d = down.clone();
    let ledger =
        Upstream::with(
            Replies::default().status(move |_| if d.load(Ordering::SeqCst) { 503 } else { 200 }),
        )
        .await;
    let dir = temp_path("ack-destinations");
    let file = config(
        &dir,
        &orders,
        &ledger,
        "deliver = [\n  { upstream = \"orders\", only = { \"json:/type\" = [\"payment_intent.succeeded\", \"charge.refunded\"] } },\n  { upstream = \"ledger\", retry_schedule = [\"300ms\"] },\n]",
    );
    let gw = Proc::start(&["--config", &file], &[], Stdio::null());
    for _ in 0..3 {
        let (status, text) = send(gw.addr, event("evt_both", "payment_intent.succeeded")).await;
        assert_eq!(status, 200, "{text}");
    }
    // The orders get it promptly while the ledger fails.
    wait_until("the orders' delivery", Duration::from_secs(10), || {
        answered(&orders, 200) == 1
    })
    .await;
    wait_until(
        "the ledger's failed attempts",
        Duration::from_secs(10),
        || answered(&ledger, 503) >= 2,
    )
    .await;
    assert_eq!(answered(&ledger, 200), 0);
    // The ledger back: it gets the notification once, the orders never again.
    down.store(false, Ordering::SeqCst);
    wait_until("the ledger's delivery", Duration::from_secs(10), || {
        answered(&ledger, 200) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(orders.total(), 1, "the orders were called again");
    assert_eq!(answered(&ledger, 200), 1);
    // One idempotency key for both; a fencing token for each.
    let (o, l) = (orders.last("/stripe/hook"), ledger.last("/stripe/hook"));
    assert_eq!(o.headers["idempotency-key"], l.headers["idempotency-key"]);
    assert!(o.headers.contains_key("idempotency-fencing-token"));
    assert!(l.headers.contains_key("idempotency-fencing-token"));
    assert_eq!(o.body, l.body);

    // Filtered: an event only the ledger wants goes to the ledger alone.
    let (status, text) = send(gw.addr, event("evt_ledger", "customer.created")).await;
    assert_eq!(status, 200, "{text}");
    wait_until(
        "the ledger's second delivery",
        Duration::from_secs(10),
        || answered(&ledger, 200) == 2,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(orders.total(), 1, "filtered out for the orders");
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_no_destination_wants_is_acknowledged_and_delivered_nowhere() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (orders, ledger) = (Upstream::start().await, Upstream::start().await);
    let dir = temp_path("ack-filtered");
    let file = config(
        &dir,
        &orders,
        &ledger,
        "deliver = [\n  { upstream = \"orders\", only = { \"json:/type\" = [\"charge.refunded\"] } },\n  { upstream = \"ledger\", only = { \"json:/type\" = [\"charge.refunded\"], \"header:x-mode\" = [\"live\"] } },\n]",
    );
    let token = super::gateway_dead_api::token_file("dest-filtered-token");
    let metrics = common::free_addr();
    let gw = start_admin(&file, metrics, &token, &["--journal"]);
    let (status, text) = send(gw.addr, event("evt_none", "customer.created")).await;
    assert_eq!(status, 200, "acknowledged: {text}");
    // Both filters on the ledger must hold: the header is missing.
    let (status, _) = send(gw.addr, event("evt_orders", "charge.refunded")).await;
    assert_eq!(status, 200);
    wait_until("the orders' delivery", Duration::from_secs(10), || {
        answered(&orders, 200) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(orders.total(), 1);
    assert_eq!(ledger.total(), 0, "no notification the ledger wants");
    // Journaled as `filtered`.
    let start = Instant::now();
    loop {
        let (code, out, err) = super::gateway_ack::admin_cli(
            metrics,
            &token,
            &["journal", "--outcome", "filtered", "--format", "json"],
        );
        assert_eq!(code, 0, "{err}");
        let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let keys: Vec<&str> = (json["records"].as_array().unwrap().iter())
            .filter_map(|r| r["key"].as_str())
            .collect();
        if keys.iter().any(|k| k.ends_with(":evt_none")) {
            assert!(!keys.iter().any(|k| k.ends_with(":evt_orders")), "{keys:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not journaled: {out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn check_config_refuses_deliver_where_it_cannot_hold() {
    let dir = temp_path("deliver-check");
    std::fs::create_dir_all(&dir).unwrap();
    let upstreams = "[[upstreams]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9\"\n";
    for (route, hint) in [
        (
            "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\ndeliver = [{ upstream = \"orders\" }]\n",
            "gateway.toml:9: `deliver`: route `/stripe` answers synchronously",
        ),
        (
            "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmode = \"ack-then-deliver\"\ndeliver = [{ upstream = \"nope\" }]\n",
            "unknown upstream `nope`",
        ),
        (
            "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmode = \"ack-then-deliver\"\ndeliver = [{ upstream = \"orders\", only = { \"body:/type\" = [\"x\"] } }]\n",
            "`only`: unknown source `body:/type`",
        ),
        (
            "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmode = \"ack-then-deliver\"\ndeliver = [{ upstream = \"orders\" }, { upstream = \"orders\" }]\n",
            "upstream `orders` is listed twice",
        ),
    ] {
        let file = dir.join("gateway.toml");
        std::fs::write(&file, format!("data_dir = \"{}\"\n{upstreams}\n{route}", dir.join("data").display())).unwrap();
        let mut cmd = Command::new(gateway_bin());
        cmd.args(["--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:9", "--check-config", "--config"])
            .arg(&file);
        exits_2(cmd, hint);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The gateway on `file`, its admin API on `metrics` with the test token,
/// `extra` flags after.
fn start_admin(file: &str, metrics: std::net::SocketAddr, token: &Path, extra: &[&str]) -> Proc {
    let metrics = metrics.to_string();
    let mut args = vec![
        "--config",
        file,
        "--metrics-listen",
        &metrics,
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Proc::start(&args, &[], Stdio::null())
}

/// A dead letter names its destination; `dlq list --destination` and
/// `/admin/dead?destination=` select by it; its replay calls that
/// destination alone.
async fn dead_letters_by_destination(queue: &[&str], tag: &str) {
    use super::gateway_ack::{admin_cli, gauge};
    use super::gateway_dead_api::{admin_call, token_file};
    let orders = Upstream::start().await;
    let down = Arc::new(AtomicBool::new(true));
    let d = down.clone();
    let ledger =
        Upstream::with(
            Replies::default().status(move |_| if d.load(Ordering::SeqCst) { 503 } else { 200 }),
        )
        .await;
    let dir = temp_path(&format!("dest-dead-{tag}"));
    let file = config(
        &dir,
        &orders,
        &ledger,
        "deliver = [{ upstream = \"orders\" }, { upstream = \"ledger\", retry_schedule = [\"100ms\"] }]",
    );
    let token = token_file(&format!("dest-dead-token-{tag}"));
    let metrics = common::free_addr();
    let mut extra = vec!["--max-attempts", "2"];
    extra.extend_from_slice(queue);
    let gw = start_admin(&file, metrics, &token, &extra);
    let id = format!("evt_dead_{tag}_{}", std::process::id());
    let (status, text) = send(gw.addr, event(&id, "payment_intent.succeeded")).await;
    assert_eq!(status, 200, "{text}");
    wait_until("the ledger's dead letter", Duration::from_secs(30), || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    assert_eq!(answered(&orders, 200), 1, "the orders delivered");

    let (code, listed, err) =
        admin_cli(metrics, &token, &["dlq", "list", "--destination", "ledger"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 1, "{listed}");
    assert!(lines[0].contains("\tdestination=ledger\t"), "{listed}");
    let letter = lines[0].split('\t').next().unwrap().to_owned();
    let (code, none, err) = admin_cli(metrics, &token, &["dlq", "list", "--destination", "orders"]);
    assert_eq!((code, none.as_str()), (0, ""), "{err}");
    let (status, page) = admin_call(metrics, "GET", "/admin/dead?destination=ledger").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["dead_letters"][0]["destination"], "ledger", "{page}");

    // Replayed with the ledger back: the ledger alone is called.
    down.store(false, Ordering::SeqCst);
    let (code, _, err) = admin_cli(metrics, &token, &["dlq", "replay", &letter]);
    assert_eq!(code, 0, "{err}");
    wait_until("the replayed delivery", Duration::from_secs(20), || {
        answered(&ledger, 200) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        orders.total(),
        1,
        "a replay of the ledger's letter called the orders"
    );
    assert_eq!(answered(&ledger, 200), 1);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_their_destination_and_a_replay_calls_it_alone_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    dead_letters_by_destination(&[], "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_their_destination_and_a_replay_calls_it_alone_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = super::gateway_ack::own_redis() else {
        return;
    };
    let url = redis.url();
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    dead_letters_by_destination(&queue, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_their_destination_and_a_replay_calls_it_alone_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = super::gateway_ack::rabbitmq_queue("dest-dead") else {
        return;
    };
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    dead_letters_by_destination(&queue, "amqp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_their_destination_and_a_replay_calls_it_alone_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = test_support::support_nats::own() else {
        return;
    };
    let url = nats.url();
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    dead_letters_by_destination(&queue, "jetstream").await;
}

/// `pause PREFIX --upstream NAME` holds that destination's deliveries
/// alone; `resume` delivers them, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_one_destination_holds_it_alone() {
    use super::gateway_ack::admin_cli;
    use super::gateway_dead_api::token_file;
    let _beside = crate::gateway_support::beside_storms().await;
    let (orders, ledger) = (Upstream::start().await, Upstream::start().await);
    let dir = temp_path("dest-pause");
    let file = config(
        &dir,
        &orders,
        &ledger,
        "deliver = [{ upstream = \"orders\" }, { upstream = \"ledger\" }]",
    );
    let token = token_file("dest-pause-token");
    let metrics = common::free_addr();
    let gw = start_admin(&file, metrics, &token, &[]);
    let (code, out, err) = admin_cli(
        metrics,
        &token,
        &["pause", "/stripe", "--upstream", "ledger"],
    );
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = admin_cli(metrics, &token, &["pause", "/stripe", "--upstream", "nope"]);
    assert_eq!(code, 1, "an upstream the route does not deliver to: {err}");
    let (status, text) = send(gw.addr, event("evt_paused", "payment_intent.succeeded")).await;
    assert_eq!(status, 200, "{text}");
    wait_until("the orders' delivery", Duration::from_secs(10), || {
        answered(&orders, 200) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ledger.total(), 0, "a paused destination was called");
    // Deliveries are counted, and lanes gauged, by destination.
    let (_, metrics_text) = gateway_support::get(metrics, "/metrics");
    let line = |name: &str, destination: &str| {
        metrics_text.lines().any(|l| {
            l.starts_with(&format!("{name}{{"))
                && l.contains(&format!("destination=\"{destination}\""))
        })
    };
    assert!(
        line("idempotency_queue_attempts_total", "orders"),
        "{metrics_text}"
    );
    assert!(
        line("idempotency_deliveries_in_flight", "ledger"),
        "{metrics_text}"
    );
    assert!(
        line("idempotency_upstream_breaker", "orders"),
        "{metrics_text}"
    );
    let (code, out, err) = admin_cli(
        metrics,
        &token,
        &["resume", "/stripe", "--upstream", "ledger"],
    );
    assert_eq!(code, 0, "{out}{err}");
    wait_until(
        "the ledger's delivery after resume",
        Duration::from_secs(40),
        || answered(&ledger, 200) == 1,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!((orders.total(), ledger.total()), (1, 1));
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// `inspect KEY` shows each destination's delivery; `forget KEY` makes the
/// next copy deliver again, to every destination, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_delivers_the_next_copy_again_to_every_destination() {
    use super::gateway_ack::admin_cli;
    use super::gateway_dead_api::token_file;
    let _beside = crate::gateway_support::beside_storms().await;
    let (orders, ledger) = (Upstream::start().await, Upstream::start().await);
    let dir = temp_path("dest-forget");
    let file = config(
        &dir,
        &orders,
        &ledger,
        "deliver = [{ upstream = \"orders\" }, { upstream = \"ledger\" }]",
    );
    let token = token_file("dest-forget-token");
    let metrics = common::free_addr();
    let gw = start_admin(&file, metrics, &token, &[]);
    let id = "evt_forget";
    let (status, _) = send(gw.addr, event(id, "payment_intent.succeeded")).await;
    assert_eq!(status, 200);
    wait_until("both deliveries", Duration::from_secs(10), || {
        answered(&orders, 200) == 1 && answered(&ledger, 200) == 1
    })
    .await;
    let key = format!("idem:stripe:/stripe::{id}");
    let (code, out, err) = admin_cli(metrics, &token, &["inspect", &key, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let inspected: serde_json::Value = serde_json::from_str(&out).unwrap();
    let each = inspected["destinations"]
        .as_array()
        .expect("each destination");
    let names: Vec<&str> = each
        .iter()
        .map(|d| d["destination"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["orders", "ledger"], "{out}");
    for d in each {
        assert_eq!(d["record"]["state"], "completed", "{out}");
    }
    // A copy now is a duplicate for both.
    let (status, _) = send(gw.addr, event(id, "payment_intent.succeeded")).await;
    assert_eq!(status, 200);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!((orders.total(), ledger.total()), (1, 1));
    let (code, out, err) = admin_cli(metrics, &token, &["forget", &key]);
    assert_eq!(code, 0, "{out}{err}");
    let (status, _) = send(gw.addr, event(id, "payment_intent.succeeded")).await;
    assert_eq!(status, 200);
    wait_until("both deliveries again", Duration::from_secs(10), || {
        answered(&orders, 200) == 2 && answered(&ledger, 200) == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!((orders.total(), ledger.total()), (2, 2));
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// The calls each event id got from an upstream, answered 200.
fn delivered_ids(up: &Upstream) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for seen in up.seen().iter().filter(|s| s.status == 200) {
        let body: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
        *out.entry(body["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    out
}

/// Killed (-9) while the ledger's delivery hangs, the orders' done: after
/// a restart the ledger gets the notification, the orders never again.
async fn killed_mid_delivery(queue: &[&str], tag: &str) {
    let orders = Upstream::start().await;
    let hung = Upstream::with(Replies::default().delay(Duration::from_secs(60))).await;
    let dir = temp_path(&format!("dest-kill-{tag}"));
    let deliver = "deliver = [{ upstream = \"orders\" }, { upstream = \"ledger\" }]";
    let file = config(&dir, &orders, &hung, deliver);
    let mut args = vec!["--config", file.as_str()];
    args.extend_from_slice(queue);
    let mut gw = Proc::start(&args, &[], Stdio::null());
    let id = format!("evt_kill_{tag}_{}", std::process::id());
    let (status, text) = send(gw.addr, event(&id, "payment_intent.succeeded")).await;
    assert_eq!(status, 200, "{text}");
    wait_until("the orders' delivery", Duration::from_secs(10), || {
        answered(&orders, 200) == 1
    })
    .await;
    // The ledger's call hangs meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gw.child.kill().unwrap();
    let _ = gw.child.wait();
    drop(gw);
    // The ledger answers at once now.
    let ledger = Upstream::start().await;
    let file = config(&dir, &orders, &ledger, deliver);
    let mut args = vec!["--config", file.as_str()];
    args.extend_from_slice(queue);
    let gw = Proc::start(&args, &[], Stdio::null());
    wait_until(
        "the ledger's delivery after the restart",
        Duration::from_secs(60),
        || answered(&ledger, 200) == 1,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(orders.total(), 1, "the orders' delivery ran again");
    assert_eq!(ledger.total(), 1);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_delivery_the_done_destination_is_never_called_again_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    killed_mid_delivery(&[], "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_delivery_the_done_destination_is_never_called_again_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = super::gateway_ack::own_redis() else {
        return;
    };
    let url = redis.url();
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    killed_mid_delivery(&queue, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_delivery_the_done_destination_is_never_called_again_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = super::gateway_ack::rabbitmq_queue("dest-kill") else {
        return;
    };
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    killed_mid_delivery(&queue, "amqp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_delivery_the_done_destination_is_never_called_again_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = test_support::support_nats::own() else {
        return;
    };
    let url = nats.url();
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    killed_mid_delivery(&queue, "jetstream").await;
}

/// Two gateways on one Redis Streams queue, the ledger down at first:
/// every notification reaches each destination exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_redis_deliver_each_destination_once() {
    const N: usize = 20;
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = super::gateway_ack::own_redis() else {
        return;
    };
    let orders = Upstream::start().await;
    let down = Arc::new(AtomicBool::new(true));
    let d = down.clone();
    let ledger =
        Upstream::with(
            Replies::default().status(move |_| if d.load(Ordering::SeqCst) { 503 } else { 200 }),
        )
        .await;
    let (one, two) = (temp_path("dest-two-a"), temp_path("dest-two-b"));
    let deliver = "deliver = [{ upstream = \"orders\" }, { upstream = \"ledger\", retry_schedule = [\"200ms\"] }]";
    let (file_a, file_b) = (
        config(&one, &orders, &ledger, deliver),
        config(&two, &orders, &ledger, deliver),
    );
    let url = redis.url();
    let queue = [
        "--queue",
        url.as_str(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
        "--max-attempts",
        "100",
    ];
    let start = |file: &str| {
        let mut args = vec!["--config", file];
        args.extend_from_slice(&queue);
        Proc::start(&args, &[], Stdio::null())
    };
    let (a, b) = (start(&file_a), start(&file_b));
    for n in 0..N {
        let id = format!("evt_two_{n}");
        for gw in [&a, &b] {
            let (status, text) = send(gw.addr, event(&id, "payment_intent.succeeded")).await;
            assert_eq!(status, 200, "{text}");
        }
    }
    wait_until("the orders' deliveries", Duration::from_secs(30), || {
        delivered_ids(&orders).len() == N
    })
    .await;
    down.store(false, Ordering::SeqCst);
    wait_until("the ledger's deliveries", Duration::from_secs(60), || {
        delivered_ids(&ledger).len() == N
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (name, up) in [("orders", &orders), ("ledger", &ledger)] {
        let ids = delivered_ids(up);
        assert!(ids.values().all(|n| *n == 1), "{name}: {ids:?}");
        assert_eq!(ids.len(), N, "{name}");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(one);
    let _ = std::fs::remove_dir_all(two);
}
