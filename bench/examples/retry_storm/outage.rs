//! `--scenario outage`: the storm after an outage, through the library's
//! `Gateway` in front of a fragile upstream, with no limit, with a cap
//! (shed; `--limit auto`: the route's adaptive limit), and acknowledging
//! first then delivering from the queue at `deliver_concurrency` (a `Worker`
//! with `concurrency(limit)`). With `--store redis://HOST:PORT`, one more
//! row: `--instances` gateways (3 when not given) acknowledging into one
//! Redis Streams queue (records in that Redis too), each with its worker at
//! `concurrency(limit)`: the slots, the rate and the breaker are shared, so
//! the limit holds for all of them together.
//!
//! The upstream serves 50 ms calls but falls over above `BEARS` at once:
//! every extra call hangs 3 s, then answers 503 (and does nothing). The
//! backlog (`--transactions` notifications x `--duplicates` copies) is
//! released at once by a channel-like client that retries each copy every
//! second until it gets WeChat's success reply (each try waits 5 s at most,
//! the whole run 120 s at most).

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_gateway::proxy::{CallLimit, Deliver, Forward, Gateway, RouteOptions, Target};
use idempotency_gateway::shed::{AimdLimit, Slots};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Preset;
use tower_idempotency_queue::{RedbQueue, RedisStreamsQueue, Worker};
use tower_idempotency_redis::RedisStore;

use crate::args::{Args, StoreArg};
use crate::server::serve;

/// The route of the notifications.
pub(crate) const PATH: &str = "/notify/wechatpay/v3";
/// Calls the upstream bears at once.
const BEARS: usize = 20;
/// How long the client keeps retrying.
const GIVE_UP: Duration = Duration::from_secs(120);
const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;

/// What the fragile upstream saw.
#[derive(Default)]
struct Fragile {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    /// Calls that arrived while it was falling over (more than `BEARS` in progress).
    overloaded: AtomicUsize,
    /// Per notification: times executed.
    executed: Mutex<HashMap<String, usize>>,
    /// When a notification was last executed for the first time.
    last_new: Mutex<Option<Instant>>,
}

struct Leave(Arc<Fragile>);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Fragile {
    async fn call(self: Arc<Self>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let _leave = Leave(self.clone());
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
        let mut executed = self.executed.lock().unwrap();
        let n = executed.entry(id).or_default();
        *n += 1;
        if *n == 1 {
            *self.last_new.lock().unwrap() = Some(Instant::now());
        }
        drop(executed);
        Response::new(Full::new(Bytes::from_static(b"ok\n")))
    }
}

/// What one mode measured.
struct Outcome {
    label: String,
    acked: usize,
    all_acked_after: Option<Duration>,
    /// Until every copy (not only one per notification) was acknowledged.
    copies_acked_after: Option<Duration>,
    /// Until each notification was executed upstream.
    delivered_after: Option<Duration>,
    peak: usize,
    overloaded: usize,
    executed: usize,
    doubles: usize,
    requests: usize,
}

