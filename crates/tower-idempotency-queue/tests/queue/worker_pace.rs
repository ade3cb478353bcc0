//! The worker paces its deliveries: a concurrency limit, a circuit breaker
//! (per lane), a retry schedule instead of the backoff.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{MemoryQueue, Message, Pace, Queue, Worker};

fn message(path: &'static str, i: usize) -> Message {
    let mut m = Message::new(format!("k-{path}-{i}"), Fingerprint::of(b"x"), "{}");
    m.uri = http::Uri::from_static(path);
    m
}

async fn queue_of(n: usize, path: &'static str, queue: &MemoryQueue) {
    for i in 0..n {
        queue.ingest(message(path, i)).await.unwrap();
    }
}

/// Counts calls and the most at once; fails while `failing` is set.
#[derive(Default)]
struct Upstream {
    calls: AtomicUsize,
    now: AtomicUsize,
    peak: AtomicUsize,
    failing: AtomicBool,
}

fn service(
    up: Arc<Upstream>,
) -> impl tower::Service<Message, Response = (), Error = io::Error, Future: Send> + Clone {
    tower::service_fn(move |_m: Message| {
        let up = up.clone();
        async move {
            up.calls.fetch_add(1, Ordering::SeqCst);
            let now = up.now.fetch_add(1, Ordering::SeqCst) + 1;
            up.peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            up.now.fetch_sub(1, Ordering::SeqCst);
            match up.failing.load(Ordering::SeqCst) {
                true => Err(io::Error::other("503")),
                false => Ok(()),
            }
        }
    })
}

#[tokio::test]
async fn concurrency_bounds_the_deliveries_in_flight() {
    let queue = MemoryQueue::new();
    queue_of(60, "/a", &queue).await;
    let up = Arc::new(Upstream::default());
    let mut worker = Worker::new(queue.clone(), service(up.clone()))
        .batch(60)
        .concurrency(4);
    let round = worker.run_once().await.unwrap();
    assert_eq!(round.fetched, 60);
    assert_eq!(round.delivered, 60);
    assert_eq!(
        up.peak.load(Ordering::SeqCst),
        4,
        "the limit is used, never passed"
    );
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

#[tokio::test]
async fn the_breaker_opens_after_consecutive_failures_and_postpones_the_rest() {
    let queue = MemoryQueue::new();
    queue_of(5, "/a", &queue).await;
    let up = Arc::new(Upstream::default());
    up.failing.store(true, Ordering::SeqCst);
    let mut worker = Worker::new(queue.clone(), service(up.clone()))
        .concurrency(1)
        .breaker(2, Duration::from_millis(300))
        .backoff(Duration::from_secs(2), Duration::from_secs(2))
        .max_attempts(10);
    let round = worker.run_once().await.unwrap();
    assert_eq!(up.calls.load(Ordering::SeqCst), 2, "calls before it opened");
    assert_eq!((round.retried, round.paused), (2, 3), "{round:?}");
    // Open: nothing is due before the cooldown ends (the failed entries'
    // backoff, the others' pause).
    assert_eq!(worker.run_once().await.unwrap().fetched, 0);
    up.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The cooldown is over: the paused entries are due; one probe, it
    // succeeds, the breaker closes and the rest follow.
    let round = worker.run_once().await.unwrap();
    assert_eq!(round.delivered, 3, "{round:?}");
    assert_eq!(up.calls.load(Ordering::SeqCst), 5);
    // The attempts of the paused entries were not counted.
    let mut tries = 0;
    while queue.stats().await.unwrap().depth > 0 && tries < 100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        worker.run_once().await.unwrap();
        tries += 1;
    }
    assert_eq!(queue.stats().await.unwrap().depth, 0);
    assert_eq!(up.calls.load(Ordering::SeqCst), 7);
}

