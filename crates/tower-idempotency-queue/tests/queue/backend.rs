//! A queue backend written outside the crate against the storage trait
//! alone: `VecQueue` implements `Queue` (and nothing else: no
//! `SharedPacing`, no `Park`), and a `Worker` delivers over it, pacing
//! alone: it delivers, retries with a backoff, dead-letters after
//! `max_attempts`, replays once, and holds its own concurrency.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{
    DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError, QueueErrorKind,
    QueueStats, Worker,
};

use crate::Down;

/// An entry of [`VecQueue`].
struct Entry {
    message: Message,
    attempts: u32,
    enqueued_at: SystemTime,
    due: Instant,
    /// The lease it is handed out under, and until when.
    leased: Option<(u64, Instant)>,
    error: String,
}

#[derive(Default)]
struct State {
    next_id: u64,
    next_lease: u64,
    live: HashMap<u64, Entry>,
    dead: HashMap<u64, Entry>,
    /// Every key seen, with its fingerprint.
    seen: HashMap<String, Fingerprint>,
}

/// A queue in a `Mutex`, written as a user would, with the public API only.
#[derive(Clone, Default)]
struct VecQueue(Arc<Mutex<State>>);

impl VecQueue {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap()
    }
}

fn id_of(id: &EntryId) -> Result<u64, QueueError> {
    id.as_str().parse().map_err(|e| {
        QueueError::new(QueueErrorKind::Invalid, "not an id of this queue").with_source(e)
    })
}

/// The entry `delivery` names, if its lease still holds it.
fn held<'a>(state: &'a mut State, delivery: &Delivery) -> Option<(u64, &'a mut Entry)> {
    let id = id_of(&delivery.id).ok()?;
    let entry = state.live.get_mut(&id)?;
    match entry.leased {
        Some((lease, _)) if lease == delivery.lease() => Some((id, entry)),
        _ => None,
    }
}

impl Queue for VecQueue {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        let mut s = self.state();
        match s.seen.get(&message.key) {
            Some(fp) if *fp == message.fingerprint => return Ok(Ingested::Duplicate),
            Some(_) => return Ok(Ingested::Mismatch),
            None => {}
        }
        s.seen.insert(message.key.clone(), message.fingerprint);
        s.next_id += 1;
        let id = s.next_id;
        let entry = Entry {
            message,
            attempts: 0,
            enqueued_at: SystemTime::now(),
            due: Instant::now(),
            leased: None,
            error: String::new(),
        };
        s.live.insert(id, entry);
        Ok(Ingested::Queued(EntryId::new(id.to_string())))
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        let now = Instant::now();
        let mut s = self.state();
        let mut due: Vec<u64> = (s.live.iter())
            .filter(|(_, e)| e.due <= now && e.leased.is_none_or(|(_, until)| until <= now))
            .map(|(id, _)| *id)
            .collect();
        due.sort_unstable();
        let mut out = Vec::new();
        for id in due.into_iter().take(max) {
            s.next_lease += 1;
            let token = s.next_lease;
            let entry = s.live.get_mut(&id).expect("listed");
            entry.attempts += 1;
            entry.leased = Some((token, now + lease));
            out.push(Delivery::new(
                EntryId::new(id.to_string()),
                entry.message.clone(),
                entry.attempts,
                entry.enqueued_at,
                token,
            ));
        }
        Ok(out)
    }

    async fn renew(&self, delivery: &Delivery, lease: Duration) -> Result<bool, QueueError> {
        let mut s = self.state();
        let renewed = held(&mut s, delivery).map(|(_, e)| {
            e.leased = Some((delivery.lease(), Instant::now() + lease));
        });
        Ok(renewed.is_some())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        let mut s = self.state();
        let Some((id, _)) = held(&mut s, delivery) else {
            return Ok(false);
        };
        s.live.remove(&id);
        Ok(true)
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        let mut s = self.state();
        let Some((_, entry)) = held(&mut s, delivery) else {
            return Ok(false);
        };
        entry.leased = None;
        entry.due = Instant::now() + after;
        entry.error = error.to_owned();
        Ok(true)
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        let mut s = self.state();
        let Some((id, _)) = held(&mut s, delivery) else {
            return Ok(false);
        };
        let mut entry = s.live.remove(&id).expect("held");
        entry.leased = None;
        entry.error = error.to_owned();
        s.dead.insert(id, entry);
        Ok(true)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let s = self.state();
        let mut ids: Vec<&u64> = s.dead.keys().collect();
        ids.sort_unstable();
        Ok(ids
            .into_iter()
            .take(limit)
            .map(|id| {
                let e = &s.dead[id];
                DeadLetter::new(
                    EntryId::new(id.to_string()),
                    e.message.clone(),
                    e.attempts,
                    e.error.clone(),
                    SystemTime::now(),
                )
            })
            .collect())
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        let id = id_of(id)?;
        let mut s = self.state();
        let Some(mut entry) = s.dead.remove(&id) else {
            return Ok(false);
        };
        entry.attempts = 0;
        entry.due = Instant::now();
        s.live.insert(id, entry);
        Ok(true)
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        let ids: Vec<EntryId> = (self.state().dead.keys())
            .map(|id| EntryId::new(id.to_string()))
            .collect();
        let mut n = 0;
        for id in ids {
            n += usize::from(self.replay(&id).await?);
        }
        Ok(n)
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let s = self.state();
        let mut stats = QueueStats::default();
        stats.depth = s.live.len() as u64;
        stats.dead = s.dead.len() as u64;
        Ok(stats)
    }
}

