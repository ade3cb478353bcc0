//! Several gateway instances sharing one Redis (once, no false
//! acknowledgement, a store outage answered as decided): three
//! independent WeChat Pay v3 stacks, each behind its own loopback hyper
//! server, take a retry storm together.

use common::faults::{FaultStore, Faults, Op};
use test_support::common;
use test_support::support_redis;

use bytes::Bytes;
use common::{client, post, serve, Answer, HttpClient};
use http::{Request, Response};
use http_body_util::Full;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support_redis::{redis_available, shared_cluster, RedisServer};
use tower::{service_fn, ServiceBuilder};
use tower_idempotency::store::{Claim, OwnerToken, Store, StoreError};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency_redis::RedisStore;

const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
const FAILURE: &str = r#"{"code":"FAIL","message":"失败"}"#;

/// Executions per notification id.
#[derive(Clone, Default)]
struct Executions(Arc<Mutex<HashMap<String, usize>>>);

impl Executions {
    fn get(&self, id: &str) -> usize {
        self.0.lock().unwrap().get(id).copied().unwrap_or(0)
    }
    fn total(&self) -> usize {
        self.0.lock().unwrap().values().sum()
    }
    fn max(&self) -> usize {
        self.0.lock().unwrap().values().copied().max().unwrap_or(0)
    }
}

fn notification(id: &str) -> String {
    format!(
        r#"{{"id":"{id}","create_time":"2015-05-20T13:29:35+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{{"original_type":"transaction","algorithm":"AEAD_AES_256_GCM","ciphertext":"","associated_data":"","nonce":""}}}}"#
    )
}

/// Delegates to a store and keeps the errors it returns, and the claims
/// the layer's store timeout cancelled, for diagnostics.
type Recording<St> = FaultStore<Recorder, St>;

#[derive(Clone, Default)]
struct Recorder {
    errors: Arc<Mutex<Vec<String>>>,
}

impl Faults for Recorder {
    fn answered(&self, op: Op, _key: &str, error: Option<&StoreError>) {
        if let Some(e) = error {
            let msg = format!("{op:?}: {e} ({:?})", e.kind());
            self.errors.lock().unwrap().push(msg);
        }
    }

    fn dropped(&self, op: Op, _key: &str, waited: Duration) {
        if op == Op::Claim {
            let msg = format!("claim cancelled after {waited:?}");
            self.errors.lock().unwrap().push(msg);
        }
    }
}

fn recording<St: Store>(inner: St) -> Recording<St> {
    FaultStore {
        inner,
        faults: Recorder::default(),
    }
}

/// One instance: the WeChat Pay v3 stack over `store` in front of a handler
/// that takes `work` and counts its executions per `/id`.
async fn instance<St: Store>(
    store: St,
    executions: Executions,
    work: Duration,
    configure: impl FnOnce(IdempotencyLayer<St>) -> IdempotencyLayer<St>,
) -> SocketAddr {
    let layer = configure(IdempotencyLayer::wechatpay_v3().with_store(store));
    let svc =
        ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(move |req: Request<Full<Bytes>>| {
                let executions = executions.clone();
                async move {
                    use http_body_util::BodyExt;
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let id = json["id"].as_str().unwrap().to_owned();
                    *executions.0.lock().unwrap().entry(id).or_default() += 1;
                    tokio::time::sleep(work).await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"credited"))))
                }
            }));
    serve(svc).await.0
}

/// Sends `copies` copies of each id at the same instant, spread round-robin
/// over `addrs`; returns every answer per id.
async fn storm(
    http: &HttpClient,
    addrs: &[SocketAddr],
    ids: &[String],
    copies: usize,
) -> HashMap<String, Vec<Answer>> {
    let mut tasks = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let barrier = Arc::new(tokio::sync::Barrier::new(copies));
        for c in 0..copies {
            let (http, barrier, id) = (http.clone(), barrier.clone(), id.clone());
            let addr = addrs[(n + c) % addrs.len()];
            tasks.push(tokio::spawn(async move {
                let body = notification(&id);
                barrier.wait().await;
                let answer = post(
                    &http,
                    addr,
                    "/notify/wechat",
                    &[("content-type", "application/json")],
                    body,
                )
                .await;
                (id, answer)
            }));
        }
    }
    let mut out: HashMap<String, Vec<Answer>> = HashMap::new();
    for t in tasks {
        let (id, answer) = t.await.unwrap();
        out.entry(id).or_default().push(answer);
    }
    out
}

