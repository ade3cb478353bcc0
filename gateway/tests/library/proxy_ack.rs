//! The library's acknowledge-then-deliver routes in process: the success
//! reply only for a queued (or already queued) notification, the failure
//! reply for a queue error or a fingerprint mismatch, and delivery through
//! the dedup layer (an entry handed out twice reaches the upstream once,
//! even while its first delivery hangs past its lease); a delivery's span
//! links to its ingest's, and the upstream gets the delivery's trace; a
//! gateway built without response extensions still tells its deliveries
//! what the upstream answered.

use test_support::common;

use bytes::Bytes;
use common::upstream::Upstream;
use common::vectors::{check, Expect, WECHATPAY_V3};
use common::{read, request, serve, Counter};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idempotency_gateway::proxy::{
    Forward, Gateway, MatchedRoute, RouteError, RouteOptions, RoutedPreset, Target, UpstreamAnswer,
};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{IdempotencyKey, Outcome, Preset};
use tower_idempotency_queue::{
    DeadLetter, Delivery, EntryId, Ingested, MemoryQueue, Message, Queue, QueueError,
    QueueErrorKind, QueueStats, RedbQueue, Worker,
};

/// WeChat Pay's success reply.
const SUCCESS: Expect = match WECHATPAY_V3.success {
    Some(reply) => reply,
    None => panic!("WeChat Pay has a fixed success reply"),
};

fn wechat(id: &str, event: &str) -> String {
    format!(
        r#"{{"id":"{id}","event_type":"{event}","resource":{{"original_type":"transaction"}}}}"#
    )
}

/// The recording upstream and a [`Forward`] to it.
async fn upstream() -> (Forward, Upstream) {
    let up = Upstream::start().await;
    (Forward::new(up.url().parse().unwrap()), up)
}

fn acked() -> RouteOptions {
    RouteOptions::new().ack_then_deliver(true)
}

/// A queue whose every call fails.
#[derive(Clone)]
struct Broken;

impl Queue for Broken {
    async fn ingest(&self, _m: Message) -> Result<Ingested, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn fetch(&self, _n: usize, _l: Duration) -> Result<Vec<Delivery>, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn renew(&self, _d: &Delivery, _l: Duration) -> Result<bool, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn ack(&self, _d: &Delivery) -> Result<bool, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn retry(&self, _d: &Delivery, _a: Duration, _e: &str) -> Result<bool, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn dead_letter(&self, _d: &Delivery, _e: &str) -> Result<bool, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn dead_letters(&self, _n: usize) -> Result<Vec<DeadLetter>, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn replay(&self, _id: &EntryId) -> Result<bool, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn replay_all(&self) -> Result<usize, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
    async fn stats(&self) -> Result<QueueStats, QueueError> {
        Err(QueueError::new(QueueErrorKind::Other, "disk full"))
    }
}

#[tokio::test]
async fn without_response_extensions_answers_keep_outcome_and_preset_and_deliveries_the_upstream_answer(
) {
    let (forward, up) = upstream().await;
    let queue = MemoryQueue::new();
    let build = |extensions: bool| {
        Gateway::builder(forward.clone(), MemoryStore::new())
            .queue(queue.clone())
            .route("/sync", Target::Preset(Preset::wechatpay_v3()))
            .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
            .response_extensions(extensions)
            .build()
            .unwrap()
    };
    let body = wechat("EV-X", "TRANSACTION.SUCCESS");
    let sync = || {
        request(
            "/sync/notify",
            &[("content-type", "application/json")],
            body.clone(),
        )
    };
    // By default a guarded answer, first or replayed, carries them all.
    let full = build(true);
    for copy in ["first", "replay"] {
        let res = full.clone().oneshot(sync()).await.unwrap();
        let ext = res.extensions();
        assert!(ext.get::<Outcome>().is_some(), "{copy}");
        assert!(ext.get::<RoutedPreset>().is_some(), "{copy}");
        assert_eq!(
            ext.get::<MatchedRoute>().map(|r| &*r.0),
            Some("/sync"),
            "{copy}"
        );
        assert!(ext.get::<IdempotencyKey>().is_some(), "{copy}");
        assert_eq!(ext.get::<UpstreamAnswer>().is_some(), copy == "first");
        check(&read(res).await, SUCCESS, copy);
    }
    // Without: the outcome and the preset only, and the same answers.
    let lean = build(false);
    for copy in ["first", "replay"] {
        let res = lean.clone().oneshot(sync()).await.unwrap();
        let ext = res.extensions();
        let expected = if copy == "first" {
            Outcome::Executed
        } else {
            Outcome::Replayed
        };
        assert_eq!(ext.get::<Outcome>(), Some(&expected), "{copy}");
        assert_eq!(
            ext.get::<RoutedPreset>().map(|p| &*p.0),
            Some(Preset::wechatpay_v3().name()),
            "{copy}"
        );
        assert!(ext.get::<MatchedRoute>().is_none(), "{copy}");
        assert!(ext.get::<IdempotencyKey>().is_none(), "{copy}");
        assert!(ext.get::<UpstreamAnswer>().is_none(), "{copy}");
        check(&read(res).await, SUCCESS, copy);
    }
    assert_eq!(up.total(), 2, "one call per gateway (each its own store)");
    // The acknowledge-then-deliver route's deliveries still hear the upstream.
    let req = request(
        "/wx/notify",
        &[("content-type", "application/json")],
        wechat("EV-Y", "TRANSACTION.SUCCESS"),
    );
    check(
        &read(lean.clone().oneshot(req).await.unwrap()).await,
        SUCCESS,
        "queued",
    );
    let message = queue.fetch(1, Duration::ZERO).await.unwrap()[0]
        .message
        .clone();
    let delivered = lean.deliver(message).await.unwrap();
    assert_eq!(delivered.upstream().map(|a| a.status.as_u16()), Some(200));
    assert_eq!(up.total(), 3);
}

