//! The embedded queue's database, closed and opened again after a failed
//! write.
//!
//! Once a write fails on the storage (a full disk, an I/O error), redb
//! refuses every later transaction ("Previous I/O error occurred. Please
//! close and re-open the database."). The commit thread then closes the file
//! and opens it again, with a backoff, until that works: redb reopens at the
//! last committed transaction, so nothing it confirmed is lost, and the
//! queue goes on where it left off.

use super::health::Health;
use super::records::err;
use super::QueueError;
use redb::{Database, StorageError, TransactionError, WriteTransaction};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// How long a reopen waits for the reads still holding the old file.
const READERS_WAIT: Duration = Duration::from_secs(5);

/// The database of one embedded queue, and its write health.
#[derive(Debug)]
pub(super) struct Db {
    /// None while it is being reopened.
    current: RwLock<Option<Arc<Database>>>,
    /// Where it is reopened from (none: in memory, never reopened).
    path: Option<PathBuf>,
    pub(super) health: Health,
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
            health,
        })
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
        let Some(path) = &self.path else {
            return Err(err("in memory: nothing to reopen"));
        };
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
                        return Err(err("reads still hold the old file"));
                    }
                }
            }
        }
        let db = Database::create(path)
            .map_err(|e| QueueError::unwritable(format!("reopen {}: {e}", path.display())))?;
        tables(&db).map_err(|e| QueueError::unwritable(e.to_string()))?;
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
    use super::embedded::{DEAD, EXPIRY, KEYS, MESSAGES, META, STATE};
    txn.open_table(STATE).map_err(err)?;
    txn.open_table(MESSAGES).map_err(err)?;
    txn.open_table(KEYS).map_err(err)?;
    txn.open_table(EXPIRY).map_err(err)?;
    txn.open_table(DEAD).map_err(err)?;
    txn.open_table(META).map_err(err)?;
    Ok(())
}
