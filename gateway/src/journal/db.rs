//! The journal's file: records by key, an index by last copy for the time
//! filters and the pruning, and the records' total size for the size cap.

use super::page::PageBuilder;
use super::reopen::Reopen;
use super::{
    now_ms, Inbox, JournalError, JournalErrorKind, JournalEvent, JournalFilter, JournalPage,
    JournalRecord,
};
use redb::{Database, Durability, ReadableTable, Table, TableDefinition};
use std::collections::HashMap;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Stored key → the record as JSON.
const RECORDS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("records");
/// (last copy in ms, stored key) → nothing: the records in time order.
const BY_TIME: TableDefinition<'_, (u64, &str), ()> = TableDefinition::new("by_time");
/// Counters: [`RECORD_BYTES`].
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// The bytes of every record's JSON, for the size cap.
const RECORD_BYTES: &str = "record_bytes";

/// Records removed in one transaction, at most.
const PRUNE_BATCH: usize = 1000;

fn len(bytes: usize) -> u64 {
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Why records were removed, for `idempotency_journal_pruned_total{reason}`.
#[derive(Clone, Copy)]
enum Pruned {
    Retention,
    Size,
}

fn count_pruned(_reason: Pruned, n: usize) {
    if n > 0 {
        let reason = match _reason {
            Pruned::Retention => "retention",
            Pruned::Size => "size",
        };
        metrics::counter!("idempotency_journal_pruned_total", "reason" => reason).increment(len(n));
    }
    let _ = n;
}

fn set_bytes_gauge(_bytes: u64) {
    metrics::gauge!("idempotency_journal_bytes").set(_bytes as f64);
}

/// Creates `path` readable by its owner only (a journal holds what senders
/// sent), or narrows an existing file to that.
fn owner_only(path: &Path) -> Result<(), JournalError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let shown = |e| JournalError::backend(&path.display().to_string(), e);
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(shown)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(shown)?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[derive(Clone)]
pub(super) struct Db {
    db: Arc<Reopen>,
    max_size: u64,
    /// Bytes of records written since the last durable commit: redb reuses
    /// the pages a commit frees only after a durable one, so a burst of
    /// eventual commits would grow the file past the records' size.
    since_durable: Arc<AtomicU64>,
}

/// While the file is closed after an I/O error (it is opened again with a
/// backoff).
fn closed() -> JournalError {
    JournalError::new(
        JournalErrorKind::Backend,
        "journal write: closed after an I/O error (re-opened once it can be)",
    )
}

impl Db {
    pub(super) fn open(path: &Path, max_size: u64) -> Result<Self, JournalError> {
        owner_only(path)?;
        let at = path.to_path_buf();
        let db = Reopen::new("journal", move || Database::create(&at))
            .map_err(|e| JournalError::backend(&format!("{}", path.display()), e))?;
        Self::with(db, max_size)
    }

    /// The journal in `db`, its tables created if missing.
    fn with(db: Reopen, max_size: u64) -> Result<Self, JournalError> {
        let file = db.get().ok_or_else(closed)?;
        let tx = file
            .begin_write()
            .map_err(|e| JournalError::backend("open", e))?;
        {
            let records = tx
                .open_table(RECORDS)
                .map_err(|e| JournalError::backend("open", e))?;
            tx.open_table(BY_TIME)
                .map_err(|e| JournalError::backend("open", e))?;
            let mut meta = tx
                .open_table(META)
                .map_err(|e| JournalError::backend("open", e))?;
            // A journal written before the size cap: its records counted once.
            if meta
                .get(RECORD_BYTES)
                .map_err(|e| JournalError::backend("open", e))?
                .is_none()
            {
                let mut bytes = 0;
                for entry in records
                    .iter()
                    .map_err(|e| JournalError::backend("open", e))?
                {
                    let (_, v) = entry.map_err(|e| JournalError::backend("open", e))?;
                    bytes += len(v.value().len());
                }
                meta.insert(RECORD_BYTES, bytes)
                    .map_err(|e| JournalError::backend("open", e))?;
            }
        }
        tx.commit().map_err(|e| JournalError::backend("open", e))?;
        drop(file);
        Ok(Self {
            db: Arc::new(db),
            max_size,
            since_durable: Arc::default(),
        })
    }

    /// The open file, or the error to answer while it is closed.
    fn file(&self) -> Result<Arc<Database>, JournalError> {
        self.db.get().ok_or_else(closed)
    }

    /// Runs `f` on the open file; an error that needs the file closed and
    /// opened again closes it.
    fn on_file<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, JournalError>,
    ) -> Result<T, JournalError> {
        let file = self.file()?;
        let done = f(&file);
        if let Err(e) = &done {
            self.db.failed(&file, &e.to_string());
        }
        done
    }

    pub(super) fn get(&self, key: &str) -> Result<Option<JournalRecord>, JournalError> {
        let file = self.file()?;
        let tx = file
            .begin_read()
            .map_err(|e| JournalError::backend("read", e))?;
        let table = tx
            .open_table(RECORDS)
            .map_err(|e| JournalError::backend("read", e))?;
        let Some(found) = table
            .get(key)
            .map_err(|e| JournalError::backend("read", e))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(found.value())
            .map(Some)
            .map_err(|e| JournalError::backend("decode", e))
    }

    pub(super) fn query(&self, filter: &JournalFilter) -> Result<JournalPage, JournalError> {
        let file = self.file()?;
        let tx = file
            .begin_read()
            .map_err(|e| JournalError::backend("read", e))?;
        let by_time = tx
            .open_table(BY_TIME)
            .map_err(|e| JournalError::backend("read", e))?;
        let records = tx
            .open_table(RECORDS)
            .map_err(|e| JournalError::backend("read", e))?;
        let mut page = PageBuilder::new(filter);
        let start = filter.start();
        let range = by_time
            .range::<(u64, &str)>((Bound::Included(start), Bound::Unbounded))
            .map_err(|e| JournalError::backend("read", e))?;
        for entry in range {
            let (at, _) = entry.map_err(|e| JournalError::backend("read", e))?;
            let (ms, key) = at.value();
            if filter.seen(ms, key) {
                continue;
            }
            let Some(found) = records
                .get(key)
                .map_err(|e| JournalError::backend("read", e))?
            else {
                continue;
            };
            let record: JournalRecord = serde_json::from_slice(found.value())
                .map_err(|e| JournalError::backend("decode", e))?;
            if let Some(full) = page.push(record) {
                return Ok(full);
            }
        }
        Ok(page.last())
    }

    /// Writes one batch of events: each record read, updated and written
    /// back, and its place in the time index moved; then, past the size
    /// cap, the records last seen longest ago removed.
    fn write(&self, events: &[JournalEvent], durable: bool) -> Result<(), JournalError> {
        self.on_file(|file| self.write_in(file, events, durable))
    }

    fn write_in(
        &self,
        file: &Database,
        events: &[JournalEvent],
        durable: bool,
    ) -> Result<(), JournalError> {
        // Merge the batch's copies of one key first: one read and one write each.
        let mut merged: HashMap<&str, JournalRecord> = HashMap::new();
        let written: u64 = events.iter().map(|e| len(e.size())).sum();
        let since = self.since_durable.fetch_add(written, Ordering::Relaxed) + written;
        let durable = durable || since >= (self.max_size / 16).clamp(64 << 10, 64 << 20);
        let mut tx = file
            .begin_write()
            .map_err(|e| JournalError::backend("write", e))?;
        if durable {
            self.since_durable.store(0, Ordering::Relaxed);
        } else {
            tx.set_durability(Durability::Eventual);
        }
        let (pruned, bytes) = {
            let mut records = tx
                .open_table(RECORDS)
                .map_err(|e| JournalError::backend("write", e))?;
            let mut by_time = tx
                .open_table(BY_TIME)
                .map_err(|e| JournalError::backend("write", e))?;
            let mut meta = tx
                .open_table(META)
                .map_err(|e| JournalError::backend("write", e))?;
            let mut bytes = bytes_of(&meta)?;
            let mut old_times = Vec::new();
            for event in events {
                let key: &str = &event.key;
                if !merged.contains_key(key) {
                    let old = match records
                        .get(key)
                        .map_err(|e| JournalError::backend("write", e))?
                    {
                        Some(v) => {
                            bytes = bytes.saturating_sub(len(v.value().len()));
                            serde_json::from_slice::<JournalRecord>(v.value()).ok()
                        }
                        None => None,
                    };
                    if let Some(old) = &old {
                        old_times.push((old.last_seen_ms, key));
                    }
                    merged.insert(key, old.unwrap_or_else(|| JournalRecord::first(event)));
                }
                merged.get_mut(key).expect("inserted above").add(event);
            }
            for (at, key) in old_times {
                by_time
                    .remove((at, key))
                    .map_err(|e| JournalError::backend("write", e))?;
            }
            for (key, record) in &merged {
                let json =
                    serde_json::to_vec(record).map_err(|e| JournalError::backend("encode", e))?;
                bytes += len(json.len());
                records
                    .insert(*key, json.as_slice())
                    .map_err(|e| JournalError::backend("write", e))?;
                by_time
                    .insert((record.last_seen_ms, *key), ())
                    .map_err(|e| JournalError::backend("write", e))?;
            }
            let pruned = self.over_size(&mut records, &mut by_time, &mut bytes)?;
            meta.insert(RECORD_BYTES, bytes)
                .map_err(|e| JournalError::backend("write", e))?;
            (pruned, bytes)
        };
        tx.commit()
            .map_err(|e| JournalError::backend("commit", e))?;
        count_pruned(Pruned::Size, pruned);
        set_bytes_gauge(bytes);
        Ok(())
    }

    /// Removes the records last seen longest ago while their bytes are
    /// past the size cap, at most a batch of them; returns how many.
    fn over_size(
        &self,
        records: &mut Table<'_, &'static str, &'static [u8]>,
        by_time: &mut Table<'_, (u64, &'static str), ()>,
        bytes: &mut u64,
    ) -> Result<usize, JournalError> {
        let mut removed = 0;
        while *bytes > self.max_size && removed < PRUNE_BATCH {
            let key = match by_time
                .pop_first()
                .map_err(|e| JournalError::backend("prune", e))?
            {
                Some((at, _)) => at.value().1.to_owned(),
                None => break,
            };
            if let Some(v) = records
                .remove(key.as_str())
                .map_err(|e| JournalError::backend("prune", e))?
            {
                *bytes = bytes.saturating_sub(len(v.value().len()));
            }
            removed += 1;
        }
        Ok(removed)
    }

    /// Removes up to one batch of records last seen before `before_ms`
    /// (and past the size cap); returns how many it removed.
    fn prune(&self, before_ms: u64) -> Result<usize, JournalError> {
        self.on_file(|file| self.prune_in(file, before_ms))
    }

    fn prune_in(&self, file: &Database, before_ms: u64) -> Result<usize, JournalError> {
        let tx = file
            .begin_write()
            .map_err(|e| JournalError::backend("prune", e))?;
        let (removed, by_size, bytes) = {
            let mut records = tx
                .open_table(RECORDS)
                .map_err(|e| JournalError::backend("prune", e))?;
            let mut by_time = tx
                .open_table(BY_TIME)
                .map_err(|e| JournalError::backend("prune", e))?;
            let mut meta = tx
                .open_table(META)
                .map_err(|e| JournalError::backend("prune", e))?;
            let mut bytes = bytes_of(&meta)?;
            let old: Vec<(u64, String)> = by_time
                .range(..(before_ms, ""))
                .map_err(|e| JournalError::backend("prune", e))?
                .take(PRUNE_BATCH)
                .filter_map(Result::ok)
                .map(|(k, _)| {
                    let (at, key) = k.value();
                    (at, key.to_owned())
                })
                .collect();
            for (at, key) in &old {
                by_time
                    .remove((*at, key.as_str()))
                    .map_err(|e| JournalError::backend("prune", e))?;
                if let Some(v) = records
                    .remove(key.as_str())
                    .map_err(|e| JournalError::backend("prune", e))?
                {
                    bytes = bytes.saturating_sub(len(v.value().len()));
                }
            }
            let by_size = self.over_size(&mut records, &mut by_time, &mut bytes)?;
            meta.insert(RECORD_BYTES, bytes)
                .map_err(|e| JournalError::backend("prune", e))?;
            (old.len(), by_size, bytes)
        };
        tx.commit().map_err(|e| JournalError::backend("prune", e))?;
        count_pruned(Pruned::Retention, removed);
        count_pruned(Pruned::Size, by_size);
        set_bytes_gauge(bytes);
        Ok(removed.max(by_size))
    }

    /// The writer: batches of events, then every `prune_every` a durable
    /// commit and the pruning, until every sender is gone. A batch that
    /// cannot be written is dropped and counted.
    pub(super) async fn write_loop(
        self,
        mut inbox: Inbox,
        retention: Duration,
        prune_every: Duration,
    ) {
        let mut every = tokio::time::interval(prune_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        loop {
            let first = tokio::select! {
                got = inbox.recv() => match got {
                    Some(command) => command,
                    None => break,
                },
                _ = every.tick() => {
                    let db = self.clone();
                    let before = now_ms().saturating_sub(retention_ms);
                    let _ = tokio::task::spawn_blocking(move || {
                        // A durable (empty) commit makes the eventual ones durable.
                        let _ = db.write(&[], true);
                        while db.prune(before).is_ok_and(|n| n == PRUNE_BATCH) {}
                    })
                    .await;
                    continue;
                }
            };
            let (events, flushed) = inbox.batch(first);
            let db = self.clone();
            let durable = !flushed.is_empty();
            let n = events.len();
            let written = tokio::task::spawn_blocking(move || db.write(&events, durable)).await;
            // Logged (at most once a minute) where the file failed.
            if !matches!(written, Ok(Ok(()))) {
                inbox.lost(n);
            }
            for done in flushed {
                let _ = done.send(());
            }
        }
    }
}

