//! The journal in Redis, shared by every instance of a Redis store: one
//! string per stored key (the record as JSON, expiring after the
//! retention) and a sorted set of `last_seen_ms:key` members (all of score
//! 0, ordered as text: the time index). Each batch of events is merged
//! under `WATCH` and written in `MULTI`/`EXEC`: when another instance
//! wrote one of its keys meanwhile, the batch is read and merged again.

use super::page::PageBuilder;
use super::{now_ms, Inbox, JournalError, JournalEvent, JournalFilter, JournalPage, JournalRecord};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::time::Duration;

/// All of the journal's keys share one hash tag (one cluster slot).
const RECORD: &str = "{idempotency-journal}:r:";
const BY_TIME: &str = "{idempotency-journal}:by_time";
/// Attempts of a batch after the first, when another instance wrote one
/// of its keys meanwhile or Redis failed.
const WRITE_TRIES: u32 = 8;
/// Index entries read per round trip while filtering.
const PAGE: isize = 1000;

/// The time index's member of a record: ordered as (last copy, key).
fn member(last_seen_ms: u64, key: &str) -> String {
    format!("{last_seen_ms:020}:{key}")
}

fn parse_member(m: &str) -> Option<(u64, &str)> {
    let (ms, key) = m.split_at_checked(20)?;
    Some((ms.parse().ok()?, key.strip_prefix(':')?))
}

#[derive(Clone)]
pub(super) struct RedisDb {
    reads: ConnectionManager,
    client: redis::Client,
}

async fn manager(client: &redis::Client) -> Result<ConnectionManager, JournalError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(5)))
        .set_number_of_retries(3);
    ConnectionManager::new_with_config(client.clone(), config)
        .await
        .map_err(|e| JournalError::backend("connect", e))
}

