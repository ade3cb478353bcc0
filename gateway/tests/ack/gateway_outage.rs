//! The storm after an outage, through the gateway binary over real TCP: a
//! backlog of distinct WeChat Pay v3 notifications (and copies of each)
//! released at once against a fragile upstream that serves 50 ms calls but
//! falls over above 20 at once (every extra call hangs 3 s, then 503). A
//! channel-like client retries each copy every second until it gets the
//! success reply.
//!
//! - With `--max-upstream-calls 20`, or a route's `max_in_flight = 20`: every
//!   notification acknowledged, each executed exactly once upstream, and the
//!   upstream never sees more than 20 calls at once.
//! - Ack-then-deliver with `deliver_concurrency = 20`: every copy
//!   acknowledged at once, each notification delivered exactly once, never
//!   more than 20 at once.
//! - The same with three gateways on one Redis Streams queue (and one Redis
//!   store), on one RabbitMQ queue (its key records and slots in one Redis
//!   store), or on one NATS JetStream queue (its slots in the server's
//!   `PACE` bucket): `deliver_concurrency = 20` holds for all of them
//!   together.
//! - Three gateways on one Redis queue against an upstream that fails
//!   everything: the breaker is shared, at most 3 probes per cooldown for
//!   all of them together, and everything is delivered once when it is back.
//! - Today's behaviour (no limit: the default cap of 1024 is far above what
//!   this upstream bears): the backlog knocks it over.
//!
//! The scenario is scaled down from 600 notifications to 300 (x 3 copies)
//! so that it runs on a small CI machine; `cargo run --release --example
//! retry_storm -- --scenario outage` runs the full size.

use crate::gateway_support;
use test_support::common;
use test_support::support_nats;
use test_support::support_rabbitmq;
use test_support::support_redis;

use bytes::Bytes;
use common::vectors::{fixture, WECHAT_SUCCESS};
use common::{client, read, HttpClient};
use gateway_support::{get, Gateway};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Distinct notifications of the backlog (600 in the full scenario).
const NOTIFICATIONS: usize = 300;
/// Copies of each, released at the same instant.
const COPIES: usize = 3;
/// Calls the upstream bears at once.
const BEARS: usize = 20;
/// How long the client keeps retrying.
const GIVE_UP: Duration = Duration::from_secs(60);

/// A WeChat Pay v3 notification with its own `id`.
fn notification(id: &str) -> String {
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String(id.to_owned());
    v.to_string()
}

/// What the fragile upstream saw.
#[derive(Default)]
struct Fragile {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    /// Calls that arrived while more than [`BEARS`] were in progress.
    overloaded: AtomicUsize,
    /// Per notification id: how often it was executed (answered 200).
    executed: Mutex<HashMap<String, usize>>,
}

/// Leaves the in-flight count when the call ends, however it ends.
struct InFlight(Arc<Fragile>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Fragile {
    async fn call(self: Arc<Self>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let _leave = InFlight(self.clone());
        self.peak.fetch_max(now, Ordering::SeqCst);
        let body = req.into_body().collect().await.map(|b| b.to_bytes());
        let id = body
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["id"].as_str().map(str::to_owned))
            .unwrap_or_default();
        if now > BEARS {
            self.overloaded.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3)).await;
            let mut res = Response::new(Full::new(Bytes::from_static(b"overloaded\n")));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            return res;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        *self.executed.lock().unwrap().entry(id).or_default() += 1;
        Response::new(Full::new(Bytes::from_static(b"ok\n")))
    }

    async fn start() -> (Arc<Self>, String) {
        let fragile = Arc::new(Self::default());
        let f = fragile.clone();
        let svc = tower::service_fn(move |req| {
            let f = f.clone();
            async move { Ok::<_, Infallible>(f.call(req).await) }
        });
        let (addr, _task) = common::serve(svc).await;
        (fragile, format!("http://{addr}"))
    }
}

