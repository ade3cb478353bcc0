//! [`RedbQueue`]: the embedded durable queue, one file on one node.

use super::store::Embedded;
use crate::{
    DeadLetter, Delivery, EntryId, Ingested, Message, Park, Queue, QueueError, QueueStats,
};
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::time::Duration;

/// A durable queue in one file, for a single node.
///
/// Built on [redb](https://docs.rs/redb), chosen over SQLite because it is
/// pure Rust (no C library to build or link, nothing to configure), its
/// copy-on-write B-trees commit atomically with a checksummed header flip, so
/// a process killed with `kill -9` (or a power cut) reopens at the last
/// committed transaction with no recovery step to run, and it locks its file
/// so that a second process cannot open it by mistake. Every
/// [`ingest`](crate::Queue::ingest) is committed and fsynced before it
/// returns, so an acknowledgement given after it is true; so is every
/// [`ack`](crate::Queue::ack), retry and dead letter, so a crash redelivers
/// at most the entries whose `ack` had not returned. Concurrent changes
/// share one commit (group commit), so a storm costs one disk flush per
/// group, not one per notification, and so do the acknowledgements of a
/// [`Worker`](crate::Worker)'s round.
///
/// For many instances, use a shared queue (Redis Streams) instead. For
/// tests, the same queue in memory is [`MemoryQueue`](crate::MemoryQueue)
/// (a `RedbQueue<InMemory>`).
///
/// ```
/// use tower_idempotency_queue::{Ingested, Message, Queue, RedbQueue};
/// use tower_idempotency::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let dir = std::env::temp_dir().join(format!("redb-queue-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// let path = dir.join("queue.redb");
/// let queue = RedbQueue::open(&path).unwrap();
/// let got = queue.ingest(Message::new("k1", Fingerprint::of(b"1"), "hello")).await.unwrap();
/// assert!(matches!(got, Ingested::Queued(_)));
/// drop(queue);
/// // Reopened, the entry is still there.
/// let queue = RedbQueue::open(&path).unwrap();
/// assert_eq!(queue.stats().await.unwrap().depth, 1);
/// # drop(queue); std::fs::remove_dir_all(&dir).unwrap();
/// # }
/// ```
pub struct RedbQueue<S = OnDisk> {
    inner: Embedded,
    storage: PhantomData<fn() -> S>,
}

/// Where a [`RedbQueue`] keeps its database: in a file, durable (the
/// default; see [`RedbQueue::open`]).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct OnDisk;

/// Where a [`RedbQueue`] keeps its database: in memory, lost with the
/// process, **for tests only** (see [`MemoryQueue`](crate::MemoryQueue)).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct InMemory;

impl<S> RedbQueue<S> {
    pub(super) fn with(inner: Embedded) -> Self {
        Self {
            inner,
            storage: PhantomData,
        }
    }

    /// How long a delivered key is remembered, so that a late copy of it is
    /// not queued again. Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.inner.set_window(window);
        self
    }
}

impl<S> Clone for RedbQueue<S> {
    fn clone(&self) -> Self {
        Self::with(self.inner.clone())
    }
}

impl<S> fmt::Debug for RedbQueue<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbQueue")
            .field("inner", &self.inner)
            .finish()
    }
}

impl RedbQueue<OnDisk> {
    /// Opens the queue file at `path`, creating it if it does not exist.
    /// Fails if another process has it open.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, QueueError> {
        let db = redb::Database::create(path.as_ref()).map_err(|e| {
            QueueError::backend(format_args!("open {}", path.as_ref().display()), e)
        })?;
        Ok(Self::with(Embedded::new(
            db,
            Some(path.as_ref().to_owned()),
            Duration::from_secs(25 * 3600),
        )?))
    }

    /// Keeps `bytes` free on the file system holding the queue: while less
    /// is free, [`ingest`](crate::Queue::ingest) is refused with an
    /// [unwritable](QueueError::is_unwritable) error (acknowledge nothing:
    /// answer the channel's failure reply, it sends the notification again),
    /// checked before each group of ingests. redb is copy-on-write, so even
    /// settling a delivery writes new pages first: the reserve keeps the
    /// room to deliver what is queued. Checked on Unix (`statvfs`). Defaults
    /// to 0 (none).
    ///
    /// Whatever the reserve, after a write failed for want of space new
    /// entries wait until more is free than was then, and after any failed
    /// write the queue closes and reopens its file (with a backoff) until it
    /// works again, at its last commit: nothing it confirmed is lost.
    pub fn reserve(self, bytes: u64) -> Self {
        self.inner.set_reserve(bytes);
        self
    }

    /// Whether the queue can store new entries now: `false` while its disk
    /// is full or failing, or while less than the [`reserve`](Self::reserve)
    /// is free. The same as [`QueueStats::writable`].
    pub fn writable(&self) -> bool {
        self.inner.writable()
    }

    /// Bytes of the file in use (allocated pages, whatever the file's
    /// preallocated length), to size disks and measure entries.
    pub fn allocated_bytes(&self) -> Result<u64, QueueError> {
        self.inner.allocated_bytes()
    }
}