/// Runs the scenario with no limit, then with `--limit`, and prints both.
pub(crate) async fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "outage backlog: {} notifications x {} copies at once; the upstream serves 50 ms calls and falls over above {BEARS} at once",
        args.transactions, args.duplicates
    );
    let none = once(args, "no limit (cap 1024)", Mode::Shed(1024)).await?;
    let shed = match args.limit_auto {
        true => once(args, "shed, limit auto", Mode::Auto).await?,
        false => {
            let label = format!("shed, limit {}", args.limit);
            once(args, &label, Mode::Shed(args.limit)).await?
        }
    };
    let label = format!("ack, deliver_conc. {}", args.limit);
    let ack = once(args, &label, Mode::Ack(args.limit)).await?;
    let mut rows = vec![none, shed, ack];
    if let StoreArg::Redis(_) = &args.store {
        let n = args.instances;
        let label = format!("ack x{n}, Redis, conc. {}", args.limit);
        rows.push(once(args, &label, Mode::SharedAck(args.limit, n)).await?);
    }
    println!(
        "\n{:<22} {:>14} {:>14} {:>14} {:>10} {:>12} {:>10} {:>9} {:>10}",
        "mode",
        "all acked (s)",
        "copies (s)",
        "delivered (s)",
        "acked",
        "peak upstr.",
        "overload",
        "doubles",
        "requests"
    );
    let secs = |d: Option<Duration>| {
        d.map_or_else(
            || format!(">{}", GIVE_UP.as_secs()),
            |d| format!("{:.1}", d.as_secs_f64()),
        )
    };
    for o in &rows {
        println!(
            "{:<22} {:>14} {:>14} {:>14} {:>10} {:>12} {:>10} {:>9} {:>10}",
            o.label,
            secs(o.all_acked_after),
            secs(o.copies_acked_after),
            secs(o.delivered_after),
            format!("{}/{}", o.acked, args.transactions),
            o.peak,
            o.overloaded,
            o.doubles,
            o.requests
        );
        debug_assert!(o.executed <= args.transactions);
    }
    if args.json {
        let json = |d: Option<Duration>| {
            d.map_or("null".to_owned(), |d| format!("{:.2}", d.as_secs_f64()))
        };
        for o in &rows {
            println!(
                "{{\"mode\":\"{}\",\"acked\":{},\"all_acked_s\":{},\"copies_acked_s\":{},\"delivered_s\":{},\"peak\":{},\"overloaded\":{},\"executed\":{},\"doubles\":{},\"requests\":{}}}",
                o.label,
                o.acked,
                json(o.all_acked_after),
                json(o.copies_acked_after),
                json(o.delivered_after),
                o.peak,
                o.overloaded,
                o.executed,
                o.doubles,
                o.requests
            );
        }
    }
    Ok(())
}

/// How the gateway meets the backlog.
#[derive(Clone, Copy)]
enum Mode {
    /// Synchronous, with this cap on the upstream calls (1024: today's default).
    Shed(usize),
    /// Synchronous, the route's adaptive limit from a start (5) far under
    /// what the upstream bears; the upstream's own cap far above it.
    Auto,
    /// Acknowledge from the queue, deliver this many at once.
    Ack(usize),
    /// This many gateways on one Redis Streams queue (`--store`'s Redis,
    /// their records there too), each delivering this many at once: the
    /// limit is shared.
    SharedAck(usize, usize),
}

/// What stops a mode's workers and cleans up after it.
#[derive(Default)]
struct Stop {
    workers: Vec<tokio::sync::oneshot::Sender<()>>,
    file: Option<std::path::PathBuf>,
}

/// A worker for `queue` as the gateway's ack-then-deliver route runs it
/// (the gateway's defaults beside the limit: breaker 10 / 30 s).
fn worker<Q: tower_idempotency_queue::Queue, S>(
    queue: Q,
    gateway: &Gateway<S>,
    limit: usize,
) -> Worker<Q, Deliver<S>>
where
    S: tower_idempotency::store::Store + Clone + Send + Sync + 'static,
{
    Worker::new(queue, gateway.deliverer())
        .batch(limit + 16)
        .concurrency(limit)
        .breaker(10, Duration::from_secs(30))
}

/// Runs `worker` until the run stops.
fn spawn_worker<Q: tower_idempotency_queue::Queue, S>(
    worker: Worker<Q, Deliver<S>>,
    stop: &mut Stop,
) where
    S: tower_idempotency::store::Store + Clone + Send + Sync + 'static,
{
    let (tx, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    stop.workers.push(tx);
}

/// A tag unique to this run (the records of an earlier run in the same
/// Redis must not answer for this one's notifications).
fn run_tag() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{}-{t}", std::process::id())
}

