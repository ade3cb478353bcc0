//! [`Park`]: a paused route's entries held out of the due set until its
//! pause ends, instead of being fetched and put back again and again.

use crate::{Delivery, Queue, QueueError};
use std::future::Future;

/// A queue that can park entries: take a leased entry out of the due set,
/// under the prefix of the paused route it belongs to, and put every entry
/// parked under a prefix back, due at once, when that route resumes.
///
/// A [`Worker`](crate::Worker) given one with
/// [`park_paused`](crate::Worker::park_paused) parks the entries of a paused
/// route (a delivery whose error says
/// [`Disposition::Pause`](tower_idempotency::consumer::Disposition::Pause))
/// instead of postponing them: nothing of that route is fetched again until
/// it is woken. Whoever resumes the route calls [`wake`](Self::wake) (and,
/// at start, wakes every [`parked`](Self::parked) prefix that is not paused
/// any more).
///
/// [`RedbQueue`](crate::RedbQueue), [`MemoryQueue`](crate::MemoryQueue) and
/// `RedisStreamsQueue` park. `AmqpQueue` and `JetStreamQueue` do not
/// implement it: their delays cannot be shortened once set, so a paused
/// route's entries there keep being postponed (for 30 s at a time) and are
/// delivered within 30 s of a resume; a worker over them has no
/// [`park_paused`](crate::Worker::park_paused).
pub trait Park: Queue {
    /// Takes the leased `delivery` out of the due set, parked under
    /// `prefix`, in one durable write; the attempt does not count.
    /// A parked entry of an order group still holds its group's later
    /// entries back. `Some(true)` parked, `Some(false)` the lease was lost,
    /// `None` not parked: postpone it instead.
    fn park(
        &self,
        delivery: &Delivery,
        prefix: &str,
    ) -> impl Future<Output = Result<Option<bool>, QueueError>> + Send;

    /// Puts every entry parked under `prefix` back into the due set, due
    /// now (delivered paced as usual); how many. Safe to run from several
    /// instances at once: each parked entry goes back once.
    fn wake(&self, prefix: &str) -> impl Future<Output = Result<u64, QueueError>> + Send;

    /// The prefixes that have entries parked under them.
    fn parked(&self) -> impl Future<Output = Result<Vec<String>, QueueError>> + Send;
}

/// A parking call ready to run.
type Parking = std::pin::Pin<Box<dyn Future<Output = Option<Result<bool, QueueError>>> + Send>>;

/// How a [`Worker`](crate::Worker) parks a paused route's delivery: the
/// queue (one that parks) and which paused prefix a message is under.
#[derive(Clone)]
pub(crate) struct Parker(std::sync::Arc<ParkFn>);

/// Starts parking a delivery, or says it is not to be parked.
type ParkFn = dyn Fn(&Delivery) -> Option<Parking> + Send + Sync;

impl std::fmt::Debug for Parker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Parker")
    }
}

impl Parker {
    pub(super) fn new<P: Park>(
        queue: P,
        prefix_of: impl Fn(&crate::Message) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self(std::sync::Arc::new(move |d: &Delivery| {
            let prefix = prefix_of(&d.message)?;
            let (q, d) = (queue.clone(), d.clone());
            Some(Box::pin(async move { q.park(&d, &prefix).await.transpose() }) as Parking)
        }))
    }

    /// Parks `delivery`: `Some(Ok(held))` parked (or its lease lost),
    /// `None` not parked (postpone it).
    pub(super) async fn park(&self, delivery: &Delivery) -> Option<Result<bool, QueueError>> {
        (self.0)(delivery)?.await
    }
}

#[cfg(test)]
mod tests {
    use crate::Park;
    use crate::{Ingested, MemoryQueue, Message, Queue};
    use std::time::Duration;
    use tower_idempotency::Fingerprint;

    fn message(key: &str, order: Option<&str>) -> Message {
        let m = Message::new(key, Fingerprint::of(key.as_bytes()), "{}");
        match order {
            Some(o) => m.order(o),
            None => m,
        }
    }

    /// Parked: not fetched, counted in the depth, the attempt uncounted;
    /// woken once (a second wake finds nothing), then due at once; a parked
    /// entry of an order group still holds its group's later entries back.
    #[tokio::test(flavor = "current_thread")]
    async fn parked_entries_wait_for_their_wake_and_keep_their_order() {
        let q = MemoryQueue::new();
        let lease = Duration::from_secs(30);
        for (key, order) in [("a", Some("g")), ("b", None), ("c", Some("g"))] {
            let got = q.ingest(message(key, order)).await.unwrap();
            assert!(matches!(got, Ingested::Queued(_)));
        }
        // "c" waits behind "a", its group's earlier entry.
        let first = q.fetch(10, lease).await.unwrap();
        let keys: Vec<&str> = first.iter().map(|d| d.message.key.as_str()).collect();
        assert_eq!(keys, ["a", "b"]);
        for d in &first {
            assert_eq!(q.park(d, "/wx").await.unwrap(), Some(true));
            assert_eq!(q.park(d, "/wx").await.unwrap(), Some(false), "parked twice");
        }
        assert_eq!(q.parked().await.unwrap(), ["/wx"]);
        assert_eq!(q.stats().await.unwrap().depth, 3);
        assert!(q.fetch(10, lease).await.unwrap().is_empty(), "c passed a");
        assert_eq!(q.wake("/wy").await.unwrap(), 0);
        assert_eq!(q.wake("/wx").await.unwrap(), 2);
        assert_eq!(q.wake("/wx").await.unwrap(), 0, "woken twice");
        assert!(q.parked().await.unwrap().is_empty());
        let again = q.fetch(10, lease).await.unwrap();
        let keys: Vec<(&str, u32)> = again
            .iter()
            .map(|d| (d.message.key.as_str(), d.attempt))
            .collect();
        assert_eq!(keys, [("a", 1), ("b", 1)], "the parked attempt counted");
        for d in &again {
            assert!(q.ack(d).await.unwrap());
        }
        let last = q.fetch(10, lease).await.unwrap();
        assert_eq!(last.len(), 1);
        assert_eq!(last[0].message.key, "c");
    }
}