/// Every change goes through the group commit of the queue's database.
impl<S: 'static> Queue for RedbQueue<S> {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        self.inner.ingest_message(message).await
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        self.inner
            .grouped_fetch(move |txn| Embedded::fetch(txn, max, lease))
            .await
    }

    async fn renew(&self, delivery: &Delivery, lease: Duration) -> Result<bool, QueueError> {
        let d = delivery.clone();
        self.inner
            .grouped(move |txn| Embedded::renew(txn, &d, lease))
            .await
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        let (d, window) = (delivery.clone(), self.inner.window());
        self.inner
            .grouped(move |txn| Embedded::ack(txn, &d, window))
            .await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        let (d, error) = (delivery.clone(), error.to_owned());
        self.inner
            .grouped(move |txn| Embedded::retry(txn, &d, after, Some(&error)))
            .await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        _error: &str,
    ) -> Result<bool, QueueError> {
        let d = delivery.clone();
        self.inner
            .grouped(move |txn| Embedded::retry(txn, &d, after, None))
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        let (d, error) = (delivery.clone(), error.to_owned());
        self.inner
            .grouped(move |txn| Embedded::dead_letter(txn, &d, &error))
            .await
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let q = self.inner.clone();
        tokio::task::spawn_blocking(move || q.dead_letters(limit))
            .await
            .map_err(|e| QueueError::backend("embedded queue", e))?
    }

    async fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        // An id that is no number of this queue's comes before all.
        let after = after.map(|a| a.as_str().parse::<u64>().unwrap_or(0));
        let q = self.inner.clone();
        tokio::task::spawn_blocking(move || q.dead_page(after, limit))
            .await
            .map_err(|e| QueueError::backend("embedded queue", e))?
    }

    async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        let Ok(id) = id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        let q = self.inner.clone();
        tokio::task::spawn_blocking(move || q.find_dead(id))
            .await
            .map_err(|e| QueueError::backend("embedded queue", e))?
    }

    async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        let Ok(id) = id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        self.inner
            .grouped(move |txn| Embedded::delete_dead(txn, id))
            .await
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        let Ok(id) = id.as_str().parse::<u64>() else {
            return Ok(false);
        };
        self.inner
            .grouped(move |txn| Embedded::replay(txn, id, None))
            .await
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        self.inner.grouped(Embedded::replay_all).await
    }

    async fn replay_with(&self, id: &EntryId, reseal: &crate::Reseal) -> Result<bool, QueueError> {
        let Some(letter) = <Self as Queue>::find_dead(self, id).await? else {
            return Ok(false);
        };
        let Ok(id) = id.as_str().parse::<u64>() else {
            return Ok(false);
        };
        // A letter's record never changes: what was read is what
        // the replay removes.
        let message = reseal(&letter.message);
        self.inner
            .grouped(move |txn| Embedded::replay(txn, id, message.clone()))
            .await
    }

    async fn replay_all_with(&self, reseal: &crate::Reseal) -> Result<usize, QueueError> {
        crate::seal::replay_each(self, reseal).await
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let q = self.inner.clone();
        tokio::task::spawn_blocking(move || q.stats())
            .await
            .map_err(|e| QueueError::backend("embedded queue", e))?
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
        let key = key.to_owned();
        // A refusal is the change's answer, not its failure: the
        // changes committed with it are kept.
        self.inner
            .grouped(move |txn| Embedded::forget(txn, &key))
            .await?
            .map_err(|why| QueueError::new(crate::QueueErrorKind::Conflict, why))
    }
}

impl<S: 'static> Park for RedbQueue<S> {
    async fn park(&self, delivery: &Delivery, prefix: &str) -> Result<Option<bool>, QueueError> {
        let (d, prefix) = (delivery.clone(), prefix.to_owned());
        self.inner
            .grouped(move |txn| Embedded::park(txn, &d, &prefix))
            .await
    }

    async fn wake(&self, prefix: &str) -> Result<u64, QueueError> {
        let prefix = prefix.to_owned();
        self.inner
            .grouped(move |txn| Embedded::wake(txn, &prefix))
            .await
    }

    async fn parked(&self) -> Result<Vec<String>, QueueError> {
        let q = self.inner.clone();
        tokio::task::spawn_blocking(move || q.parked())
            .await
            .map_err(|e| QueueError::backend("embedded queue", e))?
    }
}