impl RedisDb {
    pub(super) async fn connect(url: &str) -> Result<Self, JournalError> {
        let client = redis::Client::open(url).map_err(|e| JournalError::backend("connect", e))?;
        let reads = manager(&client).await?;
        Ok(Self { reads, client })
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<JournalRecord>, JournalError> {
        let mut con = self.reads.clone();
        let json: Option<Vec<u8>> = con
            .get(format!("{RECORD}{key}"))
            .await
            .map_err(|e| JournalError::backend("read", e))?;
        json.map(|j| serde_json::from_slice(&j).map_err(|e| JournalError::backend("decode", e)))
            .transpose()
    }

    pub(super) async fn query(&self, filter: &JournalFilter) -> Result<JournalPage, JournalError> {
        let mut con = self.reads.clone();
        let (ms, key) = filter.start();
        let mut from = match &filter.after {
            Some(_) => format!("({}", member(ms, key)),
            None => format!("[{}", member(ms, "")),
        };
        let mut page = PageBuilder::new(filter);
        loop {
            let members: Vec<String> = redis::cmd("ZRANGEBYLEX")
                .arg(BY_TIME)
                .arg(&from)
                .arg("+")
                .arg("LIMIT")
                .arg(0)
                .arg(PAGE)
                .query_async(&mut con)
                .await
                .map_err(|e| JournalError::backend("read", e))?;
            let Some(last) = members.last() else {
                return Ok(page.last());
            };
            from = format!("({last}");
            let full = members.len() as isize == PAGE;
            let keys: Vec<String> = (members.iter())
                .filter_map(|m| parse_member(m))
                .map(|(_, k)| format!("{RECORD}{k}"))
                .collect();
            let found: Vec<Option<Vec<u8>>> = if keys.is_empty() {
                Vec::new()
            } else {
                redis::cmd("MGET")
                    .arg(&keys)
                    .query_async(&mut con)
                    .await
                    .map_err(|e| JournalError::backend("read", e))?
            };
            for json in found.into_iter().flatten() {
                let record: JournalRecord = serde_json::from_slice(&json)
                    .map_err(|e| JournalError::backend("decode", e))?;
                if let Some(done) = page.push(record) {
                    return Ok(done);
                }
            }
            if !full {
                return Ok(page.last());
            }
        }
    }

    /// Writes one batch: its keys watched and read, merged, and written in
    /// one transaction; `Ok(false)` when another writer touched one of them.
    async fn write(
        con: &mut ConnectionManager,
        events: &[JournalEvent],
        retention: Duration,
    ) -> Result<bool, JournalError> {
        let mut keys: Vec<&str> = events.iter().map(|e| &*e.key).collect();
        keys.sort_unstable();
        keys.dedup();
        let stored: Vec<String> = keys.iter().map(|k| format!("{RECORD}{k}")).collect();
        redis::cmd("WATCH")
            .arg(&stored)
            .query_async::<()>(con)
            .await
            .map_err(|e| JournalError::backend("write", e))?;
        let old: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
            .arg(&stored)
            .query_async(con)
            .await
            .map_err(|e| JournalError::backend("write", e))?;
        let mut merged: HashMap<&str, (Option<u64>, JournalRecord)> = HashMap::new();
        for (key, json) in keys.iter().zip(old) {
            let record = json.and_then(|j| serde_json::from_slice::<JournalRecord>(&j).ok());
            if let Some(r) = record {
                merged.insert(key, (Some(r.last_seen_ms), r));
            }
        }
        for event in events {
            let (_, record) = merged
                .entry(&event.key)
                .or_insert_with(|| (None, JournalRecord::first(event)));
            record.add(event);
        }
        let ttl = u64::try_from(retention.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut tx = redis::pipe();
        tx.atomic();
        for (key, (old_seen, record)) in &merged {
            let json =
                serde_json::to_vec(record).map_err(|e| JournalError::backend("encode", e))?;
            tx.cmd("SET")
                .arg(format!("{RECORD}{key}"))
                .arg(json)
                .arg("PX")
                .arg(ttl)
                .ignore();
            if let Some(at) = old_seen.filter(|at| *at != record.last_seen_ms) {
                tx.cmd("ZREM").arg(BY_TIME).arg(member(at, key)).ignore();
            }
            tx.cmd("ZADD")
                .arg(BY_TIME)
                .arg(0)
                .arg(member(record.last_seen_ms, key))
                .ignore();
        }
        // `EXEC` answers nil when a watched key changed: nothing was written.
        let done: Option<()> = tx
            .query_async(con)
            .await
            .map_err(|e| JournalError::backend("commit", e))?;
        Ok(done.is_some())
    }

    /// Removes the time index's entries past the retention (their records
    /// expire by themselves).
    async fn prune(&self, before_ms: u64) -> Result<(), JournalError> {
        let mut con = self.reads.clone();
        redis::cmd("ZREMRANGEBYLEX")
            .arg(BY_TIME)
            .arg("-")
            .arg(format!("({}", member(before_ms, "")))
            .query_async::<()>(&mut con)
            .await
            .map_err(|e| JournalError::backend("prune", e))
    }

    /// The writer: batches of events on a connection of its own (for
    /// `WATCH`), and every `prune_every` the pruning, until every sender is
    /// gone. A batch that cannot be written is dropped and counted.
    pub(super) async fn write_loop(
        self,
        mut inbox: Inbox,
        retention: Duration,
        prune_every: Duration,
    ) {
        let mut every = tokio::time::interval(prune_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        let mut con: Option<ConnectionManager> = None;
        loop {
            let first = tokio::select! {
                got = inbox.recv() => match got {
                    Some(command) => command,
                    None => break,
                },
                _ = every.tick() => {
                    let _ = self.prune(now_ms().saturating_sub(retention_ms)).await;
                    continue;
                }
            };
            let (events, flushed) = inbox.batch(first);
            let mut tries = 0;
            while !events.is_empty() {
                let written = match &mut con {
                    Some(c) => Self::write(c, &events, retention).await,
                    None => match manager(&self.client).await {
                        Ok(c) => Self::write(con.insert(c), &events, retention).await,
                        Err(e) => Err(e),
                    },
                };
                match written {
                    Ok(true) => break,
                    Ok(false) | Err(_) if tries < WRITE_TRIES => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(10 * u64::from(tries))).await;
                    }
                    Ok(false) | Err(_) => {
                        tracing::warn!(events = events.len(), "journal batch not written");
                        inbox.lost(events.len());
                        break;
                    }
                }
            }
            for done in flushed {
                let _ = done.send(());
            }
        }
    }
}
