//! Whether the embedded queue can write, said while it cannot: a warning a
//! minute (not one per failed call), the count of failed writes, and
//! `writable` in its [`QueueStats`] (the gauge `idempotency_queue_writable`).

use super::room::Room;
use crate::{QueueError, QueueStats};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a queue that cannot write says so.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The write health of one embedded queue.
#[derive(Debug, Default)]
pub(super) struct Health {
    pub(super) room: Room,
    /// A write failed on the storage and the file is not reopened yet.
    failing: AtomicBool,
    /// Writes that failed on the storage.
    errors: AtomicU64,
    /// A write failed and none committed since.
    troubled: AtomicBool,
    /// When the last warning was logged, and how many were held back since.
    warned: Mutex<(Option<Instant>, u64)>,
    /// The last stats read, for while the file cannot be read.
    last: Mutex<QueueStats>,
}

impl Health {
    pub(super) fn new(room: Room) -> Self {
        Self {
            room,
            ..Self::default()
        }
    }

    /// Whether new entries can be stored now.
    pub(super) fn writable(&self) -> bool {
        !self.failing.load(Ordering::Relaxed) && self.room.check().is_ok()
    }

    /// A write failed on the storage (`full`: for want of space): the file
    /// is closed and reopened until it works again.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(super) fn failed(&self, e: &QueueError, full: bool) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if full {
            self.room.full();
        }
        self.failing.store(true, Ordering::Relaxed);
        self.troubled.store(true, Ordering::Relaxed);
        self.warn(|_held| {
            crate::log_warn!(error = %e, held_back = _held, "the embedded queue cannot write: it reopens its file until it can (what it stored is kept); new notifications get the failure reply meanwhile (the channel retries them). Free space on its disk");
        });
    }

    /// The file was reopened, or still cannot be.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(super) fn reopened(&self, result: &Result<(), QueueError>) {
        match result {
            Ok(()) => self.failing.store(false, Ordering::Relaxed),
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.warn(|_held| {
                    crate::log_warn!(error = %e, held_back = _held, "the embedded queue still cannot reopen its file; trying again (what it stored is kept). Free space on its disk");
                });
            }
        }
    }

    /// A commit succeeded: said once after a failure.
    pub(super) fn committed(&self) {
        if self.troubled.swap(false, Ordering::Relaxed) {
            let _refusing = self.room.check().err();
            crate::log_info!(
                new_entries = _refusing.as_ref().map_or("stored".to_owned(), |e| format!("refused: {e}")),
                "the embedded queue writes again: it reopened its file at its last commit and delivers and settles as before"
            );
        }
    }

    /// Ingests were refused for want of room (see [`Room::check`]).
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(super) fn refused(&self, e: &QueueError) {
        self.warn(|_held| {
            crate::log_warn!(error = %e, held_back = _held, "new notifications get the failure reply (the channel retries them) while the embedded queue's disk is this full; free space on it, or lower the reserve");
        });
    }

    /// Logs with `warn` if none was logged in the last minute (with the
    /// number held back since), else holds it back.
    fn warn(&self, warn: impl FnOnce(u64)) {
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        let (at, held) = &mut *warned;
        if at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            *held += 1;
            return;
        }
        warn(*held);
        *at = Some(Instant::now());
        *held = 0;
    }

    /// `read` with the health filled in; while the file cannot be read for
    /// a failed write (it is being reopened), the last stats read.
    pub(super) fn stats(
        &self,
        read: Result<QueueStats, QueueError>,
    ) -> Result<QueueStats, QueueError> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match read {
            Ok(stats) => *last = stats,
            Err(e) if !self.failing.load(Ordering::Relaxed) => return Err(e),
            Err(_) => {}
        }
        Ok(QueueStats {
            writable: Some(self.writable()),
            write_errors: self.errors.load(Ordering::Relaxed),
            ..*last
        })
    }
}
