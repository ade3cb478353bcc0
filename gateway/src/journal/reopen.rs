//! A redb database that recovers from an I/O error without a restart.
//!
//! Once a write fails (a full disk), redb refuses every later transaction
//! with "Previous I/O error occurred. Please close and re-open the
//! database." [`Reopen`] closes it then, and opens it again (what was
//! committed before the error is there) after a backoff of 1 s doubling to
//! 30 s, until it opens; meanwhile [`Reopen::get`] answers `None`, so that
//! callers drop their work at once instead of waiting. Errors are logged at
//! most once a minute (with how many there were), not once per attempt.

use redb::{Database, DatabaseError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The first wait before a reopen; doubled after each failed one.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between reopens.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// At most one warning this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

type Opener = dyn Fn() -> Result<Database, DatabaseError> + Send + Sync;

/// A redb database, closed after an I/O error and opened again.
pub(crate) struct Reopen {
    what: &'static str,
    open: Box<Opener>,
    state: Mutex<State>,
}

struct State {
    db: Option<Arc<Database>>,
    /// Failed reopens in a row.
    failures: u32,
    retry_at: Instant,
    warned_at: Option<Instant>,
    /// Errors since the last warning.
    unlogged: u64,
}

/// Whether `error` (a redb error as text) means the database must be closed
/// and opened again.
pub(crate) fn needs_reopen(error: &str) -> bool {
    error.contains("Previous I/O error") || error.contains("I/O error")
}

impl Reopen {
    /// Opens the database with `open` now; `what` names it in the log.
    pub(crate) fn new(
        what: &'static str,
        open: impl Fn() -> Result<Database, DatabaseError> + Send + Sync + 'static,
    ) -> Result<Self, DatabaseError> {
        let db = open()?;
        Ok(Self {
            what,
            open: Box::new(open),
            state: Mutex::new(State {
                db: Some(Arc::new(db)),
                failures: 0,
                retry_at: Instant::now(),
                warned_at: None,
                unlogged: 0,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The database; while it is closed after an error, `None` until the
    /// backoff has passed and it opens again.
    pub(crate) fn get(&self) -> Option<Arc<Database>> {
        let mut st = self.state();
        if st.db.is_none() && Instant::now() >= st.retry_at {
            match (self.open)() {
                Ok(db) => {
                    st.db = Some(Arc::new(db));
                    st.failures = 0;
                    tracing::info!(
                        what = self.what,
                        "re-opened after an I/O error: writing again"
                    );
                }
                Err(_e) => {
                    st.failures = st.failures.saturating_add(1);
                    st.retry_at = Instant::now() + backoff(st.failures);
                    self.warn(&mut st, &_e.to_string());
                }
            }
        }
        st.db.clone()
    }

    /// Reports an error of `db` (as text): when it means the database must
    /// be opened again, it is closed (the next [`get`](Self::get) after the
    /// backoff opens it). Logged at most once a minute.
    pub(crate) fn failed(&self, db: &Arc<Database>, error: &str) {
        let mut st = self.state();
        if needs_reopen(error) && st.db.as_ref().is_some_and(|d| Arc::ptr_eq(d, db)) {
            st.db = None;
            st.retry_at = Instant::now() + backoff(st.failures.max(1));
        }
        self.warn(&mut st, error);
    }

    fn warn(&self, st: &mut State, _error: &str) {
        st.unlogged += 1;
        let due = st.warned_at.is_none_or(|at| at.elapsed() >= WARN_EVERY);
        if due {
            let _errors = std::mem::take(&mut st.unlogged);
            let _what = self.what;
            tracing::warn!(
                what = _what,
                error = _error,
                errors = _errors,
                "cannot write (closed and re-opened with a backoff until it can; this warning at most once a minute)"
            );
            st.warned_at = Some(Instant::now());
        }
    }

    /// Whether the database is open (not waiting to be opened again).
    #[cfg(test)]
    pub(crate) fn is_open(&self) -> bool {
        self.state().db.is_some()
    }
}

fn backoff(failures: u32) -> Duration {
    let doubled = FIRST_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(5));
    doubled.min(MAX_BACKOFF)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use redb::backends::InMemoryBackend;
    use redb::StorageBackend;
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Memory that refuses every write while `full` is set (a full disk);
    /// shared by every database opened on it, like a file.
    #[derive(Debug, Clone)]
    pub(crate) struct Disk {
        memory: Arc<InMemoryBackend>,
        pub(crate) full: Arc<AtomicBool>,
    }

    impl Disk {
        pub(crate) fn new() -> Self {
            Self {
                memory: Arc::new(InMemoryBackend::new()),
                full: Arc::default(),
            }
        }

        pub(crate) fn open(&self) -> Result<Database, DatabaseError> {
            Database::builder().create_with_backend(self.clone())
        }

        fn check(&self) -> io::Result<()> {
            if self.full.load(Ordering::Relaxed) {
                return Err(io::Error::other("No space left on device"));
            }
            Ok(())
        }
    }

    impl StorageBackend for Disk {
        fn len(&self) -> io::Result<u64> {
            self.memory.len()
        }
        fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
            self.memory.read(offset, len)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.check()?;
            self.memory.set_len(len)
        }
        fn sync_data(&self, eventual: bool) -> io::Result<()> {
            self.check()?;
            self.memory.sync_data(eventual)
        }
        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            self.check()?;
            self.memory.write(offset, data)
        }
    }

    #[test]
    fn backoff_doubles_to_thirty_seconds() {
        let waits: Vec<u64> = (1..=8).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
    }
}
