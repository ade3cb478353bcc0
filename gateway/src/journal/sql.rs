//! The journal in a SQL database (PostgreSQL, MySQL / MariaDB, SQLite): one
//! row per stored key in `idempotency_journal`, the record as JSON, an index
//! on the last copy's time for the time filters and the pruning.

use super::page::PageBuilder;
use super::{
    now_ms, Inbox, JournalError, JournalErrorKind, JournalEvent, JournalFilter, JournalPage,
    JournalRecord,
};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Row as _;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

/// Records removed in one statement, at most.
const PRUNE_BATCH: u64 = 1000;
/// Attempts of a batch after the first, when the database refuses it.
const WRITE_TRIES: u32 = 3;
/// Rows read per query while filtering.
const PAGE: i64 = 1000;

#[derive(Clone, Debug)]
pub(super) enum SqlDb {
    Postgres(PgPool),
    MySql(MySqlPool),
    Sqlite(SqlitePool),
}

const PG: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS idempotency_journal (
        journal_key  BYTEA PRIMARY KEY,
        last_seen_ms BIGINT NOT NULL,
        record       TEXT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS idempotency_journal_last_seen
        ON idempotency_journal (last_seen_ms, journal_key)",
];
const MY: &[&str] = &["CREATE TABLE IF NOT EXISTS idempotency_journal (
        journal_key  VARBINARY(1024) NOT NULL PRIMARY KEY,
        last_seen_ms BIGINT NOT NULL,
        record       MEDIUMTEXT CHARACTER SET utf8mb4 NOT NULL,
        INDEX idempotency_journal_last_seen (last_seen_ms, journal_key)
    )"];
const LITE: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS idempotency_journal (
        journal_key  BLOB PRIMARY KEY,
        last_seen_ms INTEGER NOT NULL,
        record       TEXT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS idempotency_journal_last_seen
        ON idempotency_journal (last_seen_ms, journal_key)",
];

/// The statements of one database: a placeholder row (so that the next
/// statement can lock it), the row locked, the row written (time, record,
/// key), a page of rows
/// by time after a (time, key) cursor, one record, a batch pruned.
struct Statements {
    placeholder: &'static str,
    lock: &'static str,
    update: &'static str,
    page: &'static str,
    get: &'static str,
    prune: &'static str,
}

const PG_SQL: Statements = Statements {
    placeholder: "INSERT INTO idempotency_journal (journal_key, last_seen_ms, record)
        VALUES ($1, 0, '') ON CONFLICT (journal_key) DO NOTHING",
    lock: "SELECT record FROM idempotency_journal WHERE journal_key = $1 FOR UPDATE",
    update: "UPDATE idempotency_journal SET last_seen_ms = $1, record = $2 WHERE journal_key = $3",
    page: "SELECT journal_key, last_seen_ms, record FROM idempotency_journal
        WHERE last_seen_ms >= $1 AND (last_seen_ms, journal_key) > ($2, $3) AND record <> ''
        ORDER BY last_seen_ms, journal_key LIMIT $4",
    get: "SELECT record FROM idempotency_journal WHERE journal_key = $1 AND record <> ''",
    // The condition again outside: a row a writer updated while the
    // DELETE waited for its lock is checked on its new version.
    prune: "DELETE FROM idempotency_journal WHERE last_seen_ms < $1 AND journal_key IN (
        SELECT journal_key FROM idempotency_journal WHERE last_seen_ms < $1
        ORDER BY last_seen_ms LIMIT 1000)",
};

const MY_SQL: Statements = Statements {
    // An existing row is locked exclusively at once (`INSERT IGNORE` would
    // take a shared lock, and two writers upgrading it deadlock).
    placeholder: "INSERT INTO idempotency_journal (journal_key, last_seen_ms, record)
        VALUES (?, 0, '') ON DUPLICATE KEY UPDATE journal_key = journal_key",
    lock: "SELECT record FROM idempotency_journal WHERE journal_key = ? FOR UPDATE",
    update: "UPDATE idempotency_journal SET last_seen_ms = ?, record = ? WHERE journal_key = ?",
    page: "SELECT journal_key, last_seen_ms, record FROM idempotency_journal
        WHERE last_seen_ms >= ? AND (last_seen_ms, journal_key) > (?, ?) AND record <> ''
        ORDER BY last_seen_ms, journal_key LIMIT ?",
    get: "SELECT record FROM idempotency_journal WHERE journal_key = ? AND record <> ''",
    prune: "DELETE FROM idempotency_journal WHERE last_seen_ms < ?
        ORDER BY last_seen_ms LIMIT 1000",
};

