//! How an ack-then-deliver route paces its deliveries, through the gateway
//! binary over real TCP: the circuit breaker (`breaker_failures`,
//! `breaker_cooldown`, the gauge `idempotency_upstream_breaker{route}`),
//! `deliver_rate` and `retry_schedule`; bad values exit 2 naming the key.

use crate::gateway_support;
use test_support::common;

use bytes::Bytes;
use common::vectors::{fixture, WECHAT_SUCCESS};
use common::{client, read};
use gateway_support::{exits_2, gateway_bin, get, temp_path, Gateway};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a test waits for something that should happen.
const PATIENCE: Duration = Duration::from_secs(30);

/// An upstream that counts its calls and answers 503 while `failing`.
#[derive(Default)]
struct Upstream {
    calls: AtomicUsize,
    delivered: AtomicUsize,
    failing: AtomicBool,
}

impl Upstream {
    async fn start(failing: bool) -> (Arc<Self>, String) {
        let up = Arc::new(Self::default());
        up.failing.store(failing, Ordering::SeqCst);
        let u = up.clone();
        let svc = tower::service_fn(move |_req: Request<hyper::body::Incoming>| {
            let u = u.clone();
            async move {
                u.calls.fetch_add(1, Ordering::SeqCst);
                let mut res = Response::new(Full::new(Bytes::from_static(b"ok\n")));
                match u.failing.load(Ordering::SeqCst) {
                    true => *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE,
                    false => {
                        u.delivered.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Ok::<_, Infallible>(res)
            }
        });
        let (addr, _task) = common::serve(svc).await;
        (up, format!("http://{addr}"))
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// A gateway with one ack-then-deliver WeChat Pay v3 route `/wx` with the
/// extra `route_keys`; its metrics address.
fn gateway(upstream: &str, top: &str, route_keys: &str) -> (Gateway, SocketAddr) {
    let dir = temp_path("pace-data");
    let config = temp_path("pace.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\n{top}\n[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
             mode = \"ack-then-deliver\"\n{route_keys}\n",
            dir.display().to_string()
        ),
    )
    .unwrap();
    let metrics = common::free_addr();
    let (config, metrics_arg) = (config.display().to_string(), metrics.to_string());
    let gw = Gateway::start(
        upstream,
        &["--config", &config, "--metrics-listen", &metrics_arg],
    );
    (gw, metrics)
}

/// Sends `n` distinct notifications; each must be acknowledged.
async fn notify(gw: &Gateway, tag: &str, n: usize) {
    let client = client();
    for i in 0..n {
        let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
        let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
        v["id"] = serde_json::Value::String(format!("EV-{tag}-{i}"));
        let req = Request::post(gw.url("/wx"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(v.to_string())))
            .unwrap();
        let a = read(client.request(req).await.unwrap()).await;
        assert_eq!(
            (a.status, a.text()),
            (200, WECHAT_SUCCESS.to_owned()),
            "{}",
            gw.log()
        );
    }
}

/// The value of `name{...route="/wx"...}`, if exported.
fn route_gauge(metrics: SocketAddr, name: &str) -> Option<f64> {
    let (_, text) = get(metrics, "/metrics");
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("route=\"/wx\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Waits until `done` holds (or panics with `what` after [`PATIENCE`]).
async fn until(what: &str, gw: &Gateway, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < PATIENCE, "never: {what}\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After `breaker_failures` consecutive failures the route's deliveries
/// stop for the cooldown (the gauge shows 1, the upstream gets no call);
/// then exactly one probe: it fails, and the breaker opens again; the next
/// probe succeeds, the breaker closes (0) and the rest are delivered, each
/// once. The changes are logged, naming the route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_stops_deliveries_for_the_cooldown_then_probes_once() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, url) = Upstream::start(true).await;
    let keys = "deliver_concurrency = 1\nbreaker_failures = 3\nbreaker_cooldown = \"2s\"\n\
                retry_schedule = [\"10ms\"]";
    let (gw, metrics) = gateway(&url, "", keys);
    assert_eq!(
        route_gauge(metrics, "idempotency_upstream_breaker"),
        Some(0.0)
    );
    notify(&gw, "breaker", 5).await;
    until("the breaker opens", &gw, || {
        route_gauge(metrics, "idempotency_upstream_breaker") == Some(1.0)
    })
    .await;
    // While it is open, the upstream gets nothing.
    assert_eq!(up.calls(), 3, "calls before the breaker opened");
    while up.calls() == 3 {
        // Open, or half-open the moment the probe starts.
        let state = route_gauge(metrics, "idempotency_upstream_breaker");
        assert!(matches!(state, Some(1.0 | 2.0)), "{state:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The probe, alone; it failed: open again.
    until("the failed probe opens it again", &gw, || {
        gw.log().matches("circuit breaker open").count() >= 2
    })
    .await;
    up.failing.store(false, Ordering::SeqCst);
    assert_eq!(up.calls(), 4, "one probe");
    let state = route_gauge(metrics, "idempotency_upstream_breaker");
    assert!(matches!(state, Some(1.0 | 2.0)), "{state:?}");
    until("all five are delivered", &gw, || {
        up.delivered.load(Ordering::SeqCst) >= 5
    })
    .await;
    until("the breaker closes", &gw, || {
        route_gauge(metrics, "idempotency_upstream_breaker") == Some(0.0)
    })
    .await;
    // Three failures, one failed probe, then each notification once.
    assert_eq!(up.calls(), 3 + 1 + 5);
    let log = gw.log();
    let opened = log
        .lines()
        .find(|l| l.contains("circuit breaker open"))
        .unwrap();
    assert!(
        opened.contains("WARN") && opened.contains("/wx"),
        "{opened}"
    );
    let closed = log.lines().find(|l| l.contains("circuit breaker closed"));
    let closed = closed.unwrap_or_else(|| panic!("no close logged\n{log}"));
    assert!(
        closed.contains("INFO") && closed.contains("/wx"),
        "{closed}"
    );
}

/// `deliver_rate = "1/m"`: one delivery starts, the next one's turn is a
/// minute away; without the key all of them are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_rate_holds_the_deliveries_back() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, url) = Upstream::start(false).await;
    let (gw, metrics) = gateway(&url, "", "deliver_rate = \"1/m\"");
    notify(&gw, "rate", 4).await;
    until("the first is delivered", &gw, || up.calls() >= 1).await;
    // The others stay queued for their turn.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(up.calls(), 1);
    let (_, text) = get(metrics, "/metrics");
    let depth = text
        .lines()
        .find(|l| l.starts_with("idempotency_queue_depth{"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(depth, Some(3.0), "{text}");

    let (up, url) = Upstream::start(false).await;
    let (gw, _) = gateway(&url, "", "");
    notify(&gw, "unlimited", 4).await;
    until("all four are delivered", &gw, || up.calls() >= 4).await;
}

/// `retry_schedule` is used instead of `retry_backoff` (an hour here): the
/// entry fails `max_attempts` times within moments, the last delay
/// repeating, and is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_schedule_replaces_the_backoff() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, url) = Upstream::start(true).await;
    let top = "retry_backoff = \"1h\"\nmax_attempts = 4";
    let (gw, metrics) = gateway(&url, top, "retry_schedule = [\"10ms\", \"20ms\"]");
    notify(&gw, "schedule", 1).await;
    until("dead-lettered", &gw, || {
        let (_, text) = get(metrics, "/metrics");
        text.lines()
            .any(|l| l.starts_with("idempotency_queue_dead_letters{") && l.ends_with(" 1"))
    })
    .await;
    assert_eq!(up.calls(), 4);
}

/// Bad values exit 2 naming the key and its line.
#[test]
fn bad_pacing_values_exit_2_naming_the_key() {
    for (line, hint) in [
        (
            "deliver_concurrency = 0",
            ":6: `deliver_concurrency`: expected a whole number more than 0",
        ),
        // Past what any upstream bears (and what the worker's fetch adds up).
        (
            "deliver_concurrency = 9223372036854775807",
            ":6: `deliver_concurrency`: expected a whole number from 1 to 65536",
        ),
        (
            "deliver_rate = \"fast\"",
            ":6: `deliver_rate`: `fast`: expected a rate like",
        ),
        ("deliver_rate = \"0/s\"", ":6: `deliver_rate`:"),
        ("deliver_rate = \"10/d\"", ":6: `deliver_rate`:"),
        (
            "retry_schedule = []",
            ":6: `retry_schedule`: expected at least one delay",
        ),
        (
            "retry_schedule = [\"15s\", \"soon\"]",
            ":6: `retry_schedule`: `soon`:",
        ),
        (
            "retry_schedule = \"15s\"",
            ":6: `retry_schedule`: expected a list of delays",
        ),
        (
            "retry_schedule = [15]",
            ":6: `retry_schedule`: expected a list of delays",
        ),
        (
            "breaker_failures = 0",
            ":6: `breaker_failures`: expected a whole number from 1",
        ),
        (
            "breaker_cooldown = \"0s\"",
            ":6: `breaker_cooldown`: must be more than 0",
        ),
    ] {
        let file = temp_path("bad-pace.toml");
        std::fs::write(
            &file,
            format!(
                "upstream = \"http://127.0.0.1:1\"\n[[route]]\nprefix = \"/wx\"\n\
                 preset = \"wechatpay-v3\"\nmode = \"ack-then-deliver\"\n{line}\n"
            ),
        )
        .unwrap();
        let mut cmd = Command::new(gateway_bin());
        cmd.args(["--listen", "127.0.0.1:0", "--check-config", "--config"])
            .arg(&file);
        exits_2(cmd, hint);
        let _ = std::fs::remove_file(&file);
    }
}

/// A route whose own `max_in_flight` is under `deliver_concurrency` (the
/// default 16): the worker runs no more deliveries than the route lets
/// through (lowered, with a warning), so none is shed by the gateway
/// itself, none uses an attempt for it, and with one attempt allowed none
/// is dead-lettered as "upstream answered 503" though the upstream never
/// failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_concurrency_above_the_routes_max_in_flight_is_lowered_to_it() {
    let _beside = crate::gateway_support::beside_storms().await;
    #[derive(Default)]
    struct Slow {
        now: AtomicUsize,
        peak: AtomicUsize,
        delivered: AtomicUsize,
    }
    let slow = Arc::new(Slow::default());
    let s = slow.clone();
    let svc = tower::service_fn(move |_req: Request<hyper::body::Incoming>| {
        let s = s.clone();
        async move {
            let now = s.now.fetch_add(1, Ordering::SeqCst) + 1;
            s.peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.now.fetch_sub(1, Ordering::SeqCst);
            s.delivered.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
        }
    });
    let (addr, _task) = common::serve(svc).await;
    let (gw, metrics) = gateway(
        &format!("http://{addr}"),
        "max_attempts = 1",
        "max_in_flight = 4",
    );
    until("the warning", &gw, || gw.log().contains("lowered to it")).await;
    let warned = gw.log();
    let line = warned
        .lines()
        .find(|l| l.contains("lowered to it"))
        .unwrap();
    assert!(line.contains("WARN") && line.contains("/wx"), "{line}");
    notify(&gw, "clamped", 24).await;
    until("all 24 are delivered", &gw, || {
        slow.delivered.load(Ordering::SeqCst) >= 24
    })
    .await;
    assert!(slow.peak.load(Ordering::SeqCst) <= 4);
    let (_, text) = get(metrics, "/metrics");
    let dead = text
        .lines()
        .find(|l| l.starts_with("idempotency_queue_dead_letters{"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(dead, Some(0.0), "{}", gw.log());
    assert_eq!(
        route_gauge(metrics, "idempotency_upstream_breaker"),
        Some(0.0)
    );
}

/// Two gateways on one Redis Streams queue pace a route together:
/// `deliver_rate = "1/m"` holds for both. The first delivers one
/// notification and stops; the second, started after it, delivers nothing
/// of its own within seconds, for the route's turn was taken on the queue
/// (a gateway that paced alone would start its first delivery at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_a_shared_queue_share_a_routes_deliver_rate() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = crate::gateway_ack::own_redis() else {
        return;
    };
    let (up, url) = Upstream::start(false).await;
    let top = format!(
        "queue = {:?}\nqueue_secret_file = {:?}",
        redis.url(),
        crate::gateway_support::queue_secret()
    );
    let rate = "deliver_rate = \"1/m\"";
    let (first, _) = gateway(&url, &top, rate);
    notify(&first, "shared-a", 1).await;
    until("the first gateway delivers", &first, || up.calls() >= 1).await;
    assert!(first.log().contains("pacing=Shared"), "{}", first.log());
    // Stopped: nothing of the second's can be fetched by the first.
    drop(first);
    let (second, _) = gateway(&url, &top, rate);
    notify(&second, "shared-b", 1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        up.calls(),
        1,
        "the second gateway started a delivery within the route's shared turn\n{}",
        second.log()
    );
}