/// One copy, retried every second until it gets WeChat's success reply or
/// [`GIVE_UP`] passes; whether it was acknowledged.
async fn channel_copy(client: HttpClient, url: String, body: String) -> bool {
    let started = tokio::time::Instant::now();
    while started.elapsed() < GIVE_UP {
        let req = Request::post(url.as_str())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        // WeChat waits 5 s for an answer.
        let sent = tokio::time::timeout(Duration::from_secs(5), client.request(req)).await;
        if let Ok(Ok(res)) = sent {
            let a = read(res).await;
            if a.status == 200 && a.text() == WECHAT_SUCCESS {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    false
}

/// The backlog released at once through `gw`; per copy (the copies of
/// each notification together), whether it was acknowledged.
async fn release_backlog(gw: &Gateway, tag: &str, within: Duration) -> Vec<bool> {
    let client = client();
    let url = gw.url("/wx");
    let barrier = Arc::new(tokio::sync::Barrier::new(NOTIFICATIONS * COPIES));
    let mut tasks = Vec::new();
    for n in 0..NOTIFICATIONS {
        let body = notification(&format!("EV-{tag}-{n}"));
        for _ in 0..COPIES {
            let (client, url, body, barrier) =
                (client.clone(), url.clone(), body.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                tokio::time::timeout(within, channel_copy(client, url, body))
                    .await
                    .unwrap_or(false)
            }));
        }
    }
    let mut acked = Vec::with_capacity(tasks.len());
    for t in tasks {
        acked.push(t.await.unwrap());
    }
    acked
}

/// Notifications none of whose copies was acknowledged.
fn unacknowledged(copies: &[bool]) -> usize {
    copies
        .chunks(COPIES)
        .filter(|c| !c.iter().any(|a| *a))
        .count()
}

/// Notifications executed more than once upstream.
fn doubles(fragile: &Fragile) -> usize {
    let executed = fragile.executed.lock().unwrap();
    executed.values().filter(|n| **n > 1).count()
}

fn shed_count(metrics: std::net::SocketAddr) -> (f64, String) {
    let (_, text) = get(metrics, "/metrics");
    // Every preset's line (the exporter lists them in no fixed order).
    let shed = text
        .lines()
        .filter(|l| l.starts_with("idempotency_requests_total{") && l.contains("outcome=\"shed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    (shed, text)
}

/// Checks a limited run: everything acknowledged, executed once, and the
/// upstream never above what it bears.
async fn assert_upstream_stands(args: &[&str], tag: &str) {
    let (fragile, upstream) = Fragile::start().await;
    let metrics = common::free_addr();
    let metrics_arg = metrics.to_string();
    let mut all = args.to_vec();
    all.extend_from_slice(&["--metrics-listen", &metrics_arg]);
    let gw = Gateway::start(&upstream, &all);
    let acked = release_backlog(&gw, tag, GIVE_UP).await;
    let missing = unacknowledged(&acked);
    assert_eq!(missing, 0, "notifications never acknowledged\n{}", gw.log());
    let executed = fragile.executed.lock().unwrap().len();
    assert_eq!(executed, NOTIFICATIONS, "notifications executed upstream");
    assert_eq!(doubles(&fragile), 0, "notifications executed twice");
    let peak = fragile.peak.load(Ordering::SeqCst);
    assert!(peak <= BEARS, "the upstream saw {peak} calls at once");
    assert_eq!(fragile.overloaded.load(Ordering::SeqCst), 0);
    let (shed, text) = shed_count(metrics);
    assert!(shed > 0.0, "nothing was shed: {text}");
    assert!(
        text.lines().any(
            |l| l.starts_with("idempotency_upstream_in_flight{") && l.contains("route=\"/wx\"")
        ),
        "no in-flight gauge for /wx: {text}"
    );
}

/// `--max-upstream-calls 20`: the gateway's cap on the upstream keeps it
/// standing; what does not fit waits 50 ms, then gets WeChat's failure
/// reply and comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_cap_keeps_a_fragile_upstream_standing() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let args = ["--route", "/wx=wechatpay-v3", "--max-upstream-calls", "20"];
    assert_upstream_stands(&args, "cap").await;
}

/// A route's `max_in_flight = 20` in the config file (with its own
/// `queue_wait`) does the same for that route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_max_in_flight_keeps_a_fragile_upstream_standing() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let config = gateway_support::temp_path("outage.toml");
    std::fs::write(
        &config,
        "queue_wait = \"20ms\"\n\
         [[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
         max_in_flight = 20\nqueue_wait = \"100ms\"\n",
    )
    .unwrap();
    let config = config.display().to_string();
    assert_upstream_stands(&["--config", &config], "route").await;
}

/// Ack-then-deliver with `deliver_concurrency = 20`: every copy is
/// acknowledged from the queue at once (nothing waits for the upstream),
/// then the worker delivers each notification exactly once, never more than
/// 20 at once, so the upstream never falls over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_then_deliver_paces_the_backlog_to_what_the_upstream_bears() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let (fragile, upstream) = Fragile::start().await;
    let dir = gateway_support::temp_path("outage-ack");
    let config = gateway_support::temp_path("outage-ack.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\nretry_backoff = \"200ms\"\n\
             [[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
             mode = \"ack-then-deliver\"\ndeliver_concurrency = 20\n",
            dir.display().to_string()
        ),
    )
    .unwrap();
    let (config, metrics) = (config.display().to_string(), common::free_addr());
    let metrics_arg = metrics.to_string();
    let gw = Gateway::start(
        &upstream,
        &["--config", &config, "--metrics-listen", &metrics_arg],
    );
    let acked = release_backlog(&gw, "ack", GIVE_UP).await;
    let missing = acked.iter().filter(|a| !**a).count();
    assert_eq!(missing, 0, "copies never acknowledged\n{}", gw.log());
    // Delivered from the queue: wait until the upstream has them all.
    let started = std::time::Instant::now();
    while fragile.executed.lock().unwrap().len() < NOTIFICATIONS && started.elapsed() < GIVE_UP {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let executed = fragile.executed.lock().unwrap().len();
    assert_eq!(
        executed,
        NOTIFICATIONS,
        "notifications delivered\n{}",
        gw.log()
    );
    assert_eq!(doubles(&fragile), 0, "notifications delivered twice");
    let peak = fragile.peak.load(Ordering::SeqCst);
    assert!(peak <= BEARS, "the upstream saw {peak} calls at once");
    assert_eq!(fragile.overloaded.load(Ordering::SeqCst), 0);
    // The upstream has answered the last deliveries; their settlements
    // (a commit each) may still be under way: the gauges fall to 0 once
    // they are done.
    for name in [
        "idempotency_deliveries_in_flight",
        "idempotency_upstream_breaker",
    ] {
        let value = || {
            let (_, text) = get(metrics, "/metrics");
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("route=\"/wx\""))
                .map(str::to_owned);
            (
                line.and_then(|l| l.rsplit(' ').next().map(str::to_owned)),
                text,
            )
        };
        let settled = std::time::Instant::now();
        let (mut seen, mut text) = value();
        while seen.as_deref() != Some("0") && settled.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            (seen, text) = value();
        }
        assert_eq!(seen.as_deref(), Some("0"), "{name}: {text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three gateways on one Redis Streams queue and one Redis store, each with
/// `deliver_concurrency = 20`: the slots are shared, so the upstream never
/// sees more than 20 deliveries at once (not 60), and each notification is
/// delivered once. The copies of each notification go to different
/// gateways, as a load balancer spreads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_redis_queue_share_deliver_concurrency() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    three_gateways_share_deliver_concurrency(&url, &url, "three").await;
}

