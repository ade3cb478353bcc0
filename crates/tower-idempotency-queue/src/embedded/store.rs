//! The queue logic over one redb database (a file, or memory for tests).
//!
//! Tables: `state` (id → attempts, due time, lease, enqueued time, order
//! group hash: fixed 36 bytes, scanned by `fetch`), `messages` (id → encoded
//! message, read only for the entries handed out), `keys` (key →
//! fingerprint, live entry id, expiry), `expiry` ((expiry, key) → ()),
//! `dead` (id → attempts, time, error, message), `attempts` and
//! `dead_attempts` (id → the entry's failed attempts, see
//! `attempts::History`; absent for an entry that has not failed, or that
//! an earlier version wrote), `meta` (next id). Every
//! change runs in a write transaction of the group commit: atomic, and
//! durable before its caller hears back.

use super::group::{Committer, Kind};
use super::health::Health;
use super::records::{err, queue_now, queue_now_read, Marker, State};
use super::reopen::Db;
use super::room::Room;
use crate::attempts::History;
use crate::common::time_of;
use crate::{Delivery, EntryId, Ingested, Message, QueueError, QueueStats};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction};
use std::collections::HashSet;
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub(super) const STATE: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("state");
pub(super) const MESSAGES: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("messages");
pub(super) const KEYS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("keys");
pub(super) const EXPIRY: TableDefinition<'_, (u64, &str), ()> = TableDefinition::new("expiry");
pub(super) const DEAD: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("dead");
pub(super) const ATTEMPTS: TableDefinition<'_, u64, &str> = TableDefinition::new("attempts");
pub(super) const DEAD_ATTEMPTS: TableDefinition<'_, u64, &str> =
    TableDefinition::new("dead_attempts");
/// Entries parked under a paused route's prefix: (prefix, id) → state.
pub(super) const PARKED: TableDefinition<'_, (&str, u64), &[u8]> = TableDefinition::new("parked");
/// How many entries are parked under each prefix.
pub(super) const PARKED_PREFIXES: TableDefinition<'_, &str, u64> =
    TableDefinition::new("parked_prefixes");
/// The order groups with a parked entry (order hash → how many): a later
/// entry of such a group waits for it.
pub(super) const PARKED_ORDERS: TableDefinition<'_, u64, u64> =
    TableDefinition::new("parked_orders");
pub(super) const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");

/// Expired keys removed per acknowledgement, so that cleanup keeps pace
/// without one long transaction.
const PURGE_BATCH: usize = 16;

fn order_hash(order: Option<&str>) -> u64 {
    let Some(order) = order else { return 0 };
    foldhash::quality::FixedState::with_seed(0x9e37)
        .hash_one(order)
        .max(1)
}

fn fresh_lease() -> u64 {
    let t = tower_idempotency::store::OwnerToken::new().as_u128();
    ((t >> 64) as u64 ^ t as u64).max(1)
}

/// The queue over one database.
#[derive(Debug, Clone)]
pub(super) struct Embedded {
    pub(super) db: Arc<Db>,
    window: Duration,
    committer: Arc<Committer>,
}

impl Embedded {
    /// The queue over `db`; `path`, its file, to reopen it after a failed
    /// write (none: in memory).
    pub(super) fn new(
        db: Database,
        path: Option<PathBuf>,
        window: Duration,
    ) -> Result<Self, QueueError> {
        let room = path.clone().map(Room::on).unwrap_or_default();
        let db = Arc::new(Db::new(db, path, Health::new(room))?);
        Ok(Self {
            committer: Arc::new(Committer::start(db.clone())?),
            db,
            window,
        })
    }

    /// The queue over `db` (tests of failing storage).
    #[cfg(test)]
    pub(super) fn over(db: Db, window: Duration) -> Result<Self, QueueError> {
        let db = Arc::new(db);
        Ok(Self {
            committer: Arc::new(Committer::start(db.clone())?),
            db,
            window,
        })
    }

