//! A journal of notifications: one record per distinct stored key, for the
//! operator who must answer "the channel says it sent X at 02:14: did we run
//! it, what did we answer, why not?".
//!
//! Each guarded request adds a [`JournalEvent`]: the record of its key
//! counts the copies, when the first and the last came, what each got (its
//! [`Outcome`](crate::Outcome)) and what the upstream answered the copy that
//! ran. Events go through a bounded channel to one writer task, so a request
//! never waits for the journal: when the channel is full the event is
//! dropped and counted ([`Journal::dropped`]). The writer commits a batch at
//! a time to a [redb](https://docs.rs/redb) file (the embedded queue's
//! engine: pure Rust, atomic commits, one process at a time) and removes the
//! records not seen for the retention, in bounded batches.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::journal::{Journal, JournalEvent, JournalFilter, JournalOptions};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let dir = std::env::temp_dir().join(format!("journal-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let (journal, writer) = Journal::open(dir.join("journal.redb"), JournalOptions::new()).unwrap();
//! let writer = tokio::spawn(writer);
//! for outcome in ["executed", "replayed", "replayed"] {
//!     journal.record(JournalEvent::new("idem:stripe:/notify:evt_1", "stripe", "/notify", outcome));
//! }
//! journal.flush().await;
//! let record = journal.get("idem:stripe:/notify:evt_1").await.unwrap().unwrap();
//! assert_eq!(record.copies, 3);
//! assert_eq!(record.outcomes["replayed"], 2);
//! let found = journal.query(&JournalFilter::default().outcome("executed")).await.unwrap();
//! assert_eq!(found.len(), 1);
//! # drop(journal); writer.await.unwrap(); std::fs::remove_dir_all(&dir).unwrap();
//! # }
//! ```

mod bill;
mod business;
mod db;
mod reconcile;
mod record;
#[cfg(feature = "sql")]
mod sql;

pub use self::bill::{parse_alipay_bill, parse_wechatpay_bill, Bill, BillError, BillLine};
pub use self::business::{format_yuan, parse_yuan, Business};
pub use self::reconcile::{channel_presets, reconcile, Finding, FindingKind};
pub use self::record::JournalRecord;

use self::db::Db;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One copy of a notification, as the journal takes it.
#[derive(Debug, Clone)]
pub struct JournalEvent {
    key: Arc<str>,
    preset: Arc<str>,
    route: Arc<str>,
    outcome: &'static str,
    at_ms: u64,
    status: Option<u16>,
    upstream: Option<(u16, u64)>,
    attempt: bool,
    note: Option<String>,
    // Boxed: most events have neither, and the channel holds 65,536 events.
    business: Option<Box<Business>>,
    body: Option<Box<(String, u64, bool)>>,
}

impl JournalEvent {
    /// A copy of the notification stored as `key`, guarded by `preset` on
    /// `route`, that got `outcome` (an [`Outcome`](crate::Outcome)'s label), now.
    pub fn new(
        key: impl Into<Arc<str>>,
        preset: impl Into<Arc<str>>,
        route: impl Into<Arc<str>>,
        outcome: &'static str,
    ) -> Self {
        Self {
            key: key.into(),
            preset: preset.into(),
            route: route.into(),
            outcome,
            at_ms: now_ms(),
            status: None,
            upstream: None,
            attempt: false,
            note: None,
            business: None,
            body: None,
        }
    }

    /// What the notification is about (its transaction, order and amount),
    /// for reconciliation with the channel's bill.
    pub fn business(mut self, business: Business) -> Self {
        self.business = Some(Box::new(business));
        self
    }

    /// The request's raw body, its first `max` bytes kept (as UTF-8, bytes
    /// that are not replaced by U+FFFD); a longer body is marked truncated.
    pub fn body(mut self, body: &[u8], max: usize) -> Self {
        let kept = &body[..body.len().min(max)];
        let text = String::from_utf8_lossy(kept).into_owned();
        let len = u64::try_from(body.len()).unwrap_or(u64::MAX);
        self.body = Some(Box::new((text, len, body.len() > max)));
        self
    }

    /// The status this copy was answered.
    pub fn status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }

    /// What the upstream answered this copy (it ran), and how long it took.
    pub fn upstream(mut self, status: u16, took: Duration) -> Self {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        self.upstream = Some((status, ms));
        self
    }

    /// This event is a delivery attempt from the queue (acknowledge-then-deliver routes).
    pub fn attempt(mut self) -> Self {
        self.attempt = true;
        self
    }

    /// An operator's action on the key (e.g. "forgotten by ops@host"),
    /// kept in the record's notes.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    /// When it happened, in milliseconds since the Unix epoch (defaults to now).
    pub fn at_ms(mut self, at_ms: u64) -> Self {
        self.at_ms = at_ms;
        self
    }
}

/// Which records [`Journal::query`] returns: all of them by default, newest
/// last, at most 1,000.
#[derive(Debug, Clone)]
pub struct JournalFilter {
    since_ms: u64,
    until_ms: u64,
    route: Option<String>,
    outcome: Option<String>,
    limit: usize,
}

impl Default for JournalFilter {
    fn default() -> Self {
        Self {
            since_ms: 0,
            until_ms: u64::MAX,
            route: None,
            outcome: None,
            limit: 1000,
        }
    }
}

impl JournalFilter {
    /// Records whose last copy came at or after `ms` (since the Unix epoch).
    pub fn since_ms(mut self, ms: u64) -> Self {
        self.since_ms = ms;
        self
    }

