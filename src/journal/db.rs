//! The journal's file: records by key, and an index by last copy for the
//! time filters and the pruning.

use super::{now_ms, Command, JournalError, JournalEvent, JournalFilter, JournalRecord};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Stored key → the record as JSON.
const RECORDS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("records");
/// (last copy in ms, stored key) → nothing: the records in time order.
const BY_TIME: TableDefinition<'_, (u64, &str), ()> = TableDefinition::new("by_time");

/// Events written in one transaction, at most.
const BATCH: usize = 512;
/// Records removed in one transaction, at most.
const PRUNE_BATCH: usize = 1000;

fn err(what: &str, e: impl std::fmt::Display) -> JournalError {
    JournalError::new(format!("journal {what}: {e}"))
}

#[derive(Clone)]
pub(super) struct Db {
    db: Arc<Database>,
}

impl Db {
    pub(super) fn open(path: &Path) -> Result<Self, JournalError> {
        let db = Database::create(path).map_err(|e| err(&format!("{}", path.display()), e))?;
        let tx = db.begin_write().map_err(|e| err("open", e))?;
        tx.open_table(RECORDS).map_err(|e| err("open", e))?;
        tx.open_table(BY_TIME).map_err(|e| err("open", e))?;
        tx.commit().map_err(|e| err("open", e))?;
        Ok(Self { db: Arc::new(db) })
    }

    pub(super) fn get(&self, key: &str) -> Result<Option<JournalRecord>, JournalError> {
        let tx = self.db.begin_read().map_err(|e| err("read", e))?;
        let table = tx.open_table(RECORDS).map_err(|e| err("read", e))?;
        let Some(found) = table.get(key).map_err(|e| err("read", e))? else {
            return Ok(None);
        };
        serde_json::from_slice(found.value())
            .map(Some)
            .map_err(|e| err("decode", e))
    }

    pub(super) fn query(&self, filter: &JournalFilter) -> Result<Vec<JournalRecord>, JournalError> {
        let tx = self.db.begin_read().map_err(|e| err("read", e))?;
        let by_time = tx.open_table(BY_TIME).map_err(|e| err("read", e))?;
        let records = tx.open_table(RECORDS).map_err(|e| err("read", e))?;
        let mut out = Vec::new();
        let range = by_time
            .range((filter.since_ms, "")..)
            .map_err(|e| err("read", e))?;
        for entry in range {
            let (at, _) = entry.map_err(|e| err("read", e))?;
            let (_, key) = at.value();
            let Some(found) = records.get(key).map_err(|e| err("read", e))? else {
                continue;
            };
            let record: JournalRecord =
                serde_json::from_slice(found.value()).map_err(|e| err("decode", e))?;
            if filter.matches(&record) {
                out.push(record);
                if out.len() >= filter.limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Writes one batch of events: each record read, updated and written
    /// back, and its place in the time index moved.
    fn write(&self, events: &[JournalEvent], durable: bool) -> Result<(), JournalError> {
        // Merge the batch's copies of one key first: one read and one write each.
        let mut merged: HashMap<&str, JournalRecord> = HashMap::new();
        let mut tx = self.db.begin_write().map_err(|e| err("write", e))?;
        if !durable {
            tx.set_durability(Durability::Eventual);
        }
        {
            let mut records = tx.open_table(RECORDS).map_err(|e| err("write", e))?;
            let mut by_time = tx.open_table(BY_TIME).map_err(|e| err("write", e))?;
            let mut old_times = Vec::new();
            for event in events {
                let key: &str = &event.key;
                if !merged.contains_key(key) {
                    let old = records
                        .get(key)
                        .map_err(|e| err("write", e))?
                        .and_then(|v| serde_json::from_slice::<JournalRecord>(v.value()).ok());
                    if let Some(old) = &old {
                        old_times.push((old.last_seen_ms, key));
                    }
                    merged.insert(key, old.unwrap_or_else(|| JournalRecord::first(event)));
                }
                merged.get_mut(key).expect("inserted above").add(event);
            }
            for (at, key) in old_times {
                by_time.remove((at, key)).map_err(|e| err("write", e))?;
            }
            for (key, record) in &merged {
                let json = serde_json::to_vec(record).map_err(|e| err("encode", e))?;
                records
                    .insert(*key, json.as_slice())
                    .map_err(|e| err("write", e))?;
                by_time
                    .insert((record.last_seen_ms, *key), ())
                    .map_err(|e| err("write", e))?;
            }
        }
        tx.commit().map_err(|e| err("commit", e))
    }

    /// Removes up to one batch of records last seen before `before_ms`;
    /// returns how many it removed.
    fn prune(&self, before_ms: u64) -> Result<usize, JournalError> {
        let tx = self.db.begin_write().map_err(|e| err("prune", e))?;
        let removed = {
            let mut records = tx.open_table(RECORDS).map_err(|e| err("prune", e))?;
            let mut by_time = tx.open_table(BY_TIME).map_err(|e| err("prune", e))?;
            let old: Vec<(u64, String)> = by_time
                .range(..(before_ms, ""))
                .map_err(|e| err("prune", e))?
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
                    .map_err(|e| err("prune", e))?;
                records.remove(key.as_str()).map_err(|e| err("prune", e))?;
            }
            old.len()
        };
        tx.commit().map_err(|e| err("prune", e))?;
        Ok(removed)
    }

    /// The writer: batches of events, then every `prune_every` a durable
    /// commit and the pruning, until every sender is gone.
    pub(super) async fn write_loop(
        self,
        mut rx: mpsc::Receiver<Command>,
        retention: Duration,
        prune_every: Duration,
    ) {
        let mut every = tokio::time::interval(prune_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        loop {
            let first = tokio::select! {
                got = rx.recv() => match got {
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
            let mut events = Vec::new();
            let mut flushed = Vec::new();
            let mut next = Some(first);
            while let Some(command) = next.take() {
                match command {
                    Command::Event(e) => events.push(e),
                    Command::Flush(done) => flushed.push(done),
                }
                if events.len() < BATCH {
                    next = rx.try_recv().ok();
                }
            }
            let db = self.clone();
            let durable = !flushed.is_empty();
            let written = tokio::task::spawn_blocking(move || db.write(&events, durable)).await;
            if let Ok(Err(_e)) = written {
                crate::outcome::log_warn!(error = %_e, "journal batch not written");
            }
            for done in flushed {
                let _ = done.send(());
            }
        }
    }
}