const LITE_SQL: Statements = Statements {
    placeholder: "INSERT INTO idempotency_journal (journal_key, last_seen_ms, record)
        VALUES (?1, 0, '') ON CONFLICT (journal_key) DO NOTHING",
    // The transaction is `BEGIN IMMEDIATE`: it holds the write lock already.
    lock: "SELECT record FROM idempotency_journal WHERE journal_key = ?1",
    update: "UPDATE idempotency_journal SET last_seen_ms = ?1, record = ?2 WHERE journal_key = ?3",
    page: "SELECT journal_key, last_seen_ms, record FROM idempotency_journal
        WHERE last_seen_ms >= ?1 AND (last_seen_ms, journal_key) > (?2, ?3) AND record <> ''
        ORDER BY last_seen_ms, journal_key LIMIT ?4",
    get: "SELECT record FROM idempotency_journal WHERE journal_key = ?1 AND record <> ''",
    prune: "DELETE FROM idempotency_journal WHERE last_seen_ms < ?1 AND journal_key IN (
        SELECT journal_key FROM idempotency_journal WHERE last_seen_ms < ?1
        ORDER BY last_seen_ms LIMIT 1000)",
};

fn ms(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn decode(json: &str) -> Result<JournalRecord, JournalError> {
    serde_json::from_str(json).map_err(|e| JournalError::backend("decode", e))
}

/// Runs `$body` with `$pool`, `$sql` (the statements) bound per database.
macro_rules! each_db {
    ($self:expr, |$pool:ident, $sql:ident| $body:expr) => {
        match $self {
            SqlDb::Postgres($pool) => {
                let $sql = &PG_SQL;
                $body
            }
            SqlDb::MySql($pool) => {
                let $sql = &MY_SQL;
                $body
            }
            SqlDb::Sqlite($pool) => {
                let $sql = &LITE_SQL;
                $body
            }
        }
    };
}

/// One key's record merged with its events, under the row's lock, in `$tx`.
macro_rules! merge_in {
    ($tx:expr, $sql:expr, $key:expr, $events:expr) => {{
        sqlx::query($sql.placeholder)
            .bind($key.as_bytes())
            .execute(&mut *$tx)
            .await
            .map_err(|e| JournalError::backend("write", e))?;
        let row = sqlx::query($sql.lock)
            .bind($key.as_bytes())
            .fetch_one(&mut *$tx)
            .await
            .map_err(|e| JournalError::backend("write", e))?;
        let old: String = row
            .try_get(0)
            .map_err(|e| JournalError::backend("read", e))?;
        let mut record = match old.as_str() {
            "" => JournalRecord::first($events[0]),
            json => decode(json).unwrap_or_else(|_| JournalRecord::first($events[0])),
        };
        for event in $events {
            record.add(event);
        }
        let json =
            serde_json::to_string(&record).map_err(|e| JournalError::backend("encode", e))?;
        let update = sqlx::query($sql.update)
            .bind(ms(record.last_seen_ms))
            .bind(json)
            .bind($key.as_bytes());
        update
            .execute(&mut *$tx)
            .await
            .map_err(|e| JournalError::backend("write", e))?;
    }};
}

impl SqlDb {
    /// Connects to `url` (`postgres://`, `mysql://`, `mariadb://` or
    /// `sqlite:PATH`) and creates the table if it is missing.
    pub(super) async fn connect(url: &str) -> Result<Self, JournalError> {
        let timeout = Duration::from_secs(5);
        let mysql_url;
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => {
                mysql_url = format!("mysql://{rest}");
                &mysql_url
            }
            None => url,
        };
        let db = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = PgPoolOptions::new()
                .acquire_timeout(timeout)
                .max_connections(4);
            Self::Postgres(
                pool.connect(url)
                    .await
                    .map_err(|e| JournalError::backend("connect", e))?,
            )
        } else if url.starts_with("mysql://") {
            let pool = MySqlPoolOptions::new()
                .acquire_timeout(timeout)
                .max_connections(4);
            Self::MySql(
                pool.connect(url)
                    .await
                    .map_err(|e| JournalError::backend("connect", e))?,
            )
        } else if url.starts_with("sqlite:") && !url.contains(":memory:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| JournalError::backend("connect", e))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .acquire_timeout(timeout)
                .max_connections(4);
            Self::Sqlite(
                pool.connect_with(options)
                    .await
                    .map_err(|e| JournalError::backend("connect", e))?,
            )
        } else {
            return Err(JournalError::new(
                JournalErrorKind::Invalid,
                "journal connect: expected postgres://, mysql://, mariadb:// or sqlite:PATH (a file)",
            ));
        };
        let migrations = match &db {
            Self::Postgres(_) => PG,
            Self::MySql(_) => MY,
            Self::Sqlite(_) => LITE,
        };
        for statement in migrations {
            each_db!(&db, |pool, _sql| sqlx::query(statement)
                .execute(pool)
                .await
                .map(drop))
            .map_err(|e| JournalError::backend("migrate", e))?;
        }
        Ok(db)
    }

    pub(super) async fn get(&self, key: &str) -> Result<Option<JournalRecord>, JournalError> {
        let row = each_db!(self, |pool, sql| sqlx::query(sql.get)
            .bind(key.as_bytes())
            .fetch_optional(pool)
            .await
            .map_err(|e| JournalError::backend("read", e))?
            .map(|row| row.try_get::<String, _>(0)));
        match row {
            Some(json) => decode(&json.map_err(|e| JournalError::backend("read", e))?).map(Some),
            None => Ok(None),
        }
    }

    pub(super) async fn query(&self, filter: &JournalFilter) -> Result<JournalPage, JournalError> {
        let mut page = PageBuilder::new(filter);
        let (ms0, key0) = filter.start();
        // Rows after (ms0, key0); with no cursor, every row at `since` too.
        let mut cursor: (i64, Vec<u8>) = match &filter.after {
            Some(_) => (ms(ms0), key0.as_bytes().to_vec()),
            None => (-1, Vec::new()),
        };
        loop {
            let rows: Vec<(Vec<u8>, i64, String)> = each_db!(self, |pool, sql| {
                let rows = sqlx::query(sql.page)
                    .bind(ms(filter.since_ms))
                    .bind(cursor.0)
                    .bind(cursor.1.clone())
                    .bind(PAGE)
                    .fetch_all(pool)
                    .await
                    .map_err(|e| JournalError::backend("read", e))?;
                rows.iter()
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(|e| JournalError::backend("read", e))?
            });
            let full = rows.len() as i64 == PAGE;
            for (key, at, json) in rows {
                if let Some(done) = page.push(decode(&json)?) {
                    return Ok(done);
                }
                cursor = (at, key);
            }
            if !full {
                return Ok(page.last());
            }
        }
    }

    /// Writes one batch of events: per key (in key order, so that two
    /// instances lock rows in the same order), the row locked, merged and
    /// written back, all in one transaction.
    async fn write(&self, events: &[JournalEvent]) -> Result<(), JournalError> {
        let mut by_key: BTreeMap<&str, Vec<&JournalEvent>> = BTreeMap::new();
        for event in events {
            by_key.entry(&*event.key).or_default().push(event);
        }
        match self {
            Self::Postgres(pool) => {
                let mut tx = pool
                    .begin()
                    .await
                    .map_err(|e| JournalError::backend("write", e))?;
                for (key, events) in &by_key {
                    merge_in!(tx, PG_SQL, key, events);
                }
                tx.commit()
                    .await
                    .map_err(|e| JournalError::backend("commit", e))
            }
            Self::MySql(pool) => {
                let mut tx = pool
                    .begin()
                    .await
                    .map_err(|e| JournalError::backend("write", e))?;
                for (key, events) in &by_key {
                    merge_in!(tx, MY_SQL, key, events);
                }
                tx.commit()
                    .await
                    .map_err(|e| JournalError::backend("commit", e))
            }
            Self::Sqlite(pool) => {
                let mut tx = pool
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(|e| JournalError::backend("write", e))?;
                for (key, events) in &by_key {
                    merge_in!(tx, LITE_SQL, key, events);
                }
                tx.commit()
                    .await
                    .map_err(|e| JournalError::backend("commit", e))
            }
        }
    }

    /// Removes up to one batch of records last seen before `before_ms`.
    async fn prune(&self, before_ms: u64) -> Result<u64, JournalError> {
        each_db!(self, |pool, sql| sqlx::query(sql.prune)
            .bind(ms(before_ms))
            .execute(pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| JournalError::backend("prune", e)))
    }

    /// The writer: batches of events, and every `prune_every` the pruning
    /// in batches, until every sender is gone. A batch the database refuses
    /// every time is dropped and counted.
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
                    let before = now_ms().saturating_sub(retention_ms);
                    while self.prune(before).await.is_ok_and(|n| n == PRUNE_BATCH) {}
                    continue;
                }
            };
            let (events, flushed) = inbox.batch(first);
            // A transaction the database rolled back (a deadlock with
            // another instance) left nothing: it is tried again.
            let mut tries = 0;
            while !events.is_empty() {
                match self.write(&events).await {
                    Ok(()) => break,
                    Err(_e) if tries == WRITE_TRIES => {
                        tracing::warn!(error = %_e, events = events.len(), "journal batch not written");
                        inbox.lost(events.len());
                        break;
                    }
                    Err(_) => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(20 * u64::from(tries))).await;
                    }
                }
            }
            for done in flushed {
                let _ = done.send(());
            }
        }
    }
}