fn bytes_of(meta: &Table<'_, &'static str, u64>) -> Result<u64, JournalError> {
    Ok(meta
        .get(RECORD_BYTES)
        .map_err(|e| JournalError::backend("read", e))?
        .map_or(0, |v| v.value()))
}

#[cfg(test)]
mod tests {
    use super::super::reopen::tests::Disk;
    use super::*;
    use std::sync::atomic::Ordering;

    fn event(key: &str) -> JournalEvent {
        JournalEvent::new(
            key.to_owned(),
            "stripe",
            "/r",
            tower_idempotency::Outcome::Executed,
        )
    }

    /// A full disk: redb refuses the write, then every later one ("Previous
    /// I/O error"); the file is closed, writes fail at once (no waiting)
    /// while it is, and once there is room again it is opened again after
    /// the backoff: what was committed before is there, new writes land.
    #[test]
    fn a_full_disk_is_survived_without_a_restart() {
        let disk = Disk::new();
        let opener = disk.clone();
        let reopen = Reopen::new("journal", move || opener.open()).unwrap();
        let db = Db::with(reopen, u64::MAX).unwrap();
        db.write(&[event("before")], true).unwrap();
        disk.full.store(true, Ordering::Relaxed);
        let failed = db.write(&[event("during-1")], true).unwrap_err();
        assert!(failed.to_string().contains("I/O error"), "{failed}");
        assert!(!db.db.is_open(), "closed after the I/O error");
        let started = std::time::Instant::now();
        let refused = db.write(&[event("during-2")], true).unwrap_err();
        assert!(refused.to_string().contains("closed"), "{refused}");
        assert!(
            started.elapsed() < Duration::from_millis(100),
            "never waits"
        );
        disk.full.store(false, Ordering::Relaxed);
        let mut written = false;
        for _ in 0..40 {
            if db.write(&[event("after")], true).is_ok() {
                written = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(written, "written again once the disk has room");
        assert!(
            db.get("before").unwrap().is_some(),
            "nothing committed is lost"
        );
        assert!(db.get("after").unwrap().is_some());
        assert!(db.get("during-1").unwrap().is_none());
    }
}
