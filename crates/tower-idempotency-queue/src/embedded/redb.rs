//! [`RedbQueue`]: the embedded durable queue, one file on one node.

use super::delegate::embedded_queue;
use super::store::Embedded;
use crate::{DeadLetter, Delivery, EntryId, Ingested, Message, QueueError, QueueStats};
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
/// For many instances, use a shared queue (Redis Streams) instead.
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
#[derive(Debug, Clone)]
pub struct RedbQueue {
    inner: Embedded,
}

impl RedbQueue {
    /// Opens the queue file at `path`, creating it if it does not exist.
    /// Fails if another process has it open.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, QueueError> {
        let db = redb::Database::create(path.as_ref()).map_err(|e| {
            QueueError::backend(format_args!("open {}", path.as_ref().display()), e)
        })?;
        Ok(Self {
            inner: Embedded::new(
                db,
                Some(path.as_ref().to_owned()),
                Duration::from_secs(25 * 3600),
            )?,
        })
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

    /// How long a delivered key is remembered, so that a late copy of it is
    /// not queued again. Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.inner.set_window(window);
        self
    }
}

embedded_queue!(RedbQueue);