/// The same on one RabbitMQ queue: the slots are claims in the gateways'
/// shared Redis store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_rabbitmq_queue_share_deliver_concurrency() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let redis = support_redis::RedisServer::start();
    three_gateways_share_deliver_concurrency(&broker.url(), &redis.url(), "three-amqp").await;
}

async fn three_gateways_share_deliver_concurrency(queue: &str, store: &str, tag: &str) {
    let (fragile, upstream) = Fragile::start().await;
    let config = gateway_support::temp_path(&format!("outage-{tag}.toml"));
    std::fs::write(
        &config,
        "retry_backoff = \"200ms\"\n\
         [[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
         mode = \"ack-then-deliver\"\ndeliver_concurrency = 20\n",
    )
    .unwrap();
    let config = config.display().to_string();
    let secret = [
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    let args = [
        "--config", &config, "--queue", queue, "--store", store, secret[0], secret[1],
    ];
    let gateways: Vec<Gateway> = (0..3).map(|_| Gateway::start(&upstream, &args)).collect();
    let client = client();
    let barrier = Arc::new(tokio::sync::Barrier::new(NOTIFICATIONS * COPIES));
    let mut tasks = Vec::new();
    for n in 0..NOTIFICATIONS {
        let body = notification(&format!("EV-{tag}-{n}"));
        for copy in 0..COPIES {
            let url = gateways[(n + copy) % 3].url("/wx");
            let (client, body, barrier) = (client.clone(), body.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                channel_copy(client, url, body).await
            }));
        }
    }
    let mut missing = 0;
    for t in tasks {
        missing += usize::from(!t.await.unwrap());
    }
    let logs = || {
        gateways
            .iter()
            .map(Gateway::log)
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(missing, 0, "copies never acknowledged\n{}", logs());
    let started = std::time::Instant::now();
    while fragile.executed.lock().unwrap().len() < NOTIFICATIONS && started.elapsed() < GIVE_UP {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let executed = fragile.executed.lock().unwrap().len();
    assert_eq!(
        executed,
        NOTIFICATIONS,
        "notifications delivered (peak {}, overloaded {})\n{}",
        fragile.peak.load(Ordering::SeqCst),
        fragile.overloaded.load(Ordering::SeqCst),
        logs()
    );
    let took = started.elapsed();
    assert_eq!(doubles(&fragile), 0, "notifications delivered twice");
    let peak = fragile.peak.load(Ordering::SeqCst);
    assert!(
        peak <= BEARS,
        "the upstream saw {peak} calls at once from three gateways"
    );
    assert_eq!(fragile.overloaded.load(Ordering::SeqCst), 0);
    eprintln!("three gateways ({tag}): peak {peak}, delivered all {NOTIFICATIONS} within {took:?} of the last acknowledgement");
}

/// Today's behaviour, without a limit that fits the upstream: the backlog
/// reaches it all at once and knocks it over (far more than 20 calls at
/// once, many of them hung). Nothing is doubled even so. Bounded to a few
/// seconds: it would take minutes to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_limit_the_backlog_knocks_the_upstream_over() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let (fragile, upstream) = Fragile::start().await;
    let gw = Gateway::start(&upstream, &["--route", "/wx=wechatpay-v3"]);
    release_backlog(&gw, "none", Duration::from_secs(6)).await;
    let peak = fragile.peak.load(Ordering::SeqCst);
    assert!(peak > BEARS, "peak {peak}");
    assert!(fragile.overloaded.load(Ordering::SeqCst) > 0);
    assert_eq!(doubles(&fragile), 0, "notifications executed twice");
}