#[tokio::test]
async fn queued_once_success_reply_then_delivered_once_through_dedup() {
    let (forward, up) = upstream().await;
    let queue = MemoryQueue::new();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    assert!(gateway.has_ack_routes());
    let body = wechat("EV-1", "TRANSACTION.SUCCESS");
    for _ in 0..7 {
        let req = request(
            "/wx/notify",
            &[("content-type", "application/json")],
            body.clone(),
        );
        let answer = read(gateway.clone().oneshot(req).await.unwrap()).await;
        check(&answer, SUCCESS, "a queued copy");
    }
    assert_eq!(queue.stats().await.unwrap().depth, 1);
    assert_eq!(up.total(), 0, "nothing is delivered before the worker runs");
    // The entry handed out twice (a redelivery after a crash): one upstream call.
    let message = queue.fetch(1, Duration::ZERO).await.unwrap()[0]
        .message
        .clone();
    assert_eq!(message.order.as_deref(), Some(message.key.as_str()));
    let first = gateway.deliver(message.clone()).await.unwrap();
    let again = gateway.deliver(message).await.unwrap();
    assert_eq!(up.total(), 1);
    // The first reached the upstream; the second is its answer, replayed.
    assert_eq!(first.upstream().map(|a| a.status.as_u16()), Some(200));
    assert_eq!((again.status().as_u16(), again.upstream()), (200, None));
    // And through a worker: the lease ran out, the entry is delivered again, no new call.
    let mut worker = Worker::new(queue.clone(), gateway.deliverer());
    assert_eq!(worker.run_once().await.unwrap().delivered, 1);
    assert_eq!(up.total(), 1);
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

#[tokio::test]
async fn a_delivery_links_to_its_ingest_and_sends_its_own_trace_upstream() {
    use common::otel::{attr, traceparent, Traces};
    use opentelemetry::trace::SpanId;
    let traces = Traces::start();
    let (forward, up) = upstream().await;
    let queue = MemoryQueue::new();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    // A client's traceparent is not what the queue keeps.
    let req = request(
        "/wx",
        &[
            ("content-type", "application/json"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        ],
        wechat("EV-T1", "TRANSACTION.SUCCESS"),
    );
    check(
        &read(gateway.clone().oneshot(req).await.unwrap()).await,
        SUCCESS,
        "queued",
    );
    let ingest = traces
        .named("idempotency")
        .pop()
        .expect("the ingest's span");
    assert_eq!(attr(&ingest, "outcome").as_deref(), Some("executed"));
    assert_eq!(ingest.parent_span_id, SpanId::INVALID);
    let queued = queue.fetch(1, Duration::ZERO).await.unwrap()[0]
        .message
        .clone();
    let (trace, parent) = traceparent(&queued.headers["traceparent"]);
    assert_eq!(
        (trace, parent),
        (
            ingest.span_context.trace_id(),
            ingest.span_context.span_id()
        ),
        "the ingest's context is stored with the notification"
    );

    // The lease of that fetch ran out: the worker delivers it.
    let mut worker = Worker::new(queue.clone(), gateway.deliverer());
    assert_eq!(worker.run_once().await.unwrap().delivered, 1);
    let deliver = traces.named("deliver").pop().expect("a deliver span");
    assert_eq!(deliver.parent_span_id, SpanId::INVALID, "a root of its own");
    assert_ne!(
        deliver.span_context.trace_id(),
        ingest.span_context.trace_id()
    );
    let links: Vec<_> = deliver
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    let ingested = (
        ingest.span_context.trace_id(),
        ingest.span_context.span_id(),
    );
    assert_eq!(links, [ingested], "linked to the ingest");
    assert_eq!(attr(&deliver, "route").as_deref(), Some("/wx"));
    assert_eq!(attr(&deliver, "attempt").as_deref(), Some("2"));
    assert_eq!(attr(&deliver, "key_hash"), attr(&ingest, "key_hash"));
    // Under it the route's stack: the dedup layer's claim and the upstream call.
    let delivered = traces.child(&deliver, "idempotency");
    traces.child(&delivered, "claim");
    let call = traces.child(&delivered, "upstream");
    let seen = up.last("/wx");
    assert_eq!(
        traceparent(&seen.headers["traceparent"]),
        (deliver.span_context.trace_id(), call.span_context.span_id()),
        "the upstream joins the delivery's trace"
    );
}

#[tokio::test]
async fn queue_error_and_mismatch_get_the_failure_reply_never_success() {
    let (forward, up) = upstream().await;
    let broken = Gateway::builder(forward.clone(), MemoryStore::new())
        .queue(Broken)
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    let req = request(
        "/wx",
        &[("content-type", "application/json")],
        wechat("EV-2", "TRANSACTION.SUCCESS"),
    );
    let answer = read(broken.oneshot(req).await.unwrap()).await;
    check(&answer, WECHATPAY_V3.failure, "a queue error");

    let queue = MemoryQueue::new();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    let first = request("/wx", &[], wechat("EV-3", "TRANSACTION.SUCCESS"));
    assert_eq!(
        read(gateway.clone().oneshot(first).await.unwrap())
            .await
            .status,
        200
    );
    // This route does not verify its sender: the first copy is not trusted
    // over the later ones, and up to 4 payloads of one key are queued (the
    // dedup layer runs the key once at delivery). The next one is refused.
    for event in ["REFUND.SUCCESS", "TRANSACTION.CLOSED", "REFUND.ABNORMAL"] {
        let other = request("/wx", &[], wechat("EV-3", event));
        let answer = read(gateway.clone().oneshot(other).await.unwrap()).await;
        assert_eq!(answer.status, 200, "{event} queued beside the first");
    }
    let forged = request("/wx", &[], wechat("EV-3", "REFUND.CLOSED"));
    let answer = read(gateway.clone().oneshot(forged).await.unwrap()).await;
    check(&answer, WECHATPAY_V3.failure, "a mismatch past the cap");
    // No key: refused before the queue.
    let keyless = request("/wx", &[], r#"{"event_type":"TRANSACTION.SUCCESS"}"#);
    assert_ne!(
        read(gateway.oneshot(keyless).await.unwrap()).await.status,
        200
    );
    assert_eq!(queue.stats().await.unwrap().depth, 4);
    assert_eq!(up.total(), 0);
}

#[test]
fn ack_route_needs_a_queue_and_a_channel_preset() {
    let forward = || Forward::new("http://127.0.0.1:1".parse().unwrap());
    let no_queue = Gateway::builder(forward(), MemoryStore::new())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build();
    assert!(matches!(no_queue, Err(RouteError::AckThenDeliver(_))));
    let auto = Gateway::builder(forward(), MemoryStore::new())
        .queue(MemoryQueue::new())
        .route_with("/", Target::Auto, acked())
        .build();
    assert!(matches!(auto, Err(RouteError::AckThenDeliver(_))));
    let client = Gateway::builder(forward(), MemoryStore::new())
        .queue(MemoryQueue::new())
        .route_with("/api", Target::Preset(Preset::idempotency_key()), acked())
        .build();
    assert!(matches!(client, Err(RouteError::AckThenDeliver(_))));
}

/// An upstream that holds every call while `hang` is set; counts the calls
/// in flight (and their maximum) and the answered ones.
#[derive(Clone, Default)]
struct Hung {
    hang: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
    most_in_flight: Arc<AtomicUsize>,
    answered: Counter,
}

impl Hung {
    async fn start(self) -> Forward {
        let state = self.clone();
        let svc = tower::service_fn(move |req: Request<hyper::body::Incoming>| {
            let state = state.clone();
            async move {
                let _ = req.into_body().collect().await;
                let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                state.most_in_flight.fetch_max(now, Ordering::SeqCst);
                while state.hang.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                state.in_flight.fetch_sub(1, Ordering::SeqCst);
                state.answered.bump();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"credited"))))
            }
        });
        let (addr, _task) = serve(svc).await;
        Forward::new(format!("http://{addr}").parse().unwrap())
    }
}