async fn vec_queue() -> Option<(VecQueue, ())> {
    Some((VecQueue::default(), ()))
}

// The conformance suite, as a backend's own tests run it: `VecQueue`
// keeps the trait's defaults for `delete_dead` and `forget` (unsupported),
// so the cases of those calls end where the queue says so.
tower_idempotency_queue::testing::queue_tests!(vec_queue_suite, vec_queue);

#[tokio::test]
async fn a_worker_delivers_over_a_backend_that_implements_queue_alone() {
    let queue = VecQueue::default();
    for key in ["ok-1", "ok-2", "fails"] {
        let m = Message::new(key, Fingerprint::of(key.as_bytes()), "{}");
        assert!(matches!(
            queue.ingest(m).await.unwrap(),
            Ingested::Queued(_)
        ));
    }
    let copy = Message::new("ok-1", Fingerprint::of(b"ok-1"), "{}");
    assert_eq!(queue.ingest(copy).await.unwrap(), Ingested::Duplicate);
    let (calls, now, peak) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let svc = {
        let (calls, now, peak, failing) =
            (calls.clone(), now.clone(), peak.clone(), failing.clone());
        tower::service_fn(move |m: Message| {
            calls.fetch_add(1, Ordering::SeqCst);
            let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(at_once, Ordering::SeqCst);
            let (now, fail) = (
                now.clone(),
                m.key == "fails" && failing.load(Ordering::SeqCst),
            );
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                if fail {
                    Err(Down)
                } else {
                    Ok(())
                }
            }
        })
    };
    // Paced alone (no `shared_pacing()`: this queue has none).
    let mut worker = Worker::new(queue.clone(), svc)
        .concurrency(1)
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(1));
    let round = worker.run_once().await.unwrap();
    assert_eq!((round.delivered, round.retried), (2, 1), "{round:?}");
    assert_eq!(peak.load(Ordering::SeqCst), 1, "its own concurrency held");
    tokio::time::sleep(Duration::from_millis(5)).await;
    let round = worker.run_once().await.unwrap();
    assert_eq!(round.dead_lettered, 1, "{round:?}");
    let dead = queue.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].message.key.as_str(), dead[0].attempts),
        ("fails", 2)
    );
    assert!(dead[0].error.contains("upstream down"), "{}", dead[0].error);
    // Replayed once, delivered once the upstream answers.
    failing.store(false, Ordering::SeqCst);
    assert!(queue.replay(&dead[0].id).await.unwrap());
    assert!(!queue.replay(&dead[0].id).await.unwrap(), "replayed once");
    let round = worker.run_once().await.unwrap();
    assert_eq!(round.delivered, 1, "{round:?}");
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 5, "2 + 2 failed + 1 replayed");
    // The defaults a backend need not write: say what they cannot do.
    let forgot = queue.forget("ok-1").await.unwrap_err();
    assert_eq!(forgot.kind(), QueueErrorKind::Unsupported);
    assert!(!forgot.is_retryable());
}

