//! [`MemoryQueue`]: the same queue in memory, for tests only.

use super::redb::{InMemory, RedbQueue};
use super::store::Embedded;
use std::time::Duration;

/// A queue that lives in memory: **for tests only**. It is lost with the
/// process, so an acknowledgement given after its `ingest` would be a false
/// one; acknowledge after a [`RedbQueue`] on disk (or a shared queue)
/// instead. The same queue as `RedbQueue`, over memory.
pub type MemoryQueue = RedbQueue<InMemory>;

impl RedbQueue<InMemory> {
    /// An empty queue in memory.
    pub fn new() -> Self {
        let db = redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .expect("an in-memory database opens");
        Self::with(
            Embedded::new(db, None, Duration::from_secs(25 * 3600)).expect("tables are created"),
        )
    }
}

impl Default for RedbQueue<InMemory> {
    fn default() -> Self {
        Self::new()
    }
}