/// The library's layer inside a client API's stack: past the cap, after the
/// queue wait, the caller gets 503 with `Retry-After` and the handler is not
/// called; the slot is held until the first answer's body has been read,
/// and then the same key runs.
#[tokio::test]
async fn in_flight_limit_answers_a_client_api_with_503_and_retry_after() {
    let _beside = crate::gateway_support::beside_storms().await;
    use idempotency_gateway::shed::InFlightLimitLayer;
    use tower::{ServiceBuilder, ServiceExt};
    use tower_idempotency::{IdempotencyLayer, Outcome};

    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let limit = InFlightLimitLayer::new(1).queue_wait(Duration::from_millis(20));
    let slots = limit.slots().clone();
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move |_req: Request<Full<Bytes>>| {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let _open = gate.acquire().await.unwrap();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"created"))))
            }
        }
    };
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .layer(limit)
        .service_fn(handler);
    let order = |key: &str| {
        Request::post("/orders")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(br#"{"sku":"A1"}"#)))
            .unwrap()
    };
    let first = tokio::spawn(svc.clone().oneshot(order("k-1")));
    while slots.in_flight() == 0 {
        tokio::task::yield_now().await;
    }
    let shed = svc.clone().oneshot(order("k-2")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(shed.headers()["retry-after"], "1");
    assert_eq!(shed.extensions().get::<Outcome>(), Some(&Outcome::Shed));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the shed call reached the handler"
    );
    gate.add_permits(10);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(read(first).await.text(), "created");
    assert_eq!(slots.in_flight(), 0, "the slot outlived the answer");
    let retried = svc.oneshot(order("k-2")).await.unwrap();
    assert_eq!(retried.status(), 200);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Values of the new settings that cannot work exit 2 with the reason and
/// the line: a route's `max_in_flight` of 0, an `auto_limit` without
/// `max_in_flight = "auto"` or with values that cannot work, a bad
/// `queue_wait`, a bad `--queue-wait`.
#[test]
fn bad_limits_exit_2_with_the_reason() {
    use gateway_support::{exits_2, gateway_bin};
    use std::process::Command;

    for (route_line, hint) in [
        (
            "max_in_flight = 0",
            ":5: `max_in_flight`: expected a whole number more than 0",
        ),
        (
            "max_in_flight = \"automatic\"",
            ":5: `max_in_flight`: expected a whole number more than 0 or \"auto\"",
        ),
        (
            "auto_limit = { max = 30 }",
            ":5: `auto_limit` tunes `max_in_flight = \"auto\"`",
        ),
        (
            "max_in_flight = 20\nauto_limit = { max = 30 }",
            ":6: `auto_limit` tunes `max_in_flight = \"auto\"`",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { min = 0 }",
            ":6: `auto_limit.min`: expected a whole number more than 0",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { min = 10, max = 5 }",
            ":6: `auto_limit`: `max` (5) is below `min` (10)",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { max = 10, initial = 20 }",
            ":6: `auto_limit.initial`: 20 must be from `min` (1) to `max` (10)",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { backoff = 1.0 }",
            ":6: `auto_limit.backoff`: 1 must be at least 0.5 and less than 1",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { tolerance = 0.5 }",
            ":6: `auto_limit.tolerance`: 0.5 must be a number of at least 1",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { tolerance = 2.0, latency_threshold = \"100ms\" }",
            ":6: `auto_limit`: give `latency_threshold` (fixed) or `tolerance`",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { latency_threshold = \"soon\" }",
            ":6: `auto_limit.latency_threshold`:",
        ),
        // Extremes no limit works with: errors, not panics.
        (
            "max_in_flight = \"auto\"\nauto_limit = { latency_threshold = \"30d\" }",
            ":6: `auto_limit`: latency threshold",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { tolerance = inf }",
            ":6: `auto_limit.tolerance`: inf must be a number of at least 1",
        ),
        (
            "max_in_flight = \"auto\"\nauto_limit = { tolerance = 1e300 }",
            ":6: `auto_limit`: tolerance",
        ),
        ("max_in_flight = \"auto\"\nauto_limit = { mx = 3 }", "unknown field `mx`"),
        (
            "max_in_flight = \"many\"",
            ":5: `max_in_flight`: expected a whole number",
        ),
        ("queue_wait = \"soon\"", ":5: `queue_wait`:"),
    ] {
        let file = gateway_support::temp_path("bad.toml");
        std::fs::write(
            &file,
            format!(
                "upstream = \"http://127.0.0.1:1\"\n[[route]]\nprefix = \"/wx\"\n\
                 preset = \"wechatpay-v3\"\n{route_line}\n"
            ),
        )
        .unwrap();
        let mut cmd = Command::new(gateway_bin());
        cmd.args(["--listen", "127.0.0.1:0", "--check-config", "--config"])
            .arg(&file);
        exits_2(cmd, hint);
        let _ = std::fs::remove_file(&file);
    }
    let mut cmd = Command::new(gateway_bin());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:1",
        "--check-config",
        "--queue-wait",
        "soon",
    ]);
    exits_2(cmd, "--queue-wait");
}

/// A route's `max_in_flight = "auto"`: the adaptive limit, from 10, finds
/// what the upstream bears by itself. Every notification acknowledged, each
/// executed exactly once, and the upstream never sees more calls at once
/// than the configured `max` (30: the limit can overshoot the 20 it bears
/// before the slow calls bring it down, never past its max). The limit's
/// gauge is there from the start, at its initial value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_limit_keeps_a_fragile_upstream_standing() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    const MAX: usize = 30;
    let (fragile, upstream) = Fragile::start().await;
    let config = gateway_support::temp_path("outage-auto.toml");
    std::fs::write(
        &config,
        format!(
            "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
             max_in_flight = \"auto\"\nauto_limit = {{ min = 2, max = {MAX}, initial = 10 }}\n"
        ),
    )
    .unwrap();
    let metrics = common::free_addr();
    let (config_arg, metrics_arg) = (config.display().to_string(), metrics.to_string());
    let gw = Gateway::start(
        &upstream,
        &["--config", &config_arg, "--metrics-listen", &metrics_arg],
    );
    let limit = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("idempotency_upstream_limit{") && l.contains("route=\"/wx\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    let (_, text) = get(metrics, "/metrics");
    assert_eq!(
        limit(&text),
        Some(10.0),
        "the initial limit at start: {text}"
    );
    let acked = release_backlog(&gw, "auto", GIVE_UP).await;
    let missing = acked.iter().filter(|a| !**a).count();
    assert_eq!(missing, 0, "notifications never acknowledged\n{}", gw.log());
    let executed = fragile.executed.lock().unwrap().len();
    assert_eq!(executed, NOTIFICATIONS, "notifications executed upstream");
    assert_eq!(doubles(&fragile), 0, "notifications executed twice");
    let peak = fragile.peak.load(Ordering::SeqCst);
    assert!(
        peak <= MAX,
        "the upstream saw {peak} calls at once, over max {MAX}"
    );
    let (_, text) = get(metrics, "/metrics");
    let now = limit(&text).expect("the limit's gauge");
    assert!((2.0..=MAX as f64).contains(&now), "limit {now}");
    let _ = std::fs::remove_file(&config);
}

/// An upstream that fails every call (503 at once) while it is down, then
/// answers 200: when each call came, and how often each notification was
/// executed (answered 200).
#[derive(Default)]
struct Fallen {
    up: std::sync::atomic::AtomicBool,
    calls: Mutex<Vec<std::time::Instant>>,
    executed: Mutex<HashMap<String, usize>>,
}

impl Fallen {
    async fn call(self: Arc<Self>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        self.calls.lock().unwrap().push(std::time::Instant::now());
        let body = req.into_body().collect().await.map(|b| b.to_bytes());
        if !self.up.load(Ordering::SeqCst) {
            let mut res = Response::new(Full::new(Bytes::from_static(b"down\n")));
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            return res;
        }
        let id = body
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["id"].as_str().map(str::to_owned))
            .unwrap_or_default();
        *self.executed.lock().unwrap().entry(id).or_default() += 1;
        Response::new(Full::new(Bytes::from_static(b"ok\n")))
    }

    async fn start() -> (Arc<Self>, String) {
        let fallen = Arc::new(Self::default());
        let f = fallen.clone();
        let svc = tower::service_fn(move |req| {
            let f = f.clone();
            async move { Ok::<_, Infallible>(f.call(req).await) }
        });
        let (addr, _task) = common::serve(svc).await;
        (fallen, format!("http://{addr}"))
    }

    fn calls_between(&self, from: std::time::Instant, to: std::time::Instant) -> usize {
        let calls = self.calls.lock().unwrap();
        calls.iter().filter(|t| **t >= from && **t < to).count()
    }
}