#[tokio::test]
async fn a_failed_probe_opens_the_breaker_again() {
    let queue = MemoryQueue::new();
    queue_of(3, "/a", &queue).await;
    let up = Arc::new(Upstream::default());
    up.failing.store(true, Ordering::SeqCst);
    let mut worker = Worker::new(queue.clone(), service(up.clone()))
        .concurrency(1)
        .breaker(1, Duration::from_millis(200))
        .retry_schedule([Duration::from_millis(1)]);
    let round = worker.run_once().await.unwrap();
    assert_eq!((round.retried, round.paused), (1, 2), "{round:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // One probe, alone; it fails: the others are paused again.
    let round = worker.run_once().await.unwrap();
    assert_eq!(up.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        (round.fetched, round.retried, round.paused),
        (3, 1, 2),
        "{round:?}"
    );
}

#[tokio::test]
async fn lanes_have_breakers_of_their_own() {
    let queue = MemoryQueue::new();
    queue_of(4, "/down", &queue).await;
    queue_of(4, "/up", &queue).await;
    let down = Arc::new(Upstream::default());
    down.failing.store(true, Ordering::SeqCst);
    let up = Arc::new(Upstream::default());
    let (to_down, to_up) = (service(down.clone()), service(up.clone()));
    let split = tower::service_fn(move |m: Message| {
        let (to_down, to_up) = (to_down.clone(), to_up.clone());
        async move {
            use tower::ServiceExt;
            match m.uri.path() {
                "/down" => to_down.oneshot(m).await,
                _ => to_up.oneshot(m).await,
            }
        }
    });
    let lane = |m: &Message| Some(Arc::<str>::from(m.uri.path()));
    let pace = Pace::new()
        .concurrency(1)
        .breaker(2, Duration::from_secs(60));
    let mut worker = Worker::new(queue.clone(), split)
        .lane("/down", pace.clone())
        .lane("/up", pace)
        .lanes(lane);
    let round = worker.run_once().await.unwrap();
    assert_eq!(down.calls.load(Ordering::SeqCst), 2);
    assert_eq!(up.calls.load(Ordering::SeqCst), 4);
    assert_eq!(
        (round.delivered, round.retried, round.paused),
        (4, 2, 2),
        "{round:?}"
    );
}

#[tokio::test]
async fn the_retry_schedule_replaces_the_backoff() {
    let queue = MemoryQueue::new();
    queue_of(1, "/a", &queue).await;
    let up = Arc::new(Upstream::default());
    up.failing.store(true, Ordering::SeqCst);
    // An hour of backoff, but a schedule of milliseconds (its last delay
    // repeating): the entry fails four times within moments.
    let mut worker = Worker::new(queue.clone(), service(up.clone()))
        .backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .retry_schedule([Duration::from_millis(1), Duration::from_millis(2)])
        .max_attempts(4);
    let mut tries = 0;
    while queue.stats().await.unwrap().dead == 0 && tries < 200 {
        worker.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(3)).await;
        tries += 1;
    }
    assert_eq!(
        queue.stats().await.unwrap().dead,
        1,
        "dead-lettered after 4 attempts"
    );
    assert_eq!(up.calls.load(Ordering::SeqCst), 4);
}