    /// Stores `message` unless its key is known, in the next group commit.
    pub(super) async fn ingest_message(&self, message: Message) -> Result<Ingested, QueueError> {
        let db = self.db.clone();
        self.grouped_ingest(move |txn| Self::ingest(txn, &message, db.reopened()))
            .await
    }

    /// Keeps `bytes` free on the file's disk: ingests are refused past it.
    pub(super) fn set_reserve(&self, bytes: u64) {
        self.db.health.room.set_reserve(bytes);
    }

    /// Whether new entries can be stored now.
    pub(super) fn writable(&self) -> bool {
        self.db.health.writable()
    }

    pub(super) fn set_window(&mut self, window: Duration) {
        self.window = window;
    }

    /// Runs `change` in the next group commit (see [`Committer::run`]);
    /// returns once that commit is durable. After a failed write it waits
    /// for the file to be reopened (see [`Kind::Settle`]).
    pub(super) async fn grouped<T, F>(&self, change: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send + 'static,
    {
        self.committer.run(Kind::Settle, change).await
    }

    /// [`grouped`](Self::grouped) for a change that stores a new entry:
    /// refused while the disk is short of room.
    pub(super) async fn grouped_ingest<T, F>(&self, change: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send + 'static,
    {
        self.committer.run(Kind::Ingest, change).await
    }

    /// [`grouped`](Self::grouped) for a fetch: fails at once while the file
    /// is being reopened (a settlement waits for it).
    pub(super) async fn grouped_fetch<T, F>(&self, change: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnMut(&WriteTransaction) -> Result<T, QueueError> + Send + 'static,
    {
        self.committer.run(Kind::Fetch, change).await
    }

    /// How long a delivered key is remembered.
    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// Bytes of the file in use (allocated pages), for measurements.
    pub(super) fn allocated_bytes(&self) -> Result<u64, QueueError> {
        let txn = self.db.get()?.begin_write().map_err(err)?;
        let stats = txn.stats().map_err(err)?;
        txn.abort().map_err(err)?;
        Ok(stats.allocated_pages() * stats.page_size() as u64)
    }

    /// Stores `message` unless its key is known. `rewrite` (the file was
    /// reopened after a failed write, see [`Db::reopened`]): a known key's
    /// marker and live entry are written again in this transaction, so
    /// that the answer (a duplicate, or another payload) rests on a commit
    /// that is durable before it is given, not on what a failed one may
    /// have left readable.
    pub(super) fn ingest(
        txn: &WriteTransaction,
        message: &Message,
        rewrite: bool,
    ) -> Result<Ingested, QueueError> {
        let mut keys = txn.open_table(KEYS).map_err(err)?;
        let found = keys
            .get(message.key.as_str())
            .map_err(err)?
            .and_then(|v| Marker::decode(v.value()));
        let now = queue_now(txn)?;
        if let Some(marker) = found
            && (marker.expires == 0 || marker.expires > now)
        {
            if rewrite {
                keys.insert(message.key.as_str(), marker.encode().as_slice())
                    .map_err(err)?;
                Self::rewrite_entry(txn, marker.entry)?;
            }
            return Ok(if marker.fingerprint == message.fingerprint.to_bytes() {
                Ingested::Duplicate
            } else {
                Ingested::Mismatch
            });
        }
        let id = Self::next_id(txn)?;
        let marker = Marker {
            fingerprint: message.fingerprint.to_bytes(),
            entry: id,
            expires: 0,
        };
        keys.insert(message.key.as_str(), marker.encode().as_slice())
            .map_err(err)?;
        Self::enqueue(txn, id, message, now)?;
        Ok(Ingested::Queued(EntryId::new(id.to_string())))
    }

    /// Writes entry `id`'s rows (if it is still queued) again, unchanged:
    /// copy-on-write, they go to new pages of this commit.
    fn rewrite_entry(txn: &WriteTransaction, id: u64) -> Result<(), QueueError> {
        for table in [STATE, MESSAGES] {
            let mut rows = txn.open_table(table).map_err(err)?;
            let row = rows.get(id).map_err(err)?.map(|v| v.value().to_vec());
            if let Some(row) = row {
                rows.insert(id, row.as_slice()).map_err(err)?;
            }
        }
        // Its id is handed out again by no later ingest.
        let mut meta = txn.open_table(META).map_err(err)?;
        let next = meta.get("next_id").map_err(err)?.map(|v| v.value());
        if let Some(next) = next {
            meta.insert("next_id", next.max(id + 1)).map_err(err)?;
        }
        Ok(())
    }

    pub(super) fn next_id(txn: &WriteTransaction) -> Result<u64, QueueError> {
        let mut meta = txn.open_table(META).map_err(err)?;
        let id = meta
            .get("next_id")
            .map_err(err)?
            .map(|v| v.value())
            .unwrap_or(1);
        meta.insert("next_id", id + 1).map_err(err)?;
        Ok(id)
    }

    pub(super) fn enqueue(
        txn: &WriteTransaction,
        id: u64,
        message: &Message,
        now: u64,
    ) -> Result<(), QueueError> {
        let state = State {
            attempts: 0,
            due: now,
            lease: 0,
            enqueued: now,
            order: order_hash(message.order.as_deref()),
        };
        txn.open_table(STATE)
            .map_err(err)?
            .insert(id, state.encode().as_slice())
            .map_err(err)?;
        txn.open_table(MESSAGES)
            .map_err(err)?
            .insert(id, message.encode().as_slice())
            .map_err(err)?;
        Ok(())
    }

    pub(super) fn fetch(
        txn: &WriteTransaction,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Delivery>, QueueError> {
        let now = queue_now(txn)?;
        let mut state = txn.open_table(STATE).map_err(err)?;
        let parked_orders = txn.open_table(PARKED_ORDERS).map_err(err)?;
        // Looked up per entry only while some group has a parked entry: a
        // fetch with nothing parked scans as it did before.
        let any_parked = !parked_orders.is_empty().map_err(err)?;
        let mut blocked = HashSet::new();
        let mut taken = Vec::new();
        for row in state.iter().map_err(err)? {
            if taken.len() >= max {
                break;
            }
            let (id, value) = row.map_err(err)?;
            let s = State::decode(value.value())?;
            if s.order != 0 && !blocked.insert(s.order) {
                // An earlier entry of its order group is not delivered yet.
                continue;
            }
            if any_parked && s.order != 0 && parked_orders.get(s.order).map_err(err)?.is_some() {
                // Nor is one that is parked (the earliest of its group).
                continue;
            }
            if s.due <= now {
                taken.push((id.value(), s));
            }
        }
        let mut out = Vec::with_capacity(taken.len());
        let mut unreadable = Vec::new();
        for (id, mut s) in taken {
            s.attempts += 1;
            s.lease = fresh_lease();
            s.due = now + lease.as_millis() as u64;
            let raw = txn
                .open_table(MESSAGES)
                .map_err(err)?
                .get(id)
                .map_err(err)?
                .map(|v| v.value().to_vec());
            let Some(message) = raw.as_deref().and_then(Message::decode) else {
                // Written by another version, or damaged: set aside with its
                // reason, and the others delivered.
                unreadable.push((id, s.attempts, raw.unwrap_or_default()));
                continue;
            };
            state.insert(id, s.encode().as_slice()).map_err(err)?;
            out.push(Delivery {
                id: EntryId::new(id.to_string()),
                message,
                attempt: s.attempts,
                enqueued_at: time_of(s.enqueued),
                lease: s.lease,
                history: None,
            });
        }
        drop(state);
        for (id, attempts, raw) in unreadable {
            let history = Self::history(txn, id)?;
            Self::remove(txn, id)?;
            let why = "undecodable entry: not a message this version can read";
            crate::log_warn!(entry = id, "{why}; dead-lettered");
            Self::bury(txn, id, attempts, why, &raw, history.as_deref())?;
        }
        Ok(out)
    }

    /// The entry's state if `delivery` still holds its lease.
    pub(super) fn leased(
        txn: &WriteTransaction,
        delivery: &Delivery,
    ) -> Result<Option<(u64, State)>, QueueError> {
        let Ok(id) = delivery.id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        let state = txn.open_table(STATE).map_err(err)?;
        let found = state
            .get(id)
            .map_err(err)?
            .map(|v| State::decode(v.value()))
            .transpose()?;
        Ok(found.filter(|s| s.lease == delivery.lease).map(|s| (id, s)))
    }

    /// The lease of `delivery` runs `lease` from now, if it still holds it.
    pub(super) fn renew(
        txn: &WriteTransaction,
        delivery: &Delivery,
        lease: Duration,
    ) -> Result<bool, QueueError> {
        let Some((id, mut s)) = Self::leased(txn, delivery)? else {
            return Ok(false);
        };
        s.due = queue_now(txn)? + lease.as_millis() as u64;
        txn.open_table(STATE)
            .map_err(err)?
            .insert(id, s.encode().as_slice())
            .map_err(err)?;
        Ok(true)
    }

    /// The failed attempts live entry `id` recorded, as stored.
    pub(super) fn history(txn: &WriteTransaction, id: u64) -> Result<Option<String>, QueueError> {
        let table = txn.open_table(ATTEMPTS).map_err(err)?;
        let row = table.get(id).map_err(err)?;
        Ok(row.map(|v| v.value().to_owned()))
    }

    /// Removes a live entry: its message bytes if it had any.
    pub(super) fn remove(txn: &WriteTransaction, id: u64) -> Result<Option<Vec<u8>>, QueueError> {
        txn.open_table(STATE)
            .map_err(err)?
            .remove(id)
            .map_err(err)?;
        txn.open_table(ATTEMPTS)
            .map_err(err)?
            .remove(id)
            .map_err(err)?;
        let mut messages = txn.open_table(MESSAGES).map_err(err)?;
        let bytes = messages
            .remove(id)
            .map_err(err)?
            .map(|v| v.value().to_vec());
        Ok(bytes)
    }

    /// Removes the delivered entry and remembers its key for `window`.
    pub(super) fn ack(
        txn: &WriteTransaction,
        delivery: &Delivery,
        window: Duration,
    ) -> Result<bool, QueueError> {
        let Some((id, _)) = Self::leased(txn, delivery)? else {
            return Ok(false);
        };
        Self::remove(txn, id)?;
        let now = queue_now(txn)?;
        let expires = now + window.as_millis() as u64;
        let key = delivery.message.key.as_str();
        let marker = Marker {
            fingerprint: delivery.message.fingerprint.to_bytes(),
            entry: 0,
            expires,
        };
        txn.open_table(KEYS)
            .map_err(err)?
            .insert(key, marker.encode().as_slice())
            .map_err(err)?;
        txn.open_table(EXPIRY)
            .map_err(err)?
            .insert((expires, key), ())
            .map_err(err)?;
        Self::purge(txn, now)?;
        Ok(true)
    }

    /// Forgets a few keys whose window ended.
    fn purge(txn: &WriteTransaction, now: u64) -> Result<(), QueueError> {
        let mut expiry = txn.open_table(EXPIRY).map_err(err)?;
        let mut keys = txn.open_table(KEYS).map_err(err)?;
        let due: Vec<(u64, String)> = expiry
            .range((0u64, "")..(now, ""))
            .map_err(err)?
            .take(PURGE_BATCH)
            .filter_map(|r| r.ok().map(|(k, _)| (k.value().0, k.value().1.to_owned())))
            .collect();
        for (at, key) in due {
            expiry.remove((at, key.as_str())).map_err(err)?;
            let current = keys
                .get(key.as_str())
                .map_err(err)?
                .and_then(|v| Marker::decode(v.value()));
            // A key queued again since has a newer marker: keep it.
            if current.is_some_and(|m| m.entry == 0 && m.expires == at) {
                keys.remove(key.as_str()).map_err(err)?;
            }
        }
        Ok(())
    }

    /// Forgets the marker of a delivered `key` (see
    /// [`Queue::forget`](crate::Queue::forget)): `Ok(true)` if it was
    /// forgotten, `Ok(false)` if there was none, `Err` (the refusal, nothing
    /// changed) while an entry of `key` is live or dead-lettered.
    pub(super) fn forget(
        txn: &WriteTransaction,
        key: &str,
    ) -> Result<Result<bool, &'static str>, QueueError> {
        let mut keys = txn.open_table(KEYS).map_err(err)?;
        let Some(marker) = keys
            .get(key)
            .map_err(err)?
            .and_then(|v| Marker::decode(v.value()))
        else {
            return Ok(Ok(false));
        };
        if marker.entry != 0 {
            let dead = txn.open_table(DEAD).map_err(err)?;
            return Ok(Err(if dead.get(marker.entry).map_err(err)?.is_some() {
                "dead-lettered: replay it from the dead letters instead"
            } else {
                "still queued: delivered when due"
            }));
        }
        keys.remove(key).map_err(err)?;
        txn.open_table(EXPIRY)
            .map_err(err)?
            .remove((marker.expires, key))
            .map_err(err)?;
        Ok(Ok(marker.expires > queue_now(txn)?))
    }

    /// Due again after `after`; `failed`: this attempt failed with that
    /// error (it counts, and is recorded), `None`: it does not count.
    pub(super) fn retry(
        txn: &WriteTransaction,
        delivery: &Delivery,
        after: Duration,
        failed: Option<&str>,
    ) -> Result<bool, QueueError> {
        let Some((id, mut s)) = Self::leased(txn, delivery)? else {
            return Ok(false);
        };
        let now = queue_now(txn)?;
        match failed {
            Some(error) => {
                let stored = Self::history(txn, id)?;
                let line = History::record(stored.as_deref(), s.attempts, time_of(now), error);
                txn.open_table(ATTEMPTS)
                    .map_err(err)?
                    .insert(id, line.as_str())
                    .map_err(err)?;
            }
            None => s.attempts = s.attempts.saturating_sub(1),
        }
        s.lease = 0;
        s.due = now + after.as_millis() as u64;
        txn.open_table(STATE)
            .map_err(err)?
            .insert(id, s.encode().as_slice())
            .map_err(err)?;
        Ok(true)
    }

    /// Parks the leased `delivery` under `prefix` (see
    /// [`Park::park`](crate::Park::park)): its state leaves `state` (so no
    /// fetch scans it) for `parked`, its attempt uncounted.
    pub(super) fn park(
        txn: &WriteTransaction,
        delivery: &Delivery,
        prefix: &str,
    ) -> Result<Option<bool>, QueueError> {
        let Some((id, mut s)) = Self::leased(txn, delivery)? else {
            return Ok(Some(false));
        };
        if s.order != 0 {
            // Out of `state`, it still holds its group's later entries back.
            let mut orders = txn.open_table(PARKED_ORDERS).map_err(err)?;
            let n = orders.get(s.order).map_err(err)?.map_or(0, |v| v.value());
            orders.insert(s.order, n + 1).map_err(err)?;
        }
        s.attempts = s.attempts.saturating_sub(1);
        s.lease = 0;
        txn.open_table(STATE)
            .map_err(err)?
            .remove(id)
            .map_err(err)?;
        txn.open_table(PARKED)
            .map_err(err)?
            .insert((prefix, id), s.encode().as_slice())
            .map_err(err)?;
        let mut prefixes = txn.open_table(PARKED_PREFIXES).map_err(err)?;
        let n = prefixes.get(prefix).map_err(err)?.map_or(0, |v| v.value());
        prefixes.insert(prefix, n + 1).map_err(err)?;
        Ok(Some(true))
    }

    /// Puts every entry parked under `prefix` back into `state`, due now.
    pub(super) fn wake(txn: &WriteTransaction, prefix: &str) -> Result<u64, QueueError> {
        let now = queue_now(txn)?;
        let mut parked = txn.open_table(PARKED).map_err(err)?;
        let rows: Vec<(u64, Vec<u8>)> = parked
            .range((prefix, 0u64)..=(prefix, u64::MAX))
            .map_err(err)?
            .map(|r| r.map(|(k, v)| (k.value().1, v.value().to_vec())))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        let mut state = txn.open_table(STATE).map_err(err)?;
        let mut orders = txn.open_table(PARKED_ORDERS).map_err(err)?;
        for (id, raw) in &rows {
            parked.remove((prefix, *id)).map_err(err)?;
            let mut s = State::decode(raw)?;
            s.due = now;
            state.insert(*id, s.encode().as_slice()).map_err(err)?;
            if s.order != 0 {
                let n = orders.get(s.order).map_err(err)?.map_or(0, |v| v.value());
                if n > 1 {
                    orders.insert(s.order, n - 1).map_err(err)?;
                } else {
                    orders.remove(s.order).map_err(err)?;
                }
            }
        }
        txn.open_table(PARKED_PREFIXES)
            .map_err(err)?
            .remove(prefix)
            .map_err(err)?;
        Ok(rows.len() as u64)
    }

    /// The prefixes with entries parked under them.
    pub(super) fn parked(&self) -> Result<Vec<String>, QueueError> {
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let prefixes = txn.open_table(PARKED_PREFIXES).map_err(err)?;
        let mut out = Vec::new();
        for row in prefixes.iter().map_err(err)? {
            out.push(row.map_err(err)?.0.value().to_owned());
        }
        Ok(out)
    }

    pub(super) fn stats(&self) -> Result<QueueStats, QueueError> {
        self.db.health.stats(self.read_stats())
    }

    fn read_stats(&self) -> Result<QueueStats, QueueError> {
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let now = queue_now_read(&txn)?;
        let state = txn.open_table(STATE).map_err(err)?;
        let oldest = match state.first().map_err(err)? {
            Some((_, v)) => {
                let s = State::decode(v.value())?;
                Some(Duration::from_millis(now.saturating_sub(s.enqueued)))
            }
            None => None,
        };
        let parked = txn.open_table(PARKED).map_err(err)?.len().map_err(err)?;
        Ok(QueueStats {
            depth: state.len().map_err(err)? + parked,
            oldest,
            dead: txn.open_table(DEAD).map_err(err)?.len().map_err(err)?,
            ..QueueStats::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::health::Health;
    use redb::StorageBackend;
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    use tower_idempotency::Fingerprint;

    /// A write or a length change, not yet on the disk.
    #[derive(Debug, Clone)]
    enum Pending {
        Write(u64, Vec<u8>),
        Len(u64),
    }

    /// A file as Linux keeps it: writes land in the page cache and are read
    /// back from it; a sync that works puts them on the disk; one that fails
    /// (`fail_sync`, once) leaves them in the cache, readable and marked
    /// clean, so that no later sync writes them: only what is written again
    /// reaches the disk.
    #[derive(Debug, Clone, Default)]
    struct Cached {
        cache: Arc<Mutex<Vec<u8>>>,
        disk: Arc<Mutex<Vec<u8>>>,
        pending: Arc<Mutex<Vec<Pending>>>,
        fail_sync: Arc<AtomicBool>,
    }

    impl Cached {
        /// After a crash: the disk, and nothing else.
        fn crashed(&self) -> Self {
            let disk = self.disk.lock().unwrap().clone();
            Self {
                cache: Arc::new(Mutex::new(disk.clone())),
                disk: Arc::new(Mutex::new(disk)),
                ..Self::default()
            }
        }

        fn open(&self) -> Result<Database, QueueError> {
            Database::builder()
                .create_with_backend(self.clone())
                .map_err(|e| QueueError::unwritable(e.to_string()).with_source(e))
        }
    }

    fn apply(file: &mut Vec<u8>, op: &Pending) {
        match op {
            Pending::Write(offset, data) => {
                let at = *offset as usize;
                if file.len() < at + data.len() {
                    file.resize(at + data.len(), 0);
                }
                file[at..at + data.len()].copy_from_slice(data);
            }
            Pending::Len(len) => file.resize(*len as usize, 0),
        }
    }

    impl StorageBackend for Cached {
        fn len(&self) -> io::Result<u64> {
            Ok(self.cache.lock().unwrap().len() as u64)
        }
        fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
            let cache = self.cache.lock().unwrap();
            let at = offset as usize;
            cache
                .get(at..at + len)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| io::Error::other("read past the end"))
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            let op = Pending::Len(len);
            apply(&mut self.cache.lock().unwrap(), &op);
            self.pending.lock().unwrap().push(op);
            Ok(())
        }
        fn sync_data(&self, _eventual: bool) -> io::Result<()> {
            let pending = std::mem::take(&mut *self.pending.lock().unwrap());
            if self.fail_sync.swap(false, Ordering::SeqCst) {
                return Err(io::Error::other("Input/output error"));
            }
            let mut disk = self.disk.lock().unwrap();
            for op in &pending {
                apply(&mut disk, op);
            }
            Ok(())
        }
        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            let op = Pending::Write(offset, data.to_vec());
            apply(&mut self.cache.lock().unwrap(), &op);
            self.pending.lock().unwrap().push(op);
            Ok(())
        }
    }

    fn message(key: &str) -> Message {
        Message::new(key, Fingerprint::of(key.as_bytes()), "body")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_failed_sync_no_duplicate_is_answered_from_the_failed_commit() {
        let file = Cached::default();
        let db = file.open().unwrap();
        let reopen = file.clone();
        let db = Db::with_opener(db, Box::new(move || reopen.open()), Health::default()).unwrap();
        let queue = Embedded::over(db, Duration::from_secs(3600)).unwrap();
        let got = queue.ingest_message(message("k1")).await.unwrap();
        assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
        file.fail_sync.store(true, Ordering::SeqCst);
        let failed = queue.ingest_message(message("k2")).await;
        assert!(failed.is_err(), "the sync failed: {failed:?}");
        // The channel sends k2 again until the queue answers (once its file
        // is reopened).
        let start = std::time::Instant::now();
        let answer = loop {
            match queue.ingest_message(message("k2")).await {
                Ok(got) => break got,
                Err(e) => {
                    assert!(
                        start.elapsed() < Duration::from_secs(20),
                        "never reopened: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        drop(queue);
        // A crash now: what the disk holds is all there is.
        let crashed = file.crashed();
        let db = Db::new(crashed.open().unwrap(), None, Health::default()).unwrap();
        let after = Embedded::over(db, Duration::from_secs(3600)).unwrap();
        let again = after.ingest_message(message("k2")).await.unwrap();
        assert!(
            !(matches!(answer, Ingested::Duplicate) && matches!(again, Ingested::Queued(_))),
            "k2 was answered {answer:?} (already queued) from the failed commit, and a crash lost it"
        );
        let k1 = after.ingest_message(message("k1")).await.unwrap();
        assert_eq!(k1, Ingested::Duplicate, "k1's commit was durable");
    }
}
