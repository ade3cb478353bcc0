//! Room to drain: the free space the embedded queue keeps on its disk.
//!
//! redb is copy-on-write: even a delete writes new pages before it frees
//! the old ones, so a queue whose disk is full cannot settle what it
//! delivers. New entries are refused (an [`unwritable`] error) while less
//! than the reserve is free, checked with `statvfs` before each group of
//! ingests; the entries already queued keep the room to be delivered. After
//! a write failed for want of space, ingests also wait until more is free
//! than was then (whatever the reserve), so that a queue with no reserve
//! does not fill its disk again at once.
//!
//! [`unwritable`]: crate::QueueError::unwritable

use crate::QueueError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// The reserve of one queue's file system.
#[derive(Debug, Default)]
pub(super) struct Room {
    /// A path on the file system (none: in memory, nothing is checked).
    at: Option<PathBuf>,
    /// Bytes kept free.
    reserve: AtomicU64,
    /// One byte more than was free when a write last failed for want of
    /// space (0: none since the last stored ingest).
    floor: AtomicU64,
}

impl Room {
    /// The room of the file system holding `at`.
    pub(super) fn on(at: PathBuf) -> Self {
        Self {
            at: Some(at),
            ..Self::default()
        }
    }

    pub(super) fn set_reserve(&self, bytes: u64) {
        self.reserve.store(bytes, Ordering::Relaxed);
    }

    /// Bytes free for this process on the file system, if known.
    fn free(&self) -> Option<u64> {
        available(self.at.as_ref()?)
    }

    /// `Err` (unwritable) while less than the reserve (or the floor) is
    /// free: new entries are refused.
    pub(super) fn check(&self) -> Result<(), QueueError> {
        let reserve = self.reserve.load(Ordering::Relaxed);
        let floor = self.floor.load(Ordering::Relaxed);
        if reserve == 0 && floor == 0 {
            return Ok(());
        }
        let Some(free) = self.free() else {
            return Ok(());
        };
        if free >= reserve.max(floor) {
            return Ok(());
        }
        Err(QueueError::unwritable(if free < reserve {
            format!(
                "embedded queue: {free} bytes free on its disk, under the reserve of {reserve}: new entries are refused so that the queued ones can still be delivered"
            )
        } else {
            format!(
                "embedded queue: its disk was full at the last write and has no more room now ({free} bytes free): new entries are refused until space is freed"
            )
        }))
    }

    /// A write failed for want of space: ingests wait for more room.
    pub(super) fn full(&self) {
        if let Some(free) = self.free() {
            self.floor.store(free.saturating_add(1), Ordering::Relaxed);
        }
    }

    /// An ingest was stored: the disk has room again.
    pub(super) fn stored(&self) {
        self.floor.store(0, Ordering::Relaxed);
    }
}

#[cfg(unix)]
fn available(at: &std::path::Path) -> Option<u64> {
    let st = rustix::fs::statvfs(at).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Not checked off Unix.
#[cfg(not(unix))]
fn available(_at: &std::path::Path) -> Option<u64> {
    None
}

/// Whether `e` says the disk (or the quota) is full.
pub(super) fn is_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || e.kind() == std::io::ErrorKind::QuotaExceeded
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn refuses_under_the_reserve_or_the_floor() {
        let room = Room::on(std::env::temp_dir());
        assert!(room.check().is_ok(), "no reserve: never checked");
        let free = room.free().expect("statvfs of the temp dir");
        room.set_reserve(free.saturating_mul(2).max(1 << 40));
        let e = room.check().unwrap_err();
        assert!(e.is_unwritable(), "{e}");
        assert!(e.to_string().contains("under the reserve"), "{e}");
        room.set_reserve(0);
        assert!(room.check().is_ok());
        // Failed for want of space: refused until more is free than then.
        room.full();
        assert!(room.floor.load(Ordering::Relaxed) > 0);
        room.floor.store(u64::MAX, Ordering::Relaxed);
        let e = room.check().unwrap_err();
        assert!(
            e.is_unwritable() && e.to_string().contains("was full"),
            "{e}"
        );
        room.stored();
        assert!(room.check().is_ok());
        // In memory: nothing to check.
        let memory = Room::default();
        memory.set_reserve(u64::MAX);
        assert!(memory.check().is_ok());
    }
}