/// Runs `worker` in the background; dropping the handle stops it at once
/// (the deliveries under way are dropped: their entries come back after
/// their lease).
struct Running(tokio::task::JoinHandle<()>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn spawn<S>(worker: Worker<MemoryQueue, S>) -> Running
where
    S: tower::Service<Message> + Send + 'static,
    S::Future: Send,
    S::Error: tower_idempotency::consumer::Failure + Send,
    S::Response: Send,
{
    Running(tokio::spawn(worker.run(std::future::pending())))
}

/// Waits until `done` or `limit`; whether it was done.
async fn within(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while !done() {
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// The storm: 100 notifications × 5 copies, every fifth failing its
/// first 3 deliveries on its own (its order not committed yet), the rest
/// succeeding at once, and 50 healthy ones a moment later. The failing
/// fifth, retried together, fail many times in a row: the breaker must not
/// take that for the upstream (a 30 s cooldown would hold everything).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_failing_on_its_own_never_opens_the_breaker() {
    let queue = MemoryQueue::new();
    let tries = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let delivered = Arc::new(AtomicUsize::new(0));
    let (t, d) = (tries.clone(), delivered.clone());
    let svc = tower::service_fn(move |m: Message| {
        let (tries, delivered) = (t.clone(), d.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let n: usize = m.key.rsplit('-').next().unwrap().parse().unwrap();
            let tried = {
                let mut tries = tries.lock().unwrap();
                let tried = tries.entry(m.key.clone()).or_insert(0usize);
                *tried += 1;
                *tried
            };
            if n.is_multiple_of(5) && n < 100 && tried <= 3 {
                return Err(io::Error::other("upstream answered 500: order not found"));
            }
            delivered.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    });
    for i in 0..100 {
        for _ in 0..5 {
            queue.ingest(message("/a", i)).await.unwrap();
        }
    }
    // The gateway's defaults: 16 at a time, the breaker at 10 for 30 s.
    let _worker = spawn(
        Worker::new(queue.clone(), svc)
            .concurrency(16)
            .breaker(10, Duration::from_secs(30))
            .poll_interval(Duration::from_millis(20))
            .backoff(Duration::from_millis(50), Duration::from_millis(200)),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 100..150 {
        queue.ingest(message("/a", i)).await.unwrap();
    }
    let all = within(Duration::from_secs(10), || {
        delivered.load(Ordering::SeqCst) == 150
    })
    .await;
    assert!(
        all,
        "delivered {} of 150 within 10 s",
        delivered.load(Ordering::SeqCst)
    );
    assert_eq!(queue.stats().await.unwrap().dead, 0);
}

/// A delivery that runs longer than the lease, and entries waiting for
/// their lane's turn meanwhile: the leases are renewed, nothing is handed
/// out again (which would count attempts and dead-letter them as "handed
/// out N times without settling").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_longer_than_the_lease_is_delivered_once() {
    let queue = MemoryQueue::new();
    queue_of(3, "/a", &queue).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let svc = tower::service_fn(move |_m: Message| {
        c.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            Ok::<_, io::Error>(())
        }
    });
    let _worker = spawn(
        Worker::new(queue.clone(), svc)
            .concurrency(1)
            .lease(Duration::from_millis(200))
            .poll_interval(Duration::from_millis(20))
            .max_attempts(3),
    );
    let depth = || queue.stats();
    let start = std::time::Instant::now();
    while depth().await.unwrap().depth > 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "not delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (calls.load(Ordering::SeqCst), stats.dead),
        (3, 0),
        "each delivered once, none dead-lettered"
    );
}

/// 200 entries for a route whose upstream takes seconds, then one for a
/// fast route: the slow lane's entries do not hold the fetch budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lane_does_not_starve_the_others() {
    let queue = MemoryQueue::new();
    queue_of(200, "/slow", &queue).await;
    queue_of(1, "/fast", &queue).await;
    let fast = Arc::new(AtomicUsize::new(0));
    let f = fast.clone();
    let svc = tower::service_fn(move |m: Message| {
        let f = f.clone();
        async move {
            match m.uri.path() {
                "/slow" => tokio::time::sleep(Duration::from_secs(20)).await,
                _ => {
                    f.fetch_add(1, Ordering::SeqCst);
                }
            }
            Ok::<_, io::Error>(())
        }
    });
    let lane = |m: &Message| Some(Arc::<str>::from(m.uri.path()));
    let _worker = spawn(
        Worker::new(queue.clone(), svc)
            .lane("/slow", Pace::new().concurrency(16))
            .lane("/fast", Pace::new().concurrency(16))
            .lanes(lane)
            .poll_interval(Duration::from_millis(20)),
    );
    let delivered = within(Duration::from_secs(2), || fast.load(Ordering::SeqCst) == 1).await;
    assert!(
        delivered,
        "the fast route's entry waited behind the slow route's"
    );
}

