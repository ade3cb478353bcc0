//! A journal of notifications: one record per distinct stored key, for the
//! operator who must answer "the channel says it sent X at 02:14: did we run
//! it, what did we answer, why not?".
//!
//! Each guarded request adds a [`JournalEvent`]: the record of its key
//! counts the copies, when the first and the last came, what each got (its
//! [`Outcome`](tower_idempotency::Outcome)) and what the upstream answered the copy that
//! ran. Events go through a bounded channel to one writer task, so a request
//! never waits for the journal: when the channel is full the event is
//! dropped and counted ([`Journal::dropped`]). The writer commits a batch at
//! a time to a [redb](https://docs.rs/redb) file (the embedded queue's
//! engine: pure Rust, atomic commits, one process at a time) and removes the
//! records not seen for the retention, in bounded batches.
//!
//! ```
//! use std::time::Duration;
//! use idempotency_gateway::journal::{Journal, JournalEvent, JournalFilter, JournalOptions};
//! use tower_idempotency::Outcome;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let dir = std::env::temp_dir().join(format!("journal-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let (journal, writer) = Journal::open(dir.join("journal.redb"), JournalOptions::new()).unwrap();
//! let writer = tokio::spawn(writer);
//! for outcome in [Outcome::Executed, Outcome::Replayed, Outcome::Replayed] {
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

mod business;
mod db;
mod page;
mod record;
mod redis;
mod reopen;
mod sql;

pub(crate) use self::business::parse_yuan;
pub use self::business::{format_yuan, Business};
pub use self::page::{JournalCursor, JournalFilter, JournalPage};
pub use self::record::JournalRecord;

use self::db::Db;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What one event of a key got, as the journal counts it: a copy at the
/// idempotency layers, a delivery attempt from the queue, or an operator's
/// action.
///
/// ```
/// use idempotency_gateway::journal::JournalOutcome;
/// use tower_idempotency::Outcome;
///
/// assert_eq!(JournalOutcome::from(Outcome::Replayed).as_str(), "replayed");
/// assert_eq!(JournalOutcome::DeliveryFailed.to_string(), "delivery_failed");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JournalOutcome {
    /// A copy the channel sent, and what the idempotency layers did with it.
    Layer(tower_idempotency::Outcome),
    /// A delivery attempt from the queue reached the upstream, which
    /// accepted it (acknowledge-then-deliver routes).
    Delivered,
    /// A delivery attempt from the queue failed.
    DeliveryFailed,
    /// An operator forgot the key (it runs again on its next copy).
    Forgotten,
    /// The route's order answered the copy, or settled the delivery,
    /// itself: its object had moved past it, and the upstream was not
    /// called.
    Stale,
}

impl JournalOutcome {
    /// The outcome as records count it (their `outcomes`) and filters
    /// select it ([`JournalFilter::outcome`]): a layer's outcome as
    /// [`Outcome::as_str`](tower_idempotency::Outcome::as_str) writes it
    /// (`executed`, `replayed`, ...), else `delivered`, `delivery_failed`,
    /// `forgotten` or `stale`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Layer(outcome) => outcome.as_str(),
            Self::Delivered => "delivered",
            Self::DeliveryFailed => "delivery_failed",
            Self::Forgotten => "forgotten",
            Self::Stale => "stale",
        }
    }
}

impl From<tower_idempotency::Outcome> for JournalOutcome {
    fn from(outcome: tower_idempotency::Outcome) -> Self {
        Self::Layer(outcome)
    }
}

impl fmt::Display for JournalOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One copy of a notification, as the journal takes it.
#[derive(Debug, Clone)]
pub struct JournalEvent {
    key: Arc<str>,
    preset: Arc<str>,
    route: Arc<str>,
    outcome: JournalOutcome,
    at_ms: u64,
    status: Option<u16>,
    upstream: Option<(u16, u64)>,
    attempt: bool,
    verified: bool,
    note: Option<String>,
    /// The W3C trace id (32 lowercase hex digits) of the trace this copy ran in.
    trace_id: Option<Box<str>>,
    // Boxed: most events have neither.
    business: Option<Box<Business>>,
    body: Option<Box<(Vec<u8>, u64, bool)>>,
}