fn is_success(a: &Answer) -> bool {
    a.status == 200 && a.body == SUCCESS.as_bytes()
}

fn is_retryable_failure(a: &Answer) -> bool {
    a.status == 500 && a.body == FAILURE.as_bytes()
}

fn ids(tag: &str, n: usize) -> Vec<String> {
    let run = tower_idempotency::store::OwnerToken::new().as_u128();
    (0..n).map(|i| format!("EV-{tag}-{run:x}-{i:04}")).collect()
}

async fn storm_over_three_instances<St: Store>(stores: [St; 3], transactions: usize) {
    const COPIES: usize = 7;
    let executions = Executions::default();
    let mut addrs = Vec::new();
    let mut recorders = Vec::new();
    for store in stores {
        let store = recording(store);
        recorders.push(store.clone());
        // Everything else at its default, but a debug build on a busy CI box
        // can stall a store call past the default one second; this test is
        // about once-only execution, not latency.
        let addr = instance(store, executions.clone(), Duration::from_millis(50), |l| {
            l.store_timeout(Duration::from_secs(3))
        })
        .await;
        addrs.push(addr);
    }
    let http = client();
    let ids = ids("storm", transactions);
    let start = Instant::now();
    // Waves of 50 transactions (350 requests at once): 2100 connections at
    // the same instant would overflow the listeners' accept backlog and
    // measure SYN retransmits, not the store.
    let mut answers = HashMap::new();
    for wave in ids.chunks(50) {
        answers.extend(storm(&http, &addrs, wave, COPIES).await);
    }
    eprintln!(
        "{} requests over 3 instances in {:?}",
        transactions * COPIES,
        start.elapsed()
    );
    for id in &ids {
        assert_eq!(
            executions.get(id),
            1,
            "{id} ran {} times",
            executions.get(id)
        );
        let got = &answers[id];
        assert_eq!(got.len(), COPIES);
        for a in got {
            assert!(
                is_success(a),
                "{id}: {} {}; store errors: {:?}",
                a.status,
                a.text(),
                recorders
                    .iter()
                    .flat_map(|r| r.errors.lock().unwrap().clone())
                    .take(10)
                    .collect::<Vec<_>>()
            );
        }
        // One copy executed, the others were replayed (after waiting).
        assert_eq!(got.iter().filter(|a| !a.replayed()).count(), 1, "{id}");
    }
    assert_eq!(executions.total(), transactions);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_one_standalone_redis_run_each_transaction_once() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..3 {
        // Independent connections, as three processes would have.
        stores.push(RedisStore::standalone(server.url()).await.unwrap());
    }
    let stores: [RedisStore; 3] = stores.try_into().unwrap();
    storm_over_three_instances(stores, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_one_redis_cluster_run_each_transaction_once() {
    let Some(cluster) = shared_cluster() else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(RedisStore::cluster(cluster.urls()).await.unwrap());
    }
    let stores: [_; 3] = stores.try_into().unwrap();
    storm_over_three_instances(stores, 300).await;
}

/// Redis stops in the middle of a storm and comes back on the same port:
/// copies that meet the outage get the retryable failure reply (FailClosed),
/// nothing runs twice, and the same stacks recover without a restart.
///
/// The server is stopped with `SHUTDOWN SAVE` and restarted on its data set,
/// as a Redis with persistence would be: without persistence a restart
/// forgets every record, and retries of completed keys run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_mid_storm_fails_closed_and_recovers() {
    const COPIES: usize = 7;
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start();
    let executions = Executions::default();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::standalone(server.url()).await.unwrap();
        // The owner whose completion met the outage keeps retrying it for
        // one lease; a claim orphaned by the outage frees after one lease.
        let addr = instance(store, executions.clone(), Duration::from_millis(300), |l| {
            l.lease(Duration::from_secs(10))
        })
        .await;
        addrs.push(addr);
    }
    let http = client();

    // Before the outage.
    let before = ids("before", 50);
    let answers = storm(&http, &addrs, &before, COPIES).await;
    assert!(answers.values().flatten().all(is_success));

    // During: Redis stops 150 ms into the storm, while handlers run.
    let during = ids("during", 100);
    let storm_task = {
        let (http, addrs, during) = (http.clone(), addrs.clone(), during.clone());
        tokio::spawn(async move { storm(&http, &addrs, &during, COPIES).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let stopped_at = Instant::now();
    tokio::task::block_in_place(|| server.stop());

    // While Redis is down every new copy fails closed and runs nothing.
    let probe = ids("down", 10);
    let down = storm(&http, &addrs, &probe, 3).await;
    for a in down.values().flatten() {
        assert!(is_retryable_failure(a), "{} {}", a.status, a.text());
    }
    for id in &probe {
        assert_eq!(executions.get(id), 0, "{id} ran while the store was down");
    }

    // Back on the same port.
    tokio::task::block_in_place(|| server.restart());
    eprintln!("redis was down for {:?}", stopped_at.elapsed());

    let answers = storm_task.await.unwrap();
    let mut failures = 0;
    for a in answers.values().flatten() {
        assert!(
            is_success(a) || is_retryable_failure(a),
            "{} {}",
            a.status,
            a.text()
        );
        failures += usize::from(is_retryable_failure(a));
    }
    eprintln!("{failures} copies got the failure reply during the outage");

    // The channel retries everything until it gets its success reply.
    let mut pending: Vec<String> = before.iter().chain(&during).cloned().collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut rounds = 0;
    while !pending.is_empty() {
        assert!(
            Instant::now() < deadline,
            "{} never succeeded",
            pending.len()
        );
        rounds += 1;
        let answers = storm(&http, &addrs, &pending, COPIES).await;
        pending.retain(|id| !answers[id].iter().all(is_success));
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    eprintln!("recovered after {rounds} retry round(s)");
    for id in before.iter().chain(&during) {
        assert_eq!(
            executions.get(id),
            1,
            "{id} ran {} times",
            executions.get(id)
        );
    }
    assert_eq!(executions.max(), 1);
}

/// `calls=` of one command in `INFO commandstats`.
fn calls(port: u16, command: &str) -> u64 {
    let info = support_redis::raw_command(port, "INFO commandstats").unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// A claim that finds a key in flight starts this instance's poller of
/// that key (one `GETRANGE` every poll interval); one made with
/// `claim_unwatched` (shared pacing, whose callers never wait on the key)
/// starts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_nobody_waits_on_starts_no_poller() {
    use tower_idempotency::Fingerprint;
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let port = server.port();
    let owner = RedisStore::standalone(server.url()).await.unwrap();
    let other = RedisStore::standalone(server.url())
        .await
        .unwrap()
        .poll_interval(Duration::from_millis(10));
    let fp = Fingerprint::of(b"slot");
    let lease = Duration::from_secs(30);
    for key in ["unwatched", "watched"] {
        let got = owner.claim(key, fp, OwnerToken::new(), lease).await;
        assert!(matches!(got, Ok(Claim::Acquired(_))), "{got:?}");
    }
    let reset = support_redis::raw_command(port, "CONFIG RESETSTAT").unwrap();
    assert!(reset.starts_with("+OK"), "{reset}");
    for _ in 0..3 {
        let got = other
            .claim_unwatched("unwatched", fp, OwnerToken::new(), lease)
            .await;
        assert!(matches!(got, Ok(Claim::InFlight { .. })), "{got:?}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        calls(port, "getrange"),
        0,
        "claims nobody waits on started a poller"
    );
    // The same with a plain claim: its poller looks at the key.
    let got = other.claim("watched", fp, OwnerToken::new(), lease).await;
    assert!(matches!(got, Ok(Claim::InFlight { .. })), "{got:?}");
    let start = Instant::now();
    while calls(port, "getrange") == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "a waited-on claim's poller never looked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The costs the Redis store documents, counted by the server itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commands_per_request_are_as_documented() {
    use tower::ServiceExt;
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let port = server.port();
    let store = RedisStore::standalone(server.url()).await.unwrap();
    let executions = Executions::default();
    let layer = IdempotencyLayer::wechatpay_v3().with_store(store);
    // Another instance, with a local tier of its own.
    let other = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::wechatpay_v3()
                .with_store(RedisStore::standalone(server.url()).await.unwrap()),
        )
        .service(service_fn(|_req: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
    let svc =
        ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(move |req: Request<Full<Bytes>>| {
                let executions = executions.clone();
                async move {
                    use http_body_util::BodyExt;
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let id = json["id"].as_str().unwrap().to_owned();
                    *executions.0.lock().unwrap().entry(id).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }
            }));
    let send = |id: String| {
        let svc = svc.clone();
        async move {
            let req = common::request(
                "/notify/wechat",
                &[("content-type", "application/json")],
                notification(&id),
            );
            common::read(svc.oneshot(req).await.unwrap()).await
        }
    };
    // Load the scripts, then count from zero.
    assert!(is_success(&send("warm-up".into()).await));
    let reset = support_redis::raw_command(port, "CONFIG RESETSTAT").unwrap();
    assert!(reset.starts_with("+OK"), "{reset}");

    // First copy: claim + complete.
    assert!(is_success(&send("EV-1".into()).await));
    assert_eq!(calls(port, "evalsha"), 2);
    // A repeat on the instance that completed it: its local tier answers.
    let again = send("EV-1".into()).await;
    assert!(is_success(&again) && again.replayed());
    assert_eq!(calls(port, "evalsha"), 2);
    // A repeat on another instance: one claim that returns the record...
    let on_other = |id: &str| {
        let req = common::request(
            "/notify/wechat",
            &[("content-type", "application/json")],
            notification(id),
        );
        let other = other.clone();
        async move { common::read(other.oneshot(req).await.unwrap()).await }
    };
    let replay = on_other("EV-1").await;
    assert!(is_success(&replay) && replay.replayed());
    assert_eq!(calls(port, "evalsha"), 3);
    // ...and none after that: it is in that instance's local tier now.
    let replay = on_other("EV-1").await;
    assert!(is_success(&replay) && replay.replayed());
    assert_eq!(calls(port, "evalsha"), 3);

    // One copy runs for 300 ms while 9 duplicates wait on this instance.
    let _ = support_redis::raw_command(port, "CONFIG RESETSTAT").unwrap();
    let answers = common::all_at_once(10, |_| send("EV-2".into())).await;
    assert!(answers.iter().all(is_success));
    let evalsha = calls(port, "evalsha");
    let getrange = calls(port, "getrange");
    eprintln!("10 simultaneous copies: {evalsha} EVALSHA, {getrange} GETRANGE");
    // 10 claims, 1 complete, at most one more claim per waiter once woken.
    assert!((11..=20).contains(&evalsha), "{evalsha} EVALSHA");
    // One shared poller (300 ms / 25 ms), not one per waiter (9 × 12).
    assert!((1..=24).contains(&getrange), "{getrange} GETRANGE");
}

/// Three instances whose handler fails (500, before any side effect) on
/// about one call in five: the channel retries every copy until it gets its
/// success reply, and every transaction succeeds exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_percent_failures_every_transaction_succeeds_exactly_once() {
    use tower::ServiceBuilder;
    const TRANSACTIONS: usize = 300;
    const COPIES: usize = 7;
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let succeeded = Executions::default();
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let (succeeded, calls) = (succeeded.clone(), calls.clone());
        let svc = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::wechatpay_v3()
                    .with_store(store)
                    .store_timeout(Duration::from_secs(3)),
            )
            .service(service_fn(move |req: Request<Full<Bytes>>| {
                let (succeeded, calls) = (succeeded.clone(), calls.clone());
                async move {
                    use http_body_util::BodyExt;
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let id = json["id"].as_str().unwrap().to_owned();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    // A fixed pattern: every fifth call fails.
                    let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let mut res = Response::new(Full::new(Bytes::from_static(b"done")));
                    if n % 5 == 4 {
                        *res.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                    } else {
                        *succeeded.0.lock().unwrap().entry(id).or_default() += 1;
                    }
                    Ok::<_, Infallible>(res)
                }
            }));
        addrs.push(serve(svc).await.0);
    }
    let http = client();
    let mut pending = ids("fail20", TRANSACTIONS);
    let all = pending.clone();
    let mut rounds = 0;
    while !pending.is_empty() {
        rounds += 1;
        assert!(
            rounds <= 15,
            "{} transactions never acknowledged",
            pending.len()
        );
        let mut answers = HashMap::new();
        for wave in pending.chunks(50) {
            answers.extend(storm(&http, &addrs, wave, COPIES).await);
        }
        for a in answers.values().flatten() {
            assert!(
                is_success(a) || is_retryable_failure(a),
                "{} {}",
                a.status,
                a.text()
            );
        }
        // The channel stops retrying a notification once a copy succeeded.
        pending.retain(|id| !answers[id].iter().any(is_success));
    }
    let failed = calls.load(std::sync::atomic::Ordering::SeqCst) as usize - succeeded.total();
    eprintln!("{failed} failed handler calls, {rounds} rounds");
    assert!(failed > 0, "the handler never failed");
    for id in &all {
        assert_eq!(
            succeeded.get(id),
            1,
            "{id} succeeded {} times",
            succeeded.get(id)
        );
    }
}

/// The instance holding a claim dies mid-handler (its claim stays in Redis,
/// nobody releases it): a copy on another instance waits, takes over when
/// the lease runs out, and runs the handler once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_owners_claim_runs_out_and_another_instance_runs_it_once() {
    use tower_idempotency::key::ExtractKey;
    use tower_idempotency::{IdempotencyKey, Preset};
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let executions = Executions::default();
    let store = RedisStore::standalone(server.url()).await.unwrap();
    let addr = instance(store, executions.clone(), Duration::from_millis(10), |l| l).await;

    // What the dead instance left: its claim on the key the layer uses, with
    // a 600 ms lease that nobody renews.
    let id = ids("dead", 1).remove(0);
    let body = notification(&id);
    let (parts, _) = Request::post("/notify/wechat")
        .body(())
        .unwrap()
        .into_parts();
    let found = Preset::wechatpay_v3()
        .extractor()
        .extract(&parts, &Bytes::from(body.clone()))
        .unwrap()
        .unwrap();
    let key = IdempotencyKey::new(
        "idem",
        Arc::from("wechatpay-v3"),
        "/notify/wechat",
        None,
        &found.key,
        found.fingerprint,
    );
    let dead = RedisStore::standalone(server.url())
        .await
        .unwrap()
        .local_max_bytes(0);
    let claim = dead
        .claim(
            key.as_str(),
            found.fingerprint,
            OwnerToken::new(),
            Duration::from_millis(600),
        )
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(_)));
    drop(dead);

    let started = Instant::now();
    let a = post(
        &client(),
        addr,
        "/notify/wechat",
        &[("content-type", "application/json")],
        body,
    )
    .await;
    assert!(is_success(&a), "{} {}", a.status, a.text());
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "did not wait for the lease"
    );
    assert_eq!(executions.get(&id), 1);
}

/// A handler that runs 3× the lease: renewal keeps the claim, copies on the
/// other instances wait and replay, nobody else runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_three_times_the_lease_runs_once_across_instances() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let executions = Executions::default();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let addr = instance(store, executions.clone(), Duration::from_millis(900), |l| {
            l.lease(Duration::from_millis(300))
                .wait(Duration::from_secs(3))
        })
        .await;
        addrs.push(addr);
    }
    let http = client();
    let id = ids("slow", 1);
    let first = {
        let (http, addrs, id) = (http.clone(), addrs.clone(), id.clone());
        tokio::spawn(async move { storm(&http, &addrs[..1], &id, 1).await })
    };
    // Copies arrive on the other instances after one and two leases.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let second = storm(&http, &addrs[1..], &id, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let third = storm(&http, &addrs[1..], &id, 2).await;
    let first = first.await.unwrap();
    for a in first
        .values()
        .chain(second.values())
        .chain(third.values())
        .flatten()
    {
        assert!(is_success(a), "{} {}", a.status, a.text());
    }
    assert_eq!(executions.get(&id[0]), 1);
}