/// A memory queue whose shared breaker cannot answer (as a Redis queue's
/// while Redis is unreachable).
#[derive(Clone, Debug)]
struct Unanswering(MemoryQueue);

fn unanswered() -> tower_idempotency_queue::QueueError {
    tower_idempotency_queue::QueueError::new(
        tower_idempotency_queue::QueueErrorKind::Unavailable,
        "the shared breaker is unreachable",
    )
}

mod unanswering {
    use super::*;
    use tower_idempotency_queue::{
        BreakerRule, BreakerState, DeadLetter, Delivery, EntryId, Ingested, QueueError, QueueStats,
        SharedPacing,
    };

    type Answer = Result<Option<BreakerState>, QueueError>;

    impl Queue for Unanswering {
        async fn ingest(&self, m: Message) -> Result<Ingested, QueueError> {
            self.0.ingest(m).await
        }
        async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
            self.0.fetch(max, lease).await
        }
        async fn renew(&self, d: &Delivery, lease: Duration) -> Result<bool, QueueError> {
            self.0.renew(d, lease).await
        }
        async fn ack(&self, d: &Delivery) -> Result<bool, QueueError> {
            self.0.ack(d).await
        }
        async fn retry(&self, d: &Delivery, after: Duration, e: &str) -> Result<bool, QueueError> {
            self.0.retry(d, after, e).await
        }
        async fn postpone(
            &self,
            d: &Delivery,
            after: Duration,
            e: &str,
        ) -> Result<bool, QueueError> {
            self.0.postpone(d, after, e).await
        }
        async fn dead_letter(&self, d: &Delivery, e: &str) -> Result<bool, QueueError> {
            self.0.dead_letter(d, e).await
        }
        async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
            self.0.dead_letters(limit).await
        }
        async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
            self.0.replay(id).await
        }
        async fn replay_all(&self) -> Result<usize, QueueError> {
            self.0.replay_all().await
        }
        async fn stats(&self) -> Result<QueueStats, QueueError> {
            self.0.stats().await
        }
    }

    /// Slots and turns as a queue of one instance would give them (all
    /// free); the breaker cannot answer.
    impl SharedPacing for Unanswering {
        async fn take_slot(
            &self,
            _: &str,
            _: usize,
            _: Duration,
        ) -> Result<Option<u64>, QueueError> {
            Ok(Some(0))
        }
        async fn renew_slot(&self, _: &str, _: u64, _: Duration) -> Result<(), QueueError> {
            Ok(())
        }
        async fn give_slot(&self, _: &str, _: u64) -> Result<(), QueueError> {
            Ok(())
        }
        async fn take_turn(&self, _: &str, _: Duration) -> Result<Option<Duration>, QueueError> {
            Ok(None)
        }
        async fn renew_probe(&self, _: &str, _: u64, _: Duration) -> Result<(), QueueError> {
            Ok(())
        }
        async fn breaker_state(&self, _lane: &str) -> Answer {
            Err(unanswered())
        }
        async fn breaker_vote(&self, _: &str, _: u64, _: bool, _: BreakerRule) -> Answer {
            Err(unanswered())
        }
        async fn take_probe(&self, _: &str, _: BreakerRule, _: Duration) -> Answer {
            Err(unanswered())
        }
        async fn settle_probe(
            &self,
            _: &str,
            _: u64,
            _: Option<bool>,
            _: bool,
            _: BreakerRule,
        ) -> Answer {
            Err(unanswered())
        }
    }
}