impl JournalEvent {
    /// A copy of the notification stored as `key`, guarded by `preset` on
    /// `route`, that got `outcome` (an [`Outcome`](tower_idempotency::Outcome)
    /// at the layers, or another [`JournalOutcome`]), now.
    pub fn new(
        key: impl Into<Arc<str>>,
        preset: impl Into<Arc<str>>,
        route: impl Into<Arc<str>>,
        outcome: impl Into<JournalOutcome>,
    ) -> Self {
        Self {
            key: key.into(),
            preset: preset.into(),
            route: route.into(),
            outcome: outcome.into(),
            at_ms: now_ms(),
            status: None,
            upstream: None,
            attempt: false,
            verified: false,
            note: None,
            trace_id: None,
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

    /// The request's raw body, its first `max` bytes kept as they came
    /// (bytes, whatever their encoding); a longer body is marked truncated.
    pub fn body(mut self, body: &[u8], max: usize) -> Self {
        let kept = body[..body.len().min(max)].to_vec();
        let len = u64::try_from(body.len()).unwrap_or(u64::MAX);
        self.body = Some(Box::new((kept, len, body.len() > max)));
        self
    }

    /// About how many bytes the event holds, for the channel's budget.
    fn size(&self) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        let business = self.business.as_ref().map_or(0, |b| {
            EVENT_OVERHEAD + text(&b.transaction_id) + text(&b.out_trade_no) + text(&b.trade_state)
        });
        EVENT_OVERHEAD
            + self.key.len()
            + self.preset.len()
            + self.route.len()
            + text(&self.note)
            + self.trace_id.as_ref().map_or(0, |t| t.len())
            + self.body.as_ref().map_or(0, |b| b.0.len())
            + business
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

    /// The sender of this copy was verified (a verify layer checked its
    /// signature). Reconciliation counts only verified records as proof
    /// that a payment ran.
    pub fn verified(mut self, verified: bool) -> Self {
        self.verified = verified;
        self
    }

    /// This event is a delivery attempt from the queue (acknowledge-then-deliver routes).
    pub fn attempt(mut self) -> Self {
        self.attempt = true;
        self
    }

    /// The trace this copy ran in: its W3C trace id, 32 lowercase hex
    /// digits (the one in the `traceparent` sent to the upstream), so that
    /// the record points to the trace. Anything else (an invalid or all-zero
    /// id) is ignored.
    pub fn trace_id(mut self, trace_id: &str) -> Self {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        let valid = trace_id.len() == 32
            && trace_id.bytes().all(hex)
            && trace_id.bytes().any(|b| b != b'0');
        if valid {
            self.trace_id = Some(trace_id.into());
        }
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

/// What an event costs the channel's budget beyond its strings.
const EVENT_OVERHEAD: usize = 160;

/// How a [`Journal`] keeps its records.
#[derive(Debug, Clone)]
pub struct JournalOptions {
    retention: Duration,
    capacity: usize,
    queue_bytes: usize,
    max_size: u64,
    prune_every: Duration,
}

impl JournalOptions {
    /// The defaults: 7 days of retention, at most 1 GiB of records in the
    /// file, 65,536 events or 64 MiB in the channel.
    pub const fn new() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
            capacity: 65_536,
            queue_bytes: 64 << 20,
            max_size: 1 << 30,
            prune_every: Duration::from_secs(10),
        }
    }

    /// The most bytes the records of a journal file ([`Journal::open`])
    /// take: past it the records last seen longest ago are removed first
    /// (counted as `idempotency_journal_pruned_total{reason="size"}`), so
    /// that senders who make up keys cannot fill the disk. The file itself
    /// is larger by redb's pages and index (about twice the records' size
    /// at most). Defaults to 1 GiB. A SQL journal is bounded by its
    /// retention and the database's own quota.
    pub const fn max_size(mut self, bytes: u64) -> Self {
        self.max_size = bytes;
        self
    }

    /// Bytes of events (their keys, ids and kept bodies) the channel holds
    /// before new ones are dropped (and counted), whatever their number.
    /// Defaults to 64 MiB.
    pub const fn queue_bytes(mut self, bytes: usize) -> Self {
        self.queue_bytes = bytes;
        self
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

/// Why the journal could not be opened or read: its [kind](Self::kind),
/// a message, and the backend's own error as its
/// [`source`](std::error::Error::source) where there was one.
#[derive(Debug, Clone)]
pub struct JournalError {
    kind: JournalErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The kind of a [`JournalError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum JournalErrorKind {
    /// The journal's backend (its file, Redis or the SQL database) failed
    /// or could not be reached; trying again later can succeed.
    Backend,
    /// What the caller gave cannot be read (a cursor that is not one).
    Invalid,
}

impl JournalError {
    pub(crate) fn new(kind: JournalErrorKind, message: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// The backend's error `e` while doing `what`, kept as the source.
    pub(crate) fn backend(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        let message = format!("journal {what}: {e}");
        Self {
            source: Some(Arc::new(e)),
            ..Self::new(JournalErrorKind::Backend, message)
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> JournalErrorKind {
        self.kind
    }
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for JournalError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

enum Command {
    Event(JournalEvent),
    Flush(oneshot::Sender<()>),
}

/// What the journal's handles and its writer share: the bytes of events in
/// the channel, and the events dropped.
#[derive(Default)]
struct Counters {
    queued: AtomicUsize,
    dropped: AtomicU64,
}

impl Counters {
    /// Counts `n` events that will never be written.
    fn drop_events(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        self.dropped.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("idempotency_journal_dropped_total").increment(n);
    }
}

/// The writer's end of the channel: takes events off the byte budget, and
/// counts what it cannot write.
struct Inbox {
    rx: mpsc::Receiver<Command>,
    counters: Arc<Counters>,
    /// The most bytes of events in one batch (one transaction): a batch's
    /// pages are all new, so a large one grows the file past the records.
    batch_bytes: usize,
}

/// Events written in one transaction, at most.
const BATCH: usize = 512;

impl Inbox {
    fn took(&self, command: &Command) {
        if let Command::Event(e) = command {
            self.counters.queued.fetch_sub(e.size(), Ordering::Relaxed);
        }
    }

    /// The next command (cancel-safe).
    async fn recv(&mut self) -> Option<Command> {
        let got = self.rx.recv().await;
        if let Some(command) = &got {
            self.took(command);
        }
        got
    }

    /// `first` and what else is waiting, up to a batch of events.
    fn batch(&mut self, first: Command) -> (Vec<JournalEvent>, Vec<oneshot::Sender<()>>) {
        let (mut events, mut flushed) = (Vec::new(), Vec::new());
        let mut next = Some(first);
        let mut bytes = 0;
        while let Some(command) = next.take() {
            match command {
                Command::Event(e) => {
                    bytes += e.size();
                    events.push(e);
                }
                Command::Flush(done) => flushed.push(done),
            }
            if events.len() < BATCH && bytes < self.batch_bytes {
                next = self.rx.try_recv().ok();
                if let Some(command) = &next {
                    self.took(command);
                }
            }
        }
        (events, flushed)
    }

    /// Counts a batch that could not be written.
    fn lost(&self, events: usize) {
        self.counters.drop_events(events);
    }
}

/// The journal: cheap to clone; [`record`](Self::record) never waits.
#[derive(Clone)]
pub struct Journal {
    tx: mpsc::Sender<Command>,
    counters: Arc<Counters>,
    queue_bytes: usize,
    db: Backend,
}

/// Where the records are.
#[derive(Clone)]
enum Backend {
    Redb(Db),
    Sql(self::sql::SqlDb),
    Redis(self::redis::RedisDb),
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

/// The handle and the writer's inbox of a new journal.
fn channel(options: &JournalOptions, db: Backend) -> (Journal, Inbox) {
    let (tx, rx) = mpsc::channel(options.capacity.max(1));
    let counters = Arc::new(Counters::default());
    let journal = Journal {
        tx,
        counters: counters.clone(),
        queue_bytes: options.queue_bytes,
        db,
    };
    let batch_bytes = usize::try_from((options.max_size / 32).clamp(64 << 10, 4 << 20));
    let inbox = Inbox {
        rx,
        counters,
        batch_bytes: batch_bytes.unwrap_or(4 << 20),
    };
    (journal, inbox)
}

impl Journal {
    /// Opens (or creates) the journal file at `path`; returns the journal
    /// and its writer, a future to spawn. The writer ends once every clone
    /// of the journal is dropped and what they recorded is written.
    pub fn open(
        path: impl AsRef<Path>,
        options: JournalOptions,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), JournalError> {
        let db = Db::open(path.as_ref(), options.max_size)?;
        let (journal, inbox) = channel(&options, Backend::Redb(db.clone()));
        let writer = db.write_loop(inbox, options.retention, options.prune_every);
        Ok((journal, writer))
    }

    /// The journal in a SQL database: `postgres://…`,
    /// `mysql://…` (`mariadb://…`) or `sqlite:PATH`, the URL a
    /// [`SqlStore`](tower_idempotency_sqlx::SqlStore) takes, so that the records live
    /// beside the store's. One row per stored key in the table
    /// `idempotency_journal` (created if missing: `journal_key` the stored
    /// key's bytes, `last_seen_ms`, `record` the record as JSON), indexed by
    /// `last_seen_ms`; each batch of events is one transaction that locks
    /// the rows it merges into (in key order), so that instances sharing the
    /// database merge their copies without losing any. Retention pruning
    /// deletes at most 1,000 rows per statement. Returns the journal and its
    /// writer, a future to spawn.
    pub async fn connect(
        url: &str,
        options: JournalOptions,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), JournalError> {
        let db = self::sql::SqlDb::connect(url).await?;
        let (journal, inbox) = channel(&options, Backend::Sql(db.clone()));
        let writer = db.write_loop(inbox, options.retention, options.prune_every);
        Ok((journal, writer))
    }

    /// The journal in Redis, shared by every instance
    /// that uses it: `redis://HOST:PORT[/DB]`, the URL a
    /// [`RedisStore`](tower_idempotency_redis::RedisStore) takes. One string per
    /// stored key (`{idempotency-journal}:r:KEY`, the record as JSON,
    /// expiring after the retention) and a sorted set
    /// `{idempotency-journal}:by_time` of the records by last copy; each
    /// batch of events is merged under `WATCH` and written in one
    /// `MULTI`/`EXEC`, tried again when another instance wrote one of its
    /// keys meanwhile, so that no copy is lost. Its size is bounded by the
    /// retention and Redis's `maxmemory`. Returns the journal and its
    /// writer, a future to spawn.
    pub async fn connect_redis(
        url: &str,
        options: JournalOptions,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), JournalError> {
        let db = self::redis::RedisDb::connect(url).await?;
        let (journal, inbox) = channel(&options, Backend::Redis(db.clone()));
        let writer = db.write_loop(inbox, options.retention, options.prune_every);
        Ok((journal, writer))
    }

    /// Adds `event`; when the channel is full (in events or in bytes) it is
    /// dropped and counted (with the `metrics` feature also as
    /// `idempotency_journal_dropped_total`).
    pub fn record(&self, event: JournalEvent) {
        let size = event.size();
        let queued = self.counters.queued.fetch_add(size, Ordering::Relaxed);
        // One event larger than the budget still goes into an empty channel.
        let full = queued > 0 && queued.saturating_add(size) > self.queue_bytes;
        if full || self.tx.try_send(Command::Event(event)).is_err() {
            self.counters.queued.fetch_sub(size, Ordering::Relaxed);
            self.counters.drop_events(1);
        }
    }

    /// Events dropped: the channel was full, or the writer could not write
    /// their batch.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
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
            Backend::Sql(db) => db.get(key).await,
            Backend::Redis(db) => db.get(key).await,
        }
    }

    /// The records `filter` selects, oldest last copy first.
    pub async fn query(&self, filter: &JournalFilter) -> Result<Vec<JournalRecord>, JournalError> {
        self.page(filter).await.map(|page| page.records)
    }

    /// One page of the records `filter` selects (at most its
    /// [`max_records`](JournalFilter::max_records), after its [`after`](JournalFilter::after)
    /// cursor), oldest last copy first, and where the next page starts. A
    /// record that gets a new copy while an operator pages moves to the
    /// end: it may be seen twice, never missed.
    pub async fn page(&self, filter: &JournalFilter) -> Result<JournalPage, JournalError> {
        match &self.db {
            Backend::Redb(db) => db.query(filter),
            Backend::Sql(db) => db.query(filter).await,
            Backend::Redis(db) => db.query(filter).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Journal, JournalCursor, JournalErrorKind, JournalOptions, JournalOutcome};
    use std::error::Error as _;
    use tower_idempotency::Outcome;

    /// A caller's mistake is told apart from a backend that failed, and a
    /// backend's failure keeps the backend's own error as its source.
    #[test]
    fn errors_say_their_kind_and_keep_their_source() {
        let bad = "x".parse::<JournalCursor>().unwrap_err();
        assert_eq!(bad.kind(), JournalErrorKind::Invalid);
        assert!(bad.source().is_none());

        let dir = std::env::temp_dir().join(format!("journal-error-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A directory where the file should be: the backend (redb, the file
        // system) refuses, and says why.
        let e = match Journal::open(&dir, JournalOptions::new()) {
            Ok(_) => panic!("a directory opened as a journal file"),
            Err(e) => e,
        };
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(e.kind(), JournalErrorKind::Backend, "{e}");
        assert!(e.source().is_some(), "{e}");
    }

    /// The words records count outcomes by: written to journals, read back
    /// by the admin API and by reconciliation, so they never change.
    #[test]
    fn outcomes_keep_their_words() {
        for (outcome, word) in [
            (JournalOutcome::Layer(Outcome::Executed), "executed"),
            (
                JournalOutcome::Layer(Outcome::ReplyDeadline),
                "reply_deadline",
            ),
            (JournalOutcome::Delivered, "delivered"),
            (JournalOutcome::DeliveryFailed, "delivery_failed"),
            (JournalOutcome::Forgotten, "forgotten"),
            (JournalOutcome::Stale, "stale"),
        ] {
            assert_eq!(outcome.as_str(), word);
            assert_eq!(outcome.to_string(), word);
        }
    }
}