/// [`VecQueue`] answering the shared pacing as every single-instance queue
/// did before `SharedPacing` was a trait of its own (a free slot, no turn
/// to wait for, no breaker shared): a worker with `shared_pacing()` over it
/// runs the calls a worker on such a queue used to make on every delivery.
#[derive(Clone, Default)]
struct OldDefaults(VecQueue);

mod old_defaults {
    use super::*;
    use tower_idempotency_queue::{BreakerRule, BreakerState, SharedPacing};

    impl Queue for OldDefaults {
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

    type Answer = Result<Option<BreakerState>, QueueError>;

    impl SharedPacing for OldDefaults {
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
        async fn breaker_state(&self, _: &str) -> Answer {
            Ok(None)
        }
        async fn breaker_vote(&self, _: &str, _: u64, _: bool, _: BreakerRule) -> Answer {
            Ok(None)
        }
        async fn take_probe(&self, _: &str, _: BreakerRule, _: Duration) -> Answer {
            Ok(None)
        }
        async fn renew_probe(&self, _: &str, _: u64, _: Duration) -> Result<(), QueueError> {
            Ok(())
        }
        async fn settle_probe(
            &self,
            _: &str,
            _: u64,
            _: Option<bool>,
            _: bool,
            _: BreakerRule,
        ) -> Answer {
            Ok(None)
        }
    }
}

/// The time per delivery of `rounds` rounds of `batch` entries.
async fn per_delivery<Q: Queue, S>(
    mut worker: Worker<Q, S>,
    queue: &Q,
    batch: usize,
    rounds: usize,
) -> Duration
where
    S: tower::Service<Message, Response = (), Error = Down>,
{
    let mut total = Duration::ZERO;
    for r in 0..rounds {
        for i in 0..batch {
            let key = format!("k-{r}-{i}");
            let m = Message::new(key.as_str(), Fingerprint::of(key.as_bytes()), "{}");
            queue.ingest(m).await.unwrap();
        }
        let started = Instant::now();
        let round = worker.run_once().await.unwrap();
        total += started.elapsed();
        assert_eq!(round.delivered, batch);
    }
    total / (batch * rounds) as u32
}

/// A worker that paces alone adds nothing to a delivery: over the same
/// queue, a delivery costs no more than one of a worker that asks the
/// queue's shared pacing (the calls every worker made before, on every
/// queue). Prints both (`--ignored --nocapture`); a measurement, not a
/// test of correctness.
#[tokio::test]
#[ignore]
async fn pacing_alone_adds_nothing_to_a_delivery() {
    let ok = || tower::service_fn(|_m: Message| async { Ok::<_, Down>(()) });
    let (batch, rounds) = (256, 200);
    for _ in 0..3 {
        let alone = OldDefaults::default();
        let worker = Worker::new(alone.clone(), ok())
            .batch(batch)
            .concurrency(64)
            .breaker(10, Duration::from_secs(30));
        let alone_took = per_delivery(worker, &alone, batch, rounds).await;
        let shared = OldDefaults::default();
        let worker = Worker::new(shared.clone(), ok())
            .batch(batch)
            .concurrency(64)
            .breaker(10, Duration::from_secs(30))
            .shared_pacing();
        let shared_took = per_delivery(worker, &shared, batch, rounds).await;
        println!("per delivery: alone {alone_took:?}, asking the old defaults {shared_took:?}");
    }
}