/// A queue whose shared breaker cannot answer stops nothing and doubles
/// nothing: the worker's own breaker judges alone (it opens after its own
/// failures and probes on its own), and every entry is delivered once.
#[tokio::test]
async fn a_shared_breaker_that_cannot_answer_leaves_the_worker_its_own() {
    let inner = MemoryQueue::new();
    queue_of(5, "/a", &inner).await;
    let queue = Unanswering(inner);
    let up = Arc::new(Upstream::default());
    up.failing.store(true, Ordering::SeqCst);
    let mut worker = Worker::new(queue.clone(), service(up.clone()))
        .concurrency(1)
        .breaker(2, Duration::from_millis(300))
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .max_attempts(10)
        .shared_pacing();
    let round = worker.run_once().await.unwrap();
    assert_eq!(up.calls.load(Ordering::SeqCst), 2, "calls before it opened");
    assert_eq!((round.retried, round.paused), (2, 3), "{round:?}");
    up.failing.store(false, Ordering::SeqCst);
    let mut tries = 0;
    while queue.stats().await.unwrap().depth > 0 && tries < 100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        worker.run_once().await.unwrap();
        tries += 1;
    }
    assert_eq!(queue.stats().await.unwrap().depth, 0);
    assert_eq!(
        up.calls.load(Ordering::SeqCst),
        7,
        "5 delivered once, 2 failed before"
    );
}

/// 120 entries for one lane at `concurrency(4)` with a fetch batch of 20 (as
/// the gateway sizes it: the concurrency and 16 more): the lane holds 8. The
/// worker fetches no more than that, so no entry is given back to wait out a
/// second while the lane has room: the upstream is never left idle for long
/// while entries are due (fetching the whole batch and giving back the
/// rest, it was idle for about a second after every 8 deliveries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_given_back_for_a_full_lane_come_back_as_it_gets_room() {
    let queue = MemoryQueue::new();
    queue_of(120, "/a", &queue).await;
    let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = starts.clone();
    let svc = tower::service_fn(move |_m: Message| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(std::time::Instant::now());
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok::<_, io::Error>(())
        }
    });
    let _worker = spawn(
        Worker::new(queue.clone(), svc)
            .batch(20)
            .concurrency(4)
            .poll_interval(Duration::from_millis(20)),
    );
    let done = within(Duration::from_secs(20), || {
        starts.lock().unwrap().len() >= 120
    })
    .await;
    let starts = starts.lock().unwrap().clone();
    assert!(done, "{} of 120 delivered", starts.len());
    let gap = starts
        .windows(2)
        .map(|w| w[1].saturating_duration_since(w[0]))
        .max()
        .unwrap();
    // 120 × 10 ms / 4 = 0.3 s of calls: no pause of half a second between
    // two of them while others were due.
    assert!(
        gap < Duration::from_millis(500),
        "the lane sat idle for {gap:?} with entries due (total {:?})",
        starts[119] - starts[0]
    );
}

/// A memory queue that counts its fetches (those that handed entries out),
/// its acknowledgements and the entries given back for later (postponed),
/// and whose fetches after the first hang while
/// `held` is set (as a remote broker's round trip, or a commit waiting for
/// its disk).
#[derive(Clone, Debug, Default)]
struct Watched {
    inner: MemoryQueue,
    fetches: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
    acks: Arc<AtomicUsize>,
    postponed: Arc<AtomicUsize>,
    held: Arc<AtomicBool>,
}

mod watched {
    use super::*;
    use tower_idempotency_queue::{
        DeadLetter, Delivery, EntryId, Ingested, QueueError, QueueStats,
    };

