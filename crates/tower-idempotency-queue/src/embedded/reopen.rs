//! The embedded queue's database, closed and opened again after a failed
//! write.
//!
//! Once a write fails on the storage (a full disk, an I/O error), redb
//! refuses every later transaction ("Previous I/O error occurred. Please
//! close and re-open the database."). The commit thread then closes the file
//! and opens it again, with a backoff, until that works: redb reopens at the
//! last committed transaction, so nothing it confirmed is lost, and the
//! queue goes on where it left off.
//!
//! What it reads back may hold more than it confirmed: after a failed
//! `fsync` the kernel can keep the pages that failed in its cache, marked
//! clean, so the reopened file shows a commit whose caller was told it
//! failed, and that a crash can still lose. The queue therefore answers no
//! duplicate from such state: once reopened, an ingest that finds its key
//! writes the key's marker and entry again, and hears back only once that
//! commit is durable (see [`Db::reopened`]).

use super::health::Health;
use super::records::{err, fail};
use crate::{QueueError, QueueErrorKind};
use redb::{Database, StorageError, TransactionError, WriteTransaction};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// How long a reopen waits for the reads still holding the old file.
const READERS_WAIT: Duration = Duration::from_secs(5);

/// The database of one embedded queue, and its write health.
pub(super) struct Db {
    /// None while it is being reopened.
    current: RwLock<Option<Arc<Database>>>,
    /// Where it is reopened from (none: in memory, never reopened).
    path: Option<PathBuf>,
    /// How it is opened again, for a database on a storage backend of its
    /// own (tests of failing storage).
    #[cfg(test)]
    opener: Option<Opener>,
    /// Whether the file was reopened after a failed write: what it reads
    /// back may come from a commit that failed.
    reopened: AtomicBool,
    pub(super) health: Health,
}

/// Opens a database on a storage backend again.
#[cfg(test)]
pub(super) type Opener = Box<dyn Fn() -> Result<Database, QueueError> + Send + Sync>;

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("path", &self.path)
            .field("reopened", &self.reopened)
            .field("health", &self.health)
            .finish_non_exhaustive()
    }
}

impl Db {
    /// `db`, with its tables created; `path` is its file.
    pub(super) fn new(
        db: Database,
        path: Option<PathBuf>,
        health: Health,
    ) -> Result<Self, QueueError> {
        tables(&db)?;
        Ok(Self {
            current: RwLock::new(Some(Arc::new(db))),
            path,
            #[cfg(test)]
            opener: None,
            reopened: AtomicBool::new(false),
            health,
        })
    }

    /// `db` on a storage backend that `opener` opens again.
    #[cfg(test)]
    pub(super) fn with_opener(
        db: Database,
        opener: Opener,
        health: Health,
    ) -> Result<Self, QueueError> {
        let mut db = Self::new(db, None, health)?;
        db.opener = Some(opener);
        Ok(db)
    }

    /// Whether the file was reopened after a failed write since this
    /// process opened it: from then on a key found in it may be one that
    /// only a failed commit wrote, so an ingest that finds it writes it
    /// again (its answer waits for that commit to be durable).
    pub(super) fn reopened(&self) -> bool {
        self.reopened.load(Ordering::Acquire)
    }

    /// The database now; an unwritable error while it is being reopened.
    pub(super) fn get(&self) -> Result<Arc<Database>, QueueError> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current
            .clone()
            .ok_or_else(|| QueueError::unwritable("embedded queue: its file is being reopened"))
    }

    /// Closes the file and opens it again (redb recovers it to its last
    /// commit); on `Err` the queue stays closed, for the next try.
    pub(super) fn reopen(&self) -> Result<(), QueueError> {
        #[cfg(test)]
        let opener = self.opener.as_ref();
        #[cfg(not(test))]
        let opener: Option<&fn() -> Result<Database, QueueError>> = None;
        if self.path.is_none() && opener.is_none() {
            return Err(fail(
                QueueErrorKind::Unsupported,
                "in memory: nothing to reopen",
            ));
        }
        let taken = self
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(mut old) = taken {
            // The file is locked until its last reader lets it go.
            let deadline = Instant::now() + READERS_WAIT;
            loop {
                match Arc::try_unwrap(old) {
                    Ok(db) => {
                        drop(db);
                        break;
                    }
                    Err(still) if Instant::now() < deadline => {
                        old = still;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(still) => {
                        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(still);
                        return Err(fail(
                            QueueErrorKind::Unwritable,
                            "reads still hold the old file",
                        ));
                    }
                }
            }
        }
        let db = match (&self.path, opener) {
            (Some(path), _) => Database::create(path).map_err(|e| {
                QueueError::unwritable(format!("reopen {}: {e}", path.display())).with_source(e)
            })?,
            (None, Some(open)) => open()?,
            (None, None) => {
                return Err(fail(
                    QueueErrorKind::Unsupported,
                    "in memory: nothing to reopen",
                ));
            }
        };
        tables(&db).map_err(|e| QueueError::unwritable(e.to_string()).with_source(e))?;
        self.reopened.store(true, Ordering::Release);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(db));
        Ok(())
    }
}

/// Whether `db` refuses every transaction since a write failed.
pub(super) fn poisoned(db: &Database) -> bool {
    match db.begin_write() {
        Ok(txn) => {
            let _ = txn.abort();
            false
        }
        Err(TransactionError::Storage(StorageError::PreviousIo)) => true,
        Err(_) => false,
    }
}

/// Creates the queue's tables (a write transaction: it also proves that the
/// file takes writes).
fn tables(db: &Database) -> Result<(), QueueError> {
    let txn = db.begin_write().map_err(err)?;
    open_tables(&txn)?;
    txn.commit().map_err(err)
}

fn open_tables(txn: &WriteTransaction) -> Result<(), QueueError> {
    use super::store::{ATTEMPTS, DEAD, DEAD_ATTEMPTS, EXPIRY, KEYS, MESSAGES, META, STATE};
    txn.open_table(STATE).map_err(err)?;
    txn.open_table(ATTEMPTS).map_err(err)?;
    txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
    txn.open_table(super::store::PARKED).map_err(err)?;
    txn.open_table(super::store::PARKED_PREFIXES).map_err(err)?;
    txn.open_table(super::store::PARKED_ORDERS).map_err(err)?;
    txn.open_table(MESSAGES).map_err(err)?;
    txn.open_table(KEYS).map_err(err)?;
    txn.open_table(EXPIRY).map_err(err)?;
    txn.open_table(DEAD).map_err(err)?;
    txn.open_table(META).map_err(err)?;
    Ok(())
}
