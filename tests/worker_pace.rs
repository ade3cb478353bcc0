//! The worker paces its deliveries: a concurrency limit, a circuit breaker
//! (per lane), a retry schedule instead of the backoff.

#![cfg(feature = "queue")]

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::queue::{MemoryQueue, Message, Pace, Queue, Worker};
use tower_idempotency::Fingerprint;

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