    impl Queue for Watched {
        async fn ingest(&self, m: Message) -> Result<Ingested, QueueError> {
            self.inner.ingest(m).await
        }
        async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) > 0 {
                while self.held.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            let batch = self.inner.fetch(max, lease).await?;
            if !batch.is_empty() {
                self.fetches.fetch_add(1, Ordering::SeqCst);
            }
            Ok(batch)
        }
        async fn renew(&self, d: &Delivery, lease: Duration) -> Result<bool, QueueError> {
            self.inner.renew(d, lease).await
        }
        async fn ack(&self, d: &Delivery) -> Result<bool, QueueError> {
            let acked = self.inner.ack(d).await;
            self.acks.fetch_add(1, Ordering::SeqCst);
            acked
        }
        async fn retry(&self, d: &Delivery, after: Duration, e: &str) -> Result<bool, QueueError> {
            self.inner.retry(d, after, e).await
        }
        async fn postpone(
            &self,
            d: &Delivery,
            after: Duration,
            e: &str,
        ) -> Result<bool, QueueError> {
            self.postponed.fetch_add(1, Ordering::SeqCst);
            self.inner.postpone(d, after, e).await
        }
        async fn dead_letter(&self, d: &Delivery, e: &str) -> Result<bool, QueueError> {
            self.inner.dead_letter(d, e).await
        }
        async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
            self.inner.dead_letters(limit).await
        }
        async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
            self.inner.replay(id).await
        }
        async fn replay_all(&self) -> Result<usize, QueueError> {
            self.inner.replay_all().await
        }
        async fn stats(&self) -> Result<QueueStats, QueueError> {
            self.inner.stats().await
        }
    }
}

/// Whether `queue` acknowledged `n` deliveries within a minute.
async fn all_acknowledged(queue: &Watched, n: usize) -> bool {
    within(Duration::from_secs(60), || {
        queue.acks.load(Ordering::SeqCst) >= n
    })
    .await
}

/// The gateway's worker: a default lane and a lane per route, each at
/// concurrency 16, a batch of 32. A backlog of one route drained by a
/// quick upstream keeps what each fetch brought: the fetch is bounded by
/// the room of both lanes together, and the 12 entries of each fetch past
/// the route lane's room were given back for a second (a write each), so
/// the drain came in bursts a second apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lane_keeps_the_entries_fetched_past_its_room() {
    let queue = Watched::default();
    queue_of(256, "/a", &queue.inner).await;
    let up = Arc::new(Upstream::default());
    let lane = |m: &Message| Some(Arc::<str>::from(m.uri.path()));
    let _worker = Running(tokio::spawn(
        Worker::new(queue.clone(), service(up.clone()))
            .concurrency(16)
            .lane("/a", Pace::new().concurrency(16))
            .lanes(lane)
            .batch(32)
            .poll_interval(Duration::from_millis(20))
            .run(std::future::pending()),
    ));
    let done = all_acknowledged(&queue, 256).await;
    let postponed = queue.postponed.load(Ordering::SeqCst);
    assert!(
        done,
        "{} of 256 acknowledged ({postponed} given back)",
        queue.acks.load(Ordering::SeqCst)
    );
    // Its calls take 5 ms: none is given back (at most one fetch's worth
    // on a machine that stalls the worker for a tenth of a second).
    assert!(
        postponed <= 12,
        "{postponed} entries given back for a lane that was never slow"
    );
    assert_eq!(up.calls.load(Ordering::SeqCst), 256, "each delivered once");
}

/// A backlog drained by a healthy upstream is fetched a batch at a time,
/// not one entry per finished delivery: each fetch is a durable commit (an
/// fsync on the embedded queue, a round trip to a broker), and refilling
/// the batch one entry at a time made a 1,000-entry backlog take 15 s to
/// reach an upstream that answers at once (0.2 s before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_fetched_a_batch_at_a_time() {
    let queue = Watched::default();
    queue_of(256, "/a", &queue.inner).await;
    let up = Arc::new(Upstream::default());
    let _worker = Running(tokio::spawn(
        Worker::new(queue.clone(), service(up.clone()))
            .batch(32)
            .poll_interval(Duration::from_millis(20))
            .run(std::future::pending()),
    ));
    let done = all_acknowledged(&queue, 256).await;
    assert!(
        done,
        "{} of 256 acknowledged",
        queue.acks.load(Ordering::SeqCst)
    );
    let fetches = queue.fetches.load(Ordering::SeqCst);
    // 256 / 32 = 8 full batches; refilled when half the batch is free, 16.
    assert!(
        fetches <= 32,
        "{fetches} fetches handed out 256 entries in batches of 32"
    );
}