async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh directory for a redb queue.
fn queue_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-proxy-ack-{:032x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delivery_outliving_its_lease_is_renewed_not_handed_out_again() {
    let up = Hung::default();
    up.hang.store(true, Ordering::SeqCst);
    let forward = up.clone().start().await;
    let dir = queue_dir();
    let queue = RedbQueue::open(dir.join("queue.redb")).unwrap();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    let req = request("/wx", &[], wechat("EV-hung", "TRANSACTION.SUCCESS"));
    let answer = read(gateway.clone().oneshot(req).await.unwrap()).await;
    check(&answer, SUCCESS, "the acknowledgement");
    // Two workers with a lease far shorter than the hang: the running
    // delivery renews it, so the entry is not handed out again (each
    // handout would count an attempt: three, and it would be dead-lettered
    // as "handed out 4 times without settling" once it finally succeeds).
    let attempts = Counter::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (deliverer, attempts) = (gateway.deliverer(), attempts.clone());
            let counted = tower::service_fn(move |m: Message| {
                attempts.bump();
                deliverer.clone().oneshot(m)
            });
            let worker = Worker::new(queue.clone(), counted)
                .lease(Duration::from_millis(300))
                .poll_interval(Duration::from_millis(20))
                .max_attempts(3)
                .backoff(Duration::from_millis(50), Duration::from_millis(200));
            let mut stopped = stopped.clone();
            tokio::spawn(worker.run(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    let limit = Duration::from_secs(20);
    wait_for("the first delivery", limit, || {
        up.in_flight.load(Ordering::SeqCst) == 1
    })
    .await;
    // Eight leases long.
    tokio::time::sleep(Duration::from_millis(2400)).await;
    assert_eq!(attempts.get(), 1, "handed out again while its delivery ran");
    assert_eq!(up.most_in_flight.load(Ordering::SeqCst), 1);
    up.hang.store(false, Ordering::SeqCst);
    let depth = |q: RedbQueue| async move { q.stats().await.unwrap().depth };
    let start = std::time::Instant::now();
    while depth(queue.clone()).await > 0 {
        assert!(start.elapsed() < limit, "the entry was not delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(up.answered.get(), 1, "delivered more than once");
    assert_eq!(attempts.get(), 1);
    assert_eq!(queue.stats().await.unwrap().dead, 0, "dead-lettered");
    drop((gateway, queue));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The route's own `max_in_flight` sheds the deliveries past it (the
/// worker runs more at once): the gateway answered those itself, so they
/// use no attempt and do not count for the breaker. (Counted, with two
/// attempts and a breaker at 1 failure, they were dead-lettered as "upstream
/// answered 503" and the breaker opened, though the upstream never failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deliveries_the_gateway_sheds_itself_use_no_attempt() {
    let up = Hung::default();
    up.hang.store(true, Ordering::SeqCst);
    let forward = up.clone().start().await;
    let dir = queue_dir();
    let queue = RedbQueue::open(dir.join("queue.redb")).unwrap();
    let options = acked().max_in_flight(1).queue_wait(Duration::ZERO);
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), options)
        .build()
        .unwrap();
    for i in 0..4 {
        let req = request(
            "/wx",
            &[],
            wechat(&format!("EV-shed-{i}"), "TRANSACTION.SUCCESS"),
        );
        check(
            &read(gateway.clone().oneshot(req).await.unwrap()).await,
            SUCCESS,
            "the acknowledgement",
        );
    }
    // A shed delivery, seen alone: the gateway's own answer.
    // (Both entries are leased briefly: the worker below delivers them too.)
    let first = queue.fetch(1, Duration::from_millis(200)).await.unwrap();
    let hung = tokio::spawn({
        let (gateway, message) = (gateway.clone(), first[0].message.clone());
        async move { gateway.deliver(message).await }
    });
    wait_for("the first delivery", Duration::from_secs(10), || {
        up.in_flight.load(Ordering::SeqCst) == 1
    })
    .await;
    let other = queue.fetch(1, Duration::from_millis(1)).await.unwrap();
    let shed = gateway.deliver(other[0].message.clone()).await.unwrap_err();
    assert!(shed.is_held(), "{shed}");
    assert!(!shed.is_permanent() && !shed.is_kept() && shed.upstream().is_none());
    let worker = Worker::new(queue.clone(), gateway.deliverer())
        .concurrency(4)
        .max_attempts(2)
        .breaker(1, Duration::from_secs(60))
        .lease(Duration::from_millis(500))
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(50), Duration::from_millis(50));
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(worker.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    up.hang.store(false, Ordering::SeqCst);
    let _ = hung.await.unwrap();
    let start = std::time::Instant::now();
    while queue.stats().await.unwrap().depth > 0 && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        stats.dead,
        0,
        "dead-lettered: {:?}",
        queue
            .dead_letters(4)
            .await
            .unwrap()
            .first()
            .map(|d| d.error.clone())
    );
    assert_eq!(
        (stats.depth, up.answered.get()),
        (0, 4),
        "each delivered once"
    );
    stop.send(true).unwrap();
    task.await.unwrap();
    drop((gateway, queue));
    let _ = std::fs::remove_dir_all(&dir);
}