/// One mode: a fresh upstream and gateway, the backlog released at once.
async fn once(args: &Args, label: &str, mode: Mode) -> Result<Outcome, Box<dyn std::error::Error>> {
    let fragile = Arc::new(Fragile::default());
    let f = fragile.clone();
    let upstream = serve(tower::service_fn(move |req| {
        let f = f.clone();
        async move { Ok::<_, Infallible>(f.call(req).await) }
    }))
    .await?;
    let calls = match mode {
        Mode::Shed(limit) => CallLimit::new(limit),
        Mode::Auto | Mode::Ack(_) | Mode::SharedAck(..) => CallLimit::new(1024),
    };
    let forward = Forward::builder(format!("http://{upstream}").parse()?)
        .call_limit(calls)
        .build();
    let wechat = Target::Preset(Preset::wechatpay_v3());
    let slots = matches!(mode, Mode::Auto).then(|| Slots::adaptive(AimdLimit::new().initial(5)));
    let mut stop = Stop::default();
    let tag = run_tag();
    let mut addrs = Vec::new();
    match mode {
        Mode::Auto => {
            let gateway = Gateway::builder(forward, MemoryStore::new())
                .route_with(
                    PATH,
                    wechat,
                    RouteOptions::new().shared_in_flight(slots.clone().expect("auto has slots")),
                )
                .build()?;
            addrs.push(serve(gateway).await?);
        }
        Mode::Shed(_) => {
            let gateway = Gateway::builder(forward, MemoryStore::new())
                .route(PATH, wechat)
                .build()?;
            addrs.push(serve(gateway).await?);
        }
        Mode::Ack(limit) => {
            // The embedded queue in a file of its own, as the gateway runs it.
            let file = std::env::temp_dir().join(format!("retry-storm-outage-{tag}.redb"));
            let _ = std::fs::remove_file(&file);
            let queue = RedbQueue::open(&file)?;
            let gateway = Gateway::builder(forward, MemoryStore::new())
                .route_with(PATH, wechat, RouteOptions::new().ack_then_deliver(true))
                .queue(queue.clone())
                .build()?;
            spawn_worker(worker(queue, &gateway, limit), &mut stop);
            stop.file = Some(file);
            addrs.push(serve(gateway).await?);
        }
        Mode::SharedAck(limit, instances) => {
            let StoreArg::Redis(url) = &args.store else {
                return Err("the shared row needs --store redis://HOST:PORT".into());
            };
            // Each instance with its own connections and its own consumer
            // of the one queue, as separate processes would be.
            let name = format!("retry-storm-outage-{tag}");
            for _ in 0..instances {
                let queue = RedisStreamsQueue::standalone(url.as_str(), &name).await?;
                let store = RedisStore::standalone(url.as_str()).await?;
                let gateway = Gateway::builder(forward.clone(), store)
                    .route_with(
                        PATH,
                        wechat.clone(),
                        RouteOptions::new().ack_then_deliver(true),
                    )
                    .queue(queue.clone())
                    .build()?;
                // The instances pace together, as gateways on one queue do.
                let paced = worker(queue, &gateway, limit).shared_pacing();
                spawn_worker(paced, &mut stop);
                addrs.push(serve(gateway).await?);
            }
        }
    }
    // An adaptive limit's value every 250 ms, until every copy is done.
    let line = Arc::new(Mutex::new(Vec::new()));
    let timeline = slots.map(|slots| {
        let line = line.clone();
        tokio::spawn(async move {
            loop {
                line.lock().unwrap().push(slots.max().to_string());
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}{PATH}")).collect();
    let requests = Arc::new(AtomicUsize::new(0));
    let copies = args.transactions * args.duplicates;
    let barrier = Arc::new(tokio::sync::Barrier::new(copies));
    eprintln!("{label}: releasing {copies} copies");
    let started = Instant::now();
    // The answers other than the success reply, by status and body.
    let refused = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let mut tasks = Vec::with_capacity(copies);
    for n in 0..args.transactions {
        let body = format!(
            r#"{{"id":"EV-OUTAGE-{tag}-{n}","create_time":"2026-12-01T10:00:00+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功"}}"#
        );
        for copy in 0..args.duplicates {
            // The copies of a notification spread over the instances, as a
            // load balancer spreads them.
            let url = &urls[(n + copy) % urls.len()];
            let (client, url, body, barrier, requests) = (
                client.clone(),
                url.clone(),
                body.clone(),
                barrier.clone(),
                requests.clone(),
            );
            let refused = refused.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                while started.elapsed() < GIVE_UP {
                    requests.fetch_add(1, Ordering::Relaxed);
                    let req = Request::post(url.as_str())
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body.clone())))
                        .expect("a valid request");
                    let sent =
                        tokio::time::timeout(Duration::from_secs(5), client.request(req)).await;
                    let answer = match sent {
                        Ok(Ok(res)) => {
                            let status = res.status();
                            let text = res.into_body().collect().await.map(|b| b.to_bytes());
                            match text {
                                Ok(t) if status == StatusCode::OK && t == SUCCESS.as_bytes() => {
                                    return Some(started.elapsed());
                                }
                                Ok(t) => format!(
                                    "{} {}",
                                    status.as_u16(),
                                    String::from_utf8_lossy(&t[..t.len().min(60)]).trim()
                                ),
                                Err(_) => format!("{} (body cut)", status.as_u16()),
                            }
                        }
                        Ok(Err(_)) => "no answer (connection failed)".to_owned(),
                        Err(_) => "no answer within 5 s".to_owned(),
                    };
                    *refused.lock().unwrap().entry(answer).or_insert(0) += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                None
            }));
        }
    }
    let mut first_ack: Vec<Option<Duration>> = vec![None; args.transactions];
    let answers = |refused: &Mutex<HashMap<String, usize>>| {
        let refused = refused.lock().unwrap();
        let mut all: Vec<_> = refused
            .iter()
            .map(|(a, n)| format!("{n} x {a:?}"))
            .collect();
        all.sort();
        all.join(", ")
    };
    let (mut copies_acked, mut last_copy) = (0, Duration::ZERO);
    for (i, t) in tasks.into_iter().enumerate() {
        if let Some(at) = t.await? {
            let slot = &mut first_ack[i / args.duplicates];
            *slot = Some(slot.map_or(at, |s| s.min(at)));
            copies_acked += 1;
            last_copy = last_copy.max(at);
        }
    }
    if !refused.lock().unwrap().is_empty() {
        println!("{label}: answers other than success: {}", answers(&refused));
    }
    if let Some(t) = timeline {
        t.abort();
        println!(
            "{label}: the limit every 250 ms: {}",
            line.lock().unwrap().join(" ")
        );
    }
    // Acknowledged first: wait for the queue's deliveries.
    while fragile.executed.lock().unwrap().len() < args.transactions && started.elapsed() < GIVE_UP
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delivered_after = match fragile.executed.lock().unwrap().len() == args.transactions {
        true => fragile.last_new.lock().unwrap().map(|at| at - started),
        false => None,
    };
    for worker in stop.workers {
        let _ = worker.send(());
    }
    if let Some(file) = stop.file {
        let _ = std::fs::remove_file(file);
    }
    let acked = first_ack.iter().filter(|a| a.is_some()).count();
    let all_acked_after = match acked == args.transactions {
        true => first_ack.iter().flatten().max().copied(),
        false => None,
    };
    let executed = fragile.executed.lock().unwrap();
    Ok(Outcome {
        label: label.to_owned(),
        acked,
        all_acked_after,
        copies_acked_after: (copies_acked == copies).then_some(last_copy),
        delivered_after,
        peak: fragile.peak.load(Ordering::SeqCst),
        overloaded: fragile.overloaded.load(Ordering::SeqCst),
        executed: executed.len(),
        doubles: executed.values().filter(|n| **n > 1).count(),
        requests: requests.load(Ordering::Relaxed),
    })
}