/// Three gateways on one Redis Streams queue judge the upstream together:
/// the breaker's votes, its open state and its half-open probes live in
/// Redis. Against an upstream that fails everything, once the breaker is
/// open the upstream sees at most 3 probes per cooldown from the three of
/// them together (each judging alone, each probes on its own: about three
/// times that), and the gateway that opened it stops the others; once the
/// upstream is back, every notification is delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_redis_queue_share_the_breaker() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    /// The breaker's most probes at once (the library's MAX_PROBES).
    const PROBES: usize = 3;
    const COOLDOWN: Duration = Duration::from_secs(1);
    const SENT: usize = 30;
    /// Cooldowns watched while the upstream is down, after the first.
    const WATCHED: u32 = 5;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let (fallen, upstream) = Fallen::start().await;
    let config = gateway_support::temp_path("outage-breaker.toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\n\
         mode = \"ack-then-deliver\"\nbreaker_failures = 5\nbreaker_cooldown = \"1s\"\n\
         retry_schedule = [\"100ms\"]\n",
    )
    .unwrap();
    let config = config.display().to_string();
    let secret = [
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ];
    let args = [
        "--config", &config, "--queue", &url, "--store", &url, secret[0], secret[1],
    ];
    let gateways: Vec<Gateway> = (0..3).map(|_| Gateway::start(&upstream, &args)).collect();
    let logs = || {
        gateways
            .iter()
            .map(Gateway::log)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let client = client();
    let mut tasks = Vec::new();
    for n in 0..SENT {
        let url = gateways[n % 3].url("/wx");
        let body = notification(&format!("EV-breaker-{n}"));
        tasks.push(tokio::spawn(channel_copy(client.clone(), url, body)));
    }
    for t in tasks {
        assert!(t.await.unwrap(), "a copy never acknowledged\n{}", logs());
    }
    // The first cooldown: the first failures open the breaker (and the
    // calls under way then end as they may).
    let first = loop {
        if let Some(t) = fallen.calls.lock().unwrap().first() {
            break *t;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let watch_from = first + COOLDOWN;
    let watch_to = watch_from + COOLDOWN * WATCHED;
    tokio::time::sleep_until((watch_to + Duration::from_millis(100)).into()).await;
    let probes = fallen.calls_between(watch_from, watch_to);
    let before = fallen.calls_between(first, watch_from);
    // A window of WATCHED cooldowns overlaps at most WATCHED + 1 half-open
    // periods.
    let most = PROBES * (WATCHED as usize + 1);
    assert!(
        probes <= most,
        "the upstream saw {probes} calls in {WATCHED} cooldowns after the breaker opened (at most {most}: {PROBES} probes per cooldown for the three gateways; {before} calls in the first cooldown)\n{}",
        logs()
    );
    assert!(probes > 0, "no probe in {WATCHED} cooldowns\n{}", logs());
    // Back up: the next probe closes it, and everything is delivered once.
    fallen.up.store(true, Ordering::SeqCst);
    let back = std::time::Instant::now();
    while fallen.executed.lock().unwrap().len() < SENT && back.elapsed() < GIVE_UP {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let executed = fallen.executed.lock().unwrap().clone();
    assert_eq!(executed.len(), SENT, "notifications delivered\n{}", logs());
    let twice = executed.values().filter(|n| **n > 1).count();
    assert_eq!(twice, 0, "notifications delivered twice");
    eprintln!(
        "shared breaker: {before} calls in the first cooldown, {probes} in the next {WATCHED}, all {SENT} delivered {:?} after the upstream came back",
        back.elapsed()
    );
}

/// The same with three gateways on one NATS JetStream queue (and one Redis
/// store): the slots are shared through the server's `PACE` bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_jetstream_queue_share_deliver_concurrency() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let Some(nats) = support_nats::own() else {
        return;
    };
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    three_gateways_share_deliver_concurrency(&nats.url(), &redis.url(), "three-js").await;
}
