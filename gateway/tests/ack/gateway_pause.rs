//! Pausing a route of the running gateway (`gateway pause`, `gateway
//! resume`, `/admin/routes`): nothing reaches a paused route's upstream; a
//! channel route answers new copies with the channel's failure reply and
//! still replays completed keys; an acknowledge-then-deliver route keeps
//! acknowledging and queueing, and delivers each notification once after
//! `resume`; a pause on one instance holds on a second instance on the
//! same Redis, and a restart keeps it.

use super::gateway_ack::{admin_cli, gauge, notification, own_redis, wait_for, Upstream};
use super::gateway_dead_api::{token_file, TOKEN};
use crate::gateway_support::{get, temp_path, Proc};
use test_support::common::vectors::{WECHAT_FAIL, WECHAT_SUCCESS};
use test_support::common::{client, free_addr, post};

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A gateway with the WeChat Pay route `/wx` (synchronous unless `extra`
/// says otherwise), its admin API on `metrics`.
fn start(upstream: SocketAddr, metrics: SocketAddr, token: &Path, extra: &[&str]) -> Proc {
    let (upstream, metrics) = (format!("http://{upstream}"), metrics.to_string());
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--route",
        "/wx=wechatpay-v3",
        "--metrics-listen",
        &metrics,
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Proc::start(&args, &[], Stdio::inherit())
}

/// Posts notification `id` to `gw`: its status and body.
async fn send(gw: SocketAddr, id: &str) -> (u16, String) {
    let headers = [("content-type", "application/json")];
    let answer = post(&client(), gw, "/wx/notify", &headers, notification(id)).await;
    (answer.status, answer.text())
}

/// `paused` of the route `/wx` in `GET /admin/routes`.
async fn paused_of(metrics: SocketAddr) -> serde_json::Value {
    use http_body_util::BodyExt as _;
    let req = http::Request::get(format!("http://{metrics}/admin/routes"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let res = client().request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    super::gateway_dead_api::as_documented("get", "/admin/routes", 200, &v);
    (v["routes"].as_array().into_iter().flatten())
        .find(|r| r["prefix"] == "/wx")
        .map(|r| r["paused"].clone())
        .unwrap_or_else(|| panic!("no route /wx in {v}"))
}

/// `idempotency_route_paused{route="/wx"}`.
fn paused_gauge(metrics: SocketAddr) -> Option<f64> {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| l.starts_with("idempotency_route_paused{") && l.contains("route=\"/wx\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_on_one_instance_holds_on_another_on_the_same_redis() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file("pause-redis-token");
    let store = redis.url();
    let (ma, mb) = (free_addr(), free_addr());
    let a = start(up_addr, ma, &token, &["--store", &store]);
    let b = start(up_addr, mb, &token, &["--store", &store]);
    let run = std::process::id();
    let (done, held) = (
        format!("EV-PAUSE-DONE-{run}"),
        format!("EV-PAUSE-HELD-{run}"),
    );
    assert_eq!(send(b.addr, &done).await, (200, WECHAT_SUCCESS.to_owned()));
    assert_eq!(paused_gauge(mb), Some(0.0));

    let (code, out, err) = admin_cli(ma, &token, &["pause", "/wx", "--reason", "upstream deploy"]);
    assert_eq!((code, out.trim()), (0, "paused /wx"), "{err}");
    // The second instance reads it from the store.
    wait_for(
        "the pause on the second instance",
        Duration::from_secs(10),
        move || paused_gauge(mb) == Some(1.0),
    )
    .await;
    let paused = paused_of(mb).await;
    assert_eq!(paused["reason"], "upstream deploy", "{paused}");
    assert!(paused["since"].is_string(), "{paused}");
    // A new notification gets the channel's failure reply (it retries
    // later) and nothing reaches the upstream; a completed key's copy is
    // still replayed.
    for gw in [a.addr, b.addr] {
        let (status, body) = send(gw, &held).await;
        assert_ne!(status, 200);
        assert_eq!(body, WECHAT_FAIL);
        assert_eq!(send(gw, &done).await, (200, WECHAT_SUCCESS.to_owned()));
    }
    assert_eq!(
        up.counts().get(&held),
        None,
        "a paused route reached its upstream"
    );
    assert_eq!(up.counts().get(&done), Some(&1));

    let (code, out, err) = admin_cli(mb, &token, &["resume", "/wx"]);
    assert_eq!((code, out.trim()), (0, "resumed /wx"), "{err}");
    wait_for(
        "the resume on the first instance",
        Duration::from_secs(10),
        move || paused_gauge(ma) == Some(0.0),
    )
    .await;
    assert_eq!(send(a.addr, &held).await, (200, WECHAT_SUCCESS.to_owned()));
    assert_eq!(up.counts().get(&held), Some(&1));
    // An unknown route is refused, and says so.
    let (code, _, err) = admin_cli(ma, &token, &["pause", "/nowhere"]);
    assert_eq!(code, 1);
    assert!(err.contains("no route has this prefix"), "{err}");
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_kept_across_a_restart_and_an_ack_route_delivers_once_after_resume() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file("pause-restart-token");
    let dir = temp_path("pause-restart");
    let metrics = free_addr();
    let extra = [
        "--data-dir",
        dir.to_str().unwrap(),
        "--ack-then-deliver",
        "/wx",
        "--retry-backoff",
        "200ms",
    ];
    let gw = start(up_addr, metrics, &token, &extra);
    let (code, out, err) = admin_cli(metrics, &token, &["pause", "/wx", "--reason", "repair"]);
    assert_eq!((code, out.trim()), (0, "paused /wx"), "{err}");
    gw.signal(libc::SIGTERM);
    drop(gw);

    // Restarted on the same data directory: still paused.
    let gw = start(up_addr, metrics, &token, &extra);
    let paused = paused_of(metrics).await;
    assert_eq!(paused["reason"], "repair", "{paused}");
    assert_eq!(paused_gauge(metrics), Some(1.0));
    // Acknowledged and queued, not delivered.
    let ids: Vec<String> = (0..5)
        .map(|i| format!("EV-PAUSE-ACK-{i}-{}", std::process::id()))
        .collect();
    for id in &ids {
        assert_eq!(send(gw.addr, id).await, (200, WECHAT_SUCCESS.to_owned()));
    }
    wait_for("five queued", Duration::from_secs(30), move || {
        gauge(metrics, "idempotency_queue_depth") == Some(5.0)
    })
    .await;
    // Past a few of the route's backoffs, still nothing delivered, nothing
    // dead-lettered.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        up.counts().is_empty(),
        "a paused route delivered: {:?}",
        up.counts()
    );
    assert_eq!(gauge(metrics, "idempotency_queue_dead_letters"), Some(0.0));
    assert_eq!(gauge(metrics, "idempotency_queue_depth"), Some(5.0));

    let (code, _, err) = admin_cli(metrics, &token, &["resume", "/wx"]);
    assert_eq!(code, 0, "{err}");
    let probe = up.clone();
    wait_for(
        "every delivery after resume",
        Duration::from_secs(60),
        move || probe.counts().len() == 5,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let counts = up.counts();
    for id in &ids {
        assert_eq!(counts.get(id), Some(&1), "{counts:?}");
    }
    assert_eq!(paused_of(metrics).await, serde_json::Value::Null);
    up.down.store(false, Ordering::SeqCst);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}

/// `idempotency_queue_attempts_total{result}` of the gateway's queue.
fn attempts(metrics: SocketAddr, result: &str) -> f64 {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| {
            l.starts_with("idempotency_queue_attempts_total{")
                && l.contains("queue=\"gateway\"")
                && l.contains(&format!("result=\"{result}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_routes_held_entries_neither_spin_nor_stall_another_route() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file("pause-held-token");
    let dir = temp_path("pause-held");
    let metrics = free_addr();
    let extra = [
        "--data-dir",
        dir.to_str().unwrap(),
        "--route",
        "/wy=wechatpay-v3",
        "--ack-then-deliver",
        "/wx",
        "--ack-then-deliver",
        "/wy",
    ];
    let gw = start(up_addr, metrics, &token, &extra);
    let (code, _, err) = admin_cli(metrics, &token, &["pause", "/wx"]);
    assert_eq!(code, 0, "{err}");
    const HELD: usize = 300;
    let tag = std::process::id();
    let http = client();
    let headers = [("content-type", "application/json")];
    for i in 0..HELD {
        let id = format!("EV-HELD-{i}-{tag}");
        let answer = post(&http, gw.addr, "/wx/notify", &headers, notification(&id)).await;
        assert_eq!(answer.text(), WECHAT_SUCCESS);
    }
    // Each held entry looked at once, then left alone for a long while.
    wait_for(
        "every held entry looked at",
        Duration::from_secs(60),
        move || attempts(metrics, "paused") >= HELD as f64,
    )
    .await;
    let looked = attempts(metrics, "paused");
    // Another route delivers meanwhile, each notification once.
    let live: Vec<String> = (0..5).map(|i| format!("EV-LIVE-{i}-{tag}")).collect();
    for id in &live {
        let answer = post(&http, gw.addr, "/wy/notify", &headers, notification(id)).await;
        assert_eq!(answer.text(), WECHAT_SUCCESS);
    }
    let probe = up.clone();
    let want = live.clone();
    wait_for(
        "the other route's deliveries",
        Duration::from_secs(30),
        move || {
            let counts = probe.counts();
            want.iter().all(|id| counts.contains_key(id))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let again = attempts(metrics, "paused") - looked;
    assert!(
        again < (HELD / 2) as f64,
        "held entries handed out again {again} times within 12 s: a busy loop"
    );
    let counts = up.counts();
    assert!(
        counts.keys().all(|id| id.starts_with("EV-LIVE-")),
        "a paused route delivered: {counts:?}"
    );
    assert!(
        live.iter().all(|id| counts.get(id) == Some(&1)),
        "{counts:?}"
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_route_with_an_upstream_of_its_own_forwards_nothing_unguarded() {
    // An `auto` route forwards what it does not guard (a GET) to its own
    // upstream: a pause holds that too, as it holds the default upstream's.
    let own = test_support::common::upstream::Upstream::start().await;
    let default = test_support::common::upstream::Upstream::start().await;
    let token = token_file("pause-own-upstream-token");
    let metrics = free_addr();
    let dir = temp_path("pause-own-upstream");
    let cfg = temp_path("pause-own-upstream.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\nmetrics_listen = \"{metrics}\"\n\
             admin_token_file = \"{}\"\ndata_dir = \"{}\"\n\
             [[upstreams]]\nname = \"orders\"\nurl = \"{}\"\n\
             [[route]]\nprefix = \"/hooks\"\npreset = \"auto\"\nupstream = \"orders\"\n\
             [[route]]\nprefix = \"/other\"\npreset = \"auto\"\n",
            default.url(),
            token.display(),
            dir.display(),
            own.url()
        ),
    )
    .unwrap();
    let gw = Proc::start(&["--config", cfg.to_str().unwrap()], &[], Stdio::inherit());
    assert_eq!(get(gw.addr, "/hooks/status").0, 200);
    assert_eq!(own.calls("/hooks/status"), 1);
    let (code, _, err) = admin_cli(metrics, &token, &["pause", "/hooks"]);
    assert_eq!(code, 0, "{err}");
    let text = crate::gateway_support::raw_http(
        gw.addr,
        "GET /hooks/status HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    );
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 30"),
        "{text}"
    );
    assert_eq!(
        own.calls("/hooks/status"),
        1,
        "a paused route reached its upstream"
    );
    // A client's submission (a POST with its Idempotency-Key) is held the
    // same way: 503 with Retry-After, nothing sent.
    let text = crate::gateway_support::raw_http(
        gw.addr,
        "POST /hooks/orders HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: order-77\r\n\
         Content-Type: application/json\r\nContent-Length: 13\r\nConnection: close\r\n\r\n\
         {\"amount\":10}",
    );
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.to_ascii_lowercase().contains("retry-after:"), "{text}");
    assert_eq!(
        own.calls("/hooks/orders"),
        0,
        "a paused route's client submission reached its upstream"
    );
    // Another route's unguarded requests still go through.
    assert_eq!(get(gw.addr, "/other/status").0, 200);
    assert_eq!(default.calls("/other/status"), 1);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(cfg);
    let _ = std::fs::remove_file(token);
}

/// Posts `n` notifications tagged `tag` to `path` on `gw`; their ids.
async fn send_many(gw: SocketAddr, path: &str, tag: &str, n: usize) -> Vec<String> {
    let http = client();
    let headers = [("content-type", "application/json")];
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("EV-{tag}-{i}-{}", std::process::id());
        let answer = post(&http, gw, path, &headers, notification(&id)).await;
        assert_eq!(answer.text(), WECHAT_SUCCESS, "{id}");
        ids.push(id);
    }
    ids
}

/// Waits until every id of `ids` was delivered, then asserts each once.
async fn delivered_once(up: &Upstream, ids: &[String], what: &str) {
    let (probe, want) = (up.clone(), ids.to_vec());
    wait_for(what, Duration::from_secs(120), move || {
        let counts = probe.counts();
        want.iter().all(|id| counts.contains_key(id))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let counts = up.counts();
    let twice: Vec<&String> = ids
        .iter()
        .filter(|id| counts.get(*id) != Some(&1))
        .collect();
    assert!(twice.is_empty(), "{what}: not delivered once: {twice:?}");
}

/// On `queue`: 300 entries queued on the paused `/wx` are each looked at
/// once and parked; over a window longer than a postponement (30 s) none
/// is fetched again, while `/wy` delivers each of its notifications once;
/// they count in the queue's depth; the gateway restarts while they are
/// parked; after `resume` each is delivered exactly once.
async fn parked_while_paused(queue: &[&str], tag: &str) {
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file(&format!("park-token-{tag}"));
    let dir = temp_path(&format!("park-{tag}"));
    let metrics = free_addr();
    let mut extra = vec![
        "--data-dir",
        dir.to_str().unwrap(),
        "--route",
        "/wy=wechatpay-v3",
        "--ack-then-deliver",
        "/wx",
        "--ack-then-deliver",
        "/wy",
    ];
    extra.extend_from_slice(queue);
    let gw = start(up_addr, metrics, &token, &extra);
    let (code, _, err) = admin_cli(metrics, &token, &["pause", "/wx"]);
    assert_eq!(code, 0, "{err}");
    const HELD: usize = 300;
    let held = send_many(gw.addr, "/wx/notify", &format!("PARK-{tag}"), HELD).await;
    wait_for(
        "every held entry looked at",
        Duration::from_secs(60),
        move || attempts(metrics, "paused") >= HELD as f64,
    )
    .await;
    let looked = attempts(metrics, "paused");
    let live = send_many(gw.addr, "/wy/notify", &format!("LIVE-{tag}"), 20).await;
    delivered_once(&up, &live, "the other route's deliveries").await;
    tokio::time::sleep(Duration::from_secs(32)).await;
    assert_eq!(
        attempts(metrics, "paused") - looked,
        0.0,
        "parked entries were fetched again"
    );
    assert_eq!(
        gauge(metrics, "idempotency_queue_depth"),
        Some(HELD as f64),
        "the parked entries are the queue's depth"
    );
    let counts = up.counts();
    assert!(
        counts.keys().all(|id| id.contains("-LIVE-")),
        "a paused route delivered: {counts:?}"
    );

    // Restarted while they are parked: still parked, none fetched.
    gw.signal(libc::SIGTERM);
    drop(gw);
    let gw = start(up_addr, metrics, &token, &extra);
    assert!(paused_of(metrics).await.is_object());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(attempts(metrics, "paused"), 0.0, "fetched after a restart");
    assert_eq!(gauge(metrics, "idempotency_queue_depth"), Some(HELD as f64));

    let (code, _, err) = admin_cli(metrics, &token, &["resume", "/wx"]);
    assert_eq!(code, 0, "{err}");
    delivered_once(&up, &held, "every parked entry after resume").await;
    delivered_once(&up, &live, "the other route's deliveries").await;
    wait_for("an empty queue", Duration::from_secs(30), move || {
        gauge(metrics, "idempotency_queue_depth") == Some(0.0)
    })
    .await;
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_routes_entries_are_parked_not_cycled_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    parked_while_paused(&[], "embedded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_routes_entries_are_parked_not_cycled_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    let url = redis.url();
    parked_while_paused(
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        "redis",
    )
    .await;
}

/// Two gateways on one Redis (queue and store): `/wx` paused through A,
/// notifications sent to B are parked (by whichever worker fetched them),
/// `resume` through A wakes them (each instance's waker may run it), and
/// each is delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_on_one_instance_woken_by_a_resume_on_another_delivered_once() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    let url = redis.url();
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file("park-two-token");
    let (ma, mb) = (free_addr(), free_addr());
    let extra = [
        "--queue",
        &url,
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
        "--store",
        &url,
        "--ack-then-deliver",
        "/wx",
    ];
    let a = start(up_addr, ma, &token, &extra);
    let b = start(up_addr, mb, &token, &extra);
    let (code, _, err) = admin_cli(ma, &token, &["pause", "/wx"]);
    assert_eq!(code, 0, "{err}");
    wait_for("the pause on B", Duration::from_secs(10), move || {
        paused_gauge(mb) == Some(1.0)
    })
    .await;
    const HELD: usize = 100;
    let held = send_many(b.addr, "/wx/notify", "PARK-TWO", HELD).await;
    wait_for(
        "every entry looked at once",
        Duration::from_secs(60),
        move || attempts(ma, "paused") + attempts(mb, "paused") >= HELD as f64,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        attempts(ma, "paused") + attempts(mb, "paused"),
        HELD as f64,
        "an entry was looked at twice"
    );
    assert!(up.counts().is_empty(), "{:?}", up.counts());
    let (code, _, err) = admin_cli(ma, &token, &["resume", "/wx"]);
    assert_eq!(code, 0, "{err}");
    delivered_once(&up, &held, "every parked entry after resume on A").await;
    drop((a, b));
    let _ = std::fs::remove_file(token);
}

/// A gateway that cannot read the paused routes at start (here its
/// `pauses.json` cannot be read) holds every queued delivery and wakes no
/// parked entry until it can: the paused route's parked entries never reach
/// its upstream before the pause is read, and once it is read they stay
/// parked until `resume`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_that_cannot_be_read_at_start_is_held() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, up_addr) = Upstream::start(false).await;
    let token = token_file("park-unread-token");
    let dir = temp_path("park-unread");
    let metrics = free_addr();
    let extra = [
        "--data-dir",
        dir.to_str().unwrap(),
        "--ack-then-deliver",
        "/wx",
    ];
    let gw = start(up_addr, metrics, &token, &extra);
    let (code, _, err) = admin_cli(metrics, &token, &["pause", "/wx"]);
    assert_eq!(code, 0, "{err}");
    const HELD: usize = 50;
    let held = send_many(gw.addr, "/wx/notify", "UNREAD", HELD).await;
    wait_for("every entry parked", Duration::from_secs(60), move || {
        attempts(metrics, "paused") >= HELD as f64
    })
    .await;
    gw.signal(libc::SIGTERM);
    drop(gw);
    // The pauses cannot be read at the next start.
    let kept = dir.join("pauses.json");
    let pauses = std::fs::read(&kept).unwrap();
    std::fs::write(&kept, b"{ not json").unwrap();
    let gw = start(up_addr, metrics, &token, &extra);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        up.counts().is_empty(),
        "delivered before the pause was read: {:?}",
        up.counts()
    );
    // Readable again: read, and the route is still paused.
    std::fs::write(&kept, &pauses).unwrap();
    wait_for("the pause read", Duration::from_secs(10), move || {
        paused_gauge(metrics) == Some(1.0)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(up.counts().is_empty(), "{:?}", up.counts());
    let (code, _, err) = admin_cli(metrics, &token, &["resume", "/wx"]);
    assert_eq!(code, 0, "{err}");
    delivered_once(&up, &held, "every parked entry after resume").await;
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}
