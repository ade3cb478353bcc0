//! The library's `Worker` and `Consumer` keep what an acknowledgement
//! promised: what cannot succeed goes to the dead letters at once with its
//! reason, a hung delivery never holds the others, a hung handler is ended
//! by the consumer's run limit, and a success is never released because
//! its caller went away while it was being recorded.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use test_support::common::faults::{FaultStore, Faults, Op};
use tower::service_fn;
use tower_idempotency::consumer::{ConsumeError, Consumer, ConsumerLayer, Once};
use tower_idempotency::store::{MemoryStore, StoreError};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{MemoryQueue, Message, Queue, Worker};
use tower_layer::Layer;

use crate::Down;

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(s.as_bytes())
}

/// The consumer's key: the message key up to `#` (two queue entries can
/// carry one consumer key), none for `nokey`.
fn consumer_key(m: &Message) -> Option<(String, Fingerprint)> {
    let key = m.key.split('#').next().unwrap_or_default();
    (key != "nokey").then(|| (key.to_owned(), m.fingerprint))
}

#[tokio::test]
async fn worker_dead_letters_a_mismatch_and_a_missing_key_at_once_with_the_reason() {
    let queue = MemoryQueue::new();
    for (key, body) in [
        ("tx-1#a", "paid 100"),
        ("tx-1#b", "paid 999"),
        ("nokey", "x"),
    ] {
        queue
            .ingest(Message::new(key, fp(body), body))
            .await
            .unwrap();
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = service_fn(move |_m: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Down>(()) }
    });
    let consumer = Consumer::new(MemoryStore::new());
    let svc = ConsumerLayer::new(consumer, consumer_key).layer(handler);
    let mut worker = Worker::new(queue.clone(), svc).batch(1);
    let mut rounds = Vec::new();
    for _ in 0..3 {
        rounds.push(worker.run_once().await.unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let retried: usize = rounds.iter().map(|r| r.retried).sum();
    let dead: usize = rounds.iter().map(|r| r.dead_lettered).sum();
    assert_eq!((retried, dead), (0, 2), "{rounds:?}");
    let letters = queue.dead_letters(10).await.unwrap();
    let reasons: Vec<(&str, u32, &str)> = letters
        .iter()
        .map(|d| (d.message.key.as_str(), d.attempts, d.error.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("tx-1#b", 1, "message key reused with a different payload"),
            ("nokey", 1, "message has no key"),
        ]
    );
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

/// Waits (bounded) until `done`.
async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..200 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn worker_run_delivers_new_entries_while_one_delivery_hangs() {
    let queue = MemoryQueue::new();
    queue
        .ingest(Message::new("hangs", fp("h"), "h"))
        .await
        .unwrap();
    let delivered = Arc::new(AtomicUsize::new(0));
    let counter = delivered.clone();
    let svc = service_fn(move |m: Message| {
        let counter = counter.clone();
        async move {
            if m.key == "hangs" {
                std::future::pending::<()>().await;
            }
            counter.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Down>(())
        }
    });
    let worker = Worker::new(queue.clone(), svc).poll_interval(Duration::from_millis(20));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    // The hung delivery started; entries queued after it are delivered.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for key in ["later-1", "later-2"] {
        queue.ingest(Message::new(key, fp(key), key)).await.unwrap();
    }
    eventually("the later entries", async || {
        delivered.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(queue.stats().await.unwrap().depth, 1);
    drop(stop);
    task.abort();
}

#[tokio::test]
async fn consumer_run_limit_ends_a_hung_handler_and_releases_its_key() {
    let consumer = Consumer::new(MemoryStore::new()).max_run(Duration::from_millis(200));
    let hung = consumer.once("k", fp("p"), std::future::pending::<Result<(), Down>>());
    let got = tokio::time::timeout(Duration::from_secs(30), hung).await;
    assert!(
        matches!(got, Ok(Err(ConsumeError::RunLimit))),
        "the run limit ends it: {got:?}"
    );
    let again = consumer
        .once("k", fp("p"), async { Ok::<_, Down>(()) })
        .await;
    assert!(matches!(again, Ok(Once::Ran(()))), "{again:?}");
}

#[test]
fn consumer_run_limit_defaults_to_five_minutes() {
    let consumer = Consumer::new(MemoryStore::new());
    assert_eq!(consumer.get_max_run(), Duration::from_secs(300));
}

/// A memory store whose completions take a while (the store acts only
/// at the end of it), so that a test can cancel one under way; with
/// `hang_renewals`, its first renewal hangs (the store acts only after it).
type SlowComplete = FaultStore<SlowPlan>;

#[derive(Clone, Default)]
struct SlowPlan {
    completing: Arc<AtomicBool>,
    hang_renewals: Arc<AtomicUsize>,
}

impl Faults for SlowPlan {
    async fn before(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        match op {
            Op::Complete => {
                self.completing.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Op::Renew => {
                let hang = self
                    .hang_renewals
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if hang {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[tokio::test]
async fn cancelled_while_completing_a_success_keeps_it() {
    let store = SlowComplete::default();
    let consumer = Consumer::new(store.clone()).wait(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let first = {
        let (consumer, runs) = (consumer.clone(), runs.clone());
        tokio::spawn(async move {
            consumer
                .once("k", fp("p"), async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Down>(())
                })
                .await
        })
    };
    eventually("the completion to start", async || {
        store.completing.load(Ordering::SeqCst)
    })
    .await;
    first.abort();
    let _ = first.await;
    let runs2 = runs.clone();
    let again = consumer
        .once("k", fp("p"), async move {
            runs2.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Down>(())
        })
        .await;
    assert!(matches!(again, Ok(Once::Done(()))), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_renewal_that_timed_out_is_retried_before_the_lease_runs_out() {
    // Lease 1.5 s, renewed every 500 ms; the first renewal hangs and times
    // out at 1.3 s. The next one must come before the lease ends at 1.5 s
    // (a whole period later, 1.8 s, is too late).
    let store = SlowComplete::default();
    store.hang_renewals.store(1, Ordering::SeqCst);
    let consumer = Consumer::new(store.clone())
        .lease(Duration::from_millis(1500))
        .store_timeout(Duration::from_millis(800));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |runs: Arc<AtomicUsize>| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        Ok::<_, Down>(())
    };
    let first = tokio::spawn({
        let (consumer, runs) = (consumer.clone(), runs.clone());
        async move { consumer.once("k", fp("p"), handler(runs)).await }
    });
    // After the first lease would have run out without a prompt retry.
    tokio::time::sleep(Duration::from_millis(1650)).await;
    let copy = consumer.once("k", fp("p"), handler(runs.clone())).await;
    assert!(matches!(copy, Err(ConsumeError::InFlight)), "{copy:?}");
    assert!(matches!(first.await.unwrap(), Ok(Once::Ran(()))));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
