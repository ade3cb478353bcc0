//! [`MemoryQueue`]: the same queue in memory, for tests only.

use super::delegate::embedded_queue;
use super::store::Embedded;
use crate::{DeadLetter, Delivery, EntryId, Ingested, Message, QueueError, QueueStats};
use std::time::Duration;

/// A queue that lives in memory: **for tests only**. It is lost with the
/// process, so an acknowledgement given after its `ingest` would be a false
/// one; acknowledge after a [`RedbQueue`](crate::RedbQueue) (or a shared
/// queue) instead. Same logic as `RedbQueue`, over memory.
#[derive(Debug, Clone)]
pub struct MemoryQueue {
    inner: Embedded,
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new() -> Self {
        let db = redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .expect("an in-memory database opens");
        Self {
            inner: Embedded::new(db, None, Duration::from_secs(25 * 3600))
                .expect("tables are created"),
        }
    }

    /// How long a delivered key is remembered. Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.inner.set_window(window);
        self
    }
}

impl Default for MemoryQueue {
    fn default() -> Self {
        Self::new()
    }
}

embedded_queue!(MemoryQueue);