/// A fetch under way holds no delivery: one that ends meanwhile is settled
/// at once (before, the worker awaited its fetch and polled nothing else,
/// so every delivery's acknowledgement waited for the next fetch's commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_settle_while_a_fetch_is_under_way() {
    let queue = Watched::default();
    queue_of(3, "/a", &queue.inner).await;
    queue.held.store(true, Ordering::SeqCst);
    let release = Arc::new(tokio::sync::Notify::new());
    let (calls, r) = (Arc::new(AtomicUsize::new(0)), release.clone());
    let c = calls.clone();
    let svc = tower::service_fn(move |_m: Message| {
        let (c, r) = (c.clone(), r.clone());
        async move {
            // The first delivery ends at once, the second when released.
            if c.fetch_add(1, Ordering::SeqCst) == 1 {
                r.notified().await;
            }
            Ok::<_, io::Error>(())
        }
    });
    let _worker = Running(tokio::spawn(
        Worker::new(queue.clone(), svc)
            .batch(2)
            .poll_interval(Duration::from_millis(20))
            .run(std::future::pending()),
    ));
    // The first ends, its slot is free: the second fetch starts, and hangs.
    let refilling = within(Duration::from_secs(10), || {
        queue.acks.load(Ordering::SeqCst) == 1 && queue.calls.load(Ordering::SeqCst) >= 2
    })
    .await;
    assert!(
        refilling,
        "the first delivery was settled and a fetch started"
    );
    release.notify_one();
    let settled = within(Duration::from_secs(10), || {
        queue.acks.load(Ordering::SeqCst) == 2
    })
    .await;
    assert!(
        settled,
        "the second delivery ended but was not settled while the fetch hung"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the third waits for its fetch"
    );
    queue.held.store(false, Ordering::SeqCst);
    let all = within(Duration::from_secs(10), || {
        queue.acks.load(Ordering::SeqCst) == 3
    })
    .await;
    assert!(all, "the third was delivered once the fetch answered");
}

/// A lane that was quick holds more than its room (the entries fetched past
/// it wait in its line); once its calls stop ending it gives that back, so
/// the other lanes' entries behind are fetched: here the first 40 calls of
/// `/a` end at once and the rest hang, with one entry for `/b` behind 200
/// of `/a`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_whose_calls_stop_ending_gives_back_what_it_kept() {
    let queue = Watched::default();
    queue_of(200, "/a", &queue.inner).await;
    queue_of(1, "/b", &queue.inner).await;
    let (calls, b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, bb) = (calls.clone(), b.clone());
    let svc = tower::service_fn(move |m: Message| {
        let (c, bb) = (c.clone(), bb.clone());
        async move {
            if m.uri.path() == "/b" {
                bb.fetch_add(1, Ordering::SeqCst);
            } else if c.fetch_add(1, Ordering::SeqCst) >= 40 {
                std::future::pending::<()>().await;
            } else {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<_, io::Error>(())
        }
    });
    let lane = |m: &Message| Some(Arc::<str>::from(m.uri.path()));
    let _worker = Running(tokio::spawn(
        Worker::new(queue.clone(), svc)
            .lane("/a", Pace::new().concurrency(16))
            .lane("/b", Pace::new().concurrency(16))
            .lanes(lane)
            .batch(48)
            .poll_interval(Duration::from_millis(20))
            .run(std::future::pending()),
    ));
    let delivered = within(Duration::from_secs(20), || b.load(Ordering::SeqCst) == 1).await;
    assert!(
        delivered,
        "/b's entry waited behind /a's hung lane ({} of /a's called, {} given back)",
        calls.load(Ordering::SeqCst),
        queue.postponed.load(Ordering::SeqCst)
    );
}