    /// Records whose first copy came at or before `ms`.
    pub fn until_ms(mut self, ms: u64) -> Self {
        self.until_ms = ms;
        self
    }

    /// Records of this route only.
    pub fn route(mut self, route: impl Into<String>) -> Self {
        self.route = Some(route.into());
        self
    }

    /// Records with at least one copy that got this outcome.
    pub fn outcome(mut self, outcome: impl Into<String>) -> Self {
        self.outcome = Some(outcome.into());
        self
    }

    /// At most this many records. Defaults to 1,000.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    fn matches(&self, r: &JournalRecord) -> bool {
        r.last_seen_ms >= self.since_ms
            && r.first_seen_ms <= self.until_ms
            && self.route.as_deref().is_none_or(|p| r.route == p)
            && self
                .outcome
                .as_deref()
                .is_none_or(|o| r.outcomes.get(o).is_some_and(|n| *n > 0))
    }
}

/// How a [`Journal`] keeps its records.
#[derive(Debug, Clone)]
pub struct JournalOptions {
    retention: Duration,
    capacity: usize,
    prune_every: Duration,
}

impl JournalOptions {
    /// The defaults: 7 days of retention, 65,536 events in the channel.
    pub const fn new() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
            capacity: 65_536,
            prune_every: Duration::from_secs(10),
        }
    }

    /// Records not seen for this long are removed. Defaults to 7 days.
    pub const fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often the writer removes the records past the retention (in
    /// batches of 1,000 until none is left) and, in the redb file, makes its
    /// commits durable. Defaults to 10 seconds.
    pub const fn prune_every(mut self, every: Duration) -> Self {
        self.prune_every = every;
        self
    }

    /// Events the channel holds before new ones are dropped (and counted).
    /// Defaults to 65,536.
    pub const fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }
}

impl Default for JournalOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// Why the journal could not be opened or read.
#[derive(Debug, Clone)]
pub struct JournalError(Arc<str>);

impl JournalError {
    fn new(message: impl Into<Arc<str>>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JournalError {}

enum Command {
    Event(JournalEvent),
    Flush(oneshot::Sender<()>),
}

/// The journal: cheap to clone; [`record`](Self::record) never waits.
#[derive(Clone)]
pub struct Journal {
    tx: mpsc::Sender<Command>,
    dropped: Arc<AtomicU64>,
    db: Backend,
}

/// Where the records are.
#[derive(Clone)]
enum Backend {
    Redb(Db),
    #[cfg(feature = "sql")]
    Sql(self::sql::SqlDb),
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

impl Journal {
    /// Opens (or creates) the journal file at `path`; returns the journal
    /// and its writer, a future to spawn. The writer ends once every clone
    /// of the journal is dropped and what they recorded is written.
    pub fn open(
        path: impl AsRef<Path>,
        options: JournalOptions,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), JournalError> {
        let db = Db::open(path.as_ref())?;
        let (tx, rx) = mpsc::channel(options.capacity.max(1));
        let journal = Self {
            tx,
            dropped: Arc::default(),
            db: Backend::Redb(db.clone()),
        };
        let writer = db.write_loop(rx, options.retention, options.prune_every);
        Ok((journal, writer))
    }

    /// The journal in a SQL database (feature `sql`): `postgres://…`,
    /// `mysql://…` (`mariadb://…`) or `sqlite:PATH`, the URL a
    /// [`SqlStore`](crate::store::SqlStore) takes, so that the records live
    /// beside the store's. One row per stored key in the table
    /// `idempotency_journal` (created if missing: `journal_key` the stored
    /// key's bytes, `last_seen_ms`, `record` the record as JSON), indexed by
    /// `last_seen_ms`; each batch of events is one transaction that locks
    /// the rows it merges into (in key order), so that instances sharing the
    /// database merge their copies without losing any. Retention pruning
    /// deletes at most 1,000 rows per statement. Returns the journal and its
    /// writer, a future to spawn.
    #[cfg(feature = "sql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sql")))]
    pub async fn connect(
        url: &str,
        options: JournalOptions,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), JournalError> {
        let db = self::sql::SqlDb::connect(url).await?;
        let (tx, rx) = mpsc::channel(options.capacity.max(1));
        let journal = Self {
            tx,
            dropped: Arc::default(),
            db: Backend::Sql(db.clone()),
        };
        let writer = db.write_loop(rx, options.retention, options.prune_every);
        Ok((journal, writer))
    }

    /// Adds `event`; when the channel is full it is dropped and counted
    /// (with the `metrics` feature also as `idempotency_journal_dropped_total`).
    pub fn record(&self, event: JournalEvent) {
        if self.tx.try_send(Command::Event(event)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("idempotency_journal_dropped_total").increment(1);
        }
    }

    /// Events dropped because the channel was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Waits until every event recorded before this call is written.
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Command::Flush(done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    /// The record of `key`.
    pub async fn get(&self, key: &str) -> Result<Option<JournalRecord>, JournalError> {
        match &self.db {
            Backend::Redb(db) => db.get(key),
            #[cfg(feature = "sql")]
            Backend::Sql(db) => db.get(key).await,
        }
    }

    /// The records `filter` selects, oldest last copy first.
    pub async fn query(&self, filter: &JournalFilter) -> Result<Vec<JournalRecord>, JournalError> {
        match &self.db {
            Backend::Redb(db) => db.query(filter),
            #[cfg(feature = "sql")]
            Backend::Sql(db) => db.query(filter).await,
        }
    }
}
