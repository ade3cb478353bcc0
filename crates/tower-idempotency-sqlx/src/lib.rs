//! The SQL store of [`tower_idempotency`](https://docs.rs/tower-idempotency): PostgreSQL, MySQL / MariaDB and
//! SQLite (on sqlx), one table whose primary key is the stored key, so the
//! database's unique index is what lets one claim win; and a record that a
//! handler completes in its own transaction ([`CompleteIn`]), so that the
//! business write and the record commit together or not at all.
//!
//! An `Idempotency-Key` API whose records live in the shop's SQLite file
//! (`postgres://…` or `mysql://…` the same way, with their feature;
//! `cargo add tower-idempotency-sqlx --features sqlite`, and
//! `tower-idempotency`, `axum`, `tokio` with `full`):
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use tower_idempotency::IdempotencyLayer;
//! use tower_idempotency_sqlx::SqlStore;
//!
//! async fn create_order(body: String) -> String {
//!     format!("order created from {body}\n")
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Creates the table `idempotency_records` if it is missing.
//!     let store = SqlStore::connect("sqlite:shop.db").await?;
//!     let layer = IdempotencyLayer::idempotency_key().with_store(store);
//!     let app = Router::new().route("/orders", post(create_order).layer(layer));
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app).await?;
//!     Ok(())
//! }
//! ```
//!
//! Everything public is on [`SqlStore`]; the statements live in one file per
//! database (`postgres.rs`, `mysql.rs`, `sqlite.rs`), as constants.
//!
//! # Feature flags
//!
//! One feature per database, none on by default: a build compiles only the
//! sqlx drivers it asks for.
//!
//! | feature | what it adds |
//! |---|---|
//! | `postgres` | PostgreSQL: `postgres://` and `postgresql://` URLs in [`SqlStore::connect`], `SqlStore::postgres` and `SqlStore::as_postgres`, [`SqlConnection`] for `PgConnection`; waiters woken by `LISTEN` / `NOTIFY` |
//! | `mysql` | MySQL and MariaDB: `mysql://` and `mariadb://` URLs, `SqlStore::mysql` and `SqlStore::as_mysql`, [`SqlConnection`] for `MySqlConnection` |
//! | `sqlite` | SQLite: `sqlite:` URLs (a file), `SqlStore::sqlite` and `SqlStore::as_sqlite`, [`SqlConnection`] for `SqliteConnection` |
//!
//! ```sh
//! # not on crates.io yet: from a clone of the repository
//! cargo add tower-idempotency-sqlx --path ../tower-idempotency/crates/tower-idempotency-sqlx --features postgres
//! ```
//!
//! [`SqlStore::connect`] refuses the URL of a database whose feature is off
//! ([`StoreErrorKind::Unsupported`], naming the feature). Without any of
//! the three the crate is empty.

// Without a database there is nothing to build a store on: the crate is
// empty.
#![cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

/// The assignments that turn a row into a [`RELEASED`] one, up to
/// `expires_at = ` (the dialect's clock follows).
macro_rules! released {
    () => {
        "state = 0, owner_token = NULL, lease_until = NULL, fingerprint = NULL, \
         response = NULL, expires_at = "
    };
}

/// How long the sweep keeps a [`RELEASED`] row past its expiry, in
/// milliseconds: while it is there, a new claim's fence is one more than
/// the row's.
macro_rules! fence_keep_ms {
    () => {
        "60000"
    };
}

mod complete_in;
#[cfg(feature = "mysql")]
mod mysql;
mod ops;
mod positions;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod state;
mod watch;

pub use complete_in::{CompleteIn, SqlConnection};
pub use state::{InvalidIdentifier, RowId, StateMachine, StateMove};

use self::complete_in::CompleteInError;
use self::watch::KeyPollers;
#[cfg(feature = "mysql")]
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgPool, PgPoolOptions};
#[cfg(feature = "sqlite")]
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::fmt;
#[cfg(feature = "sqlite")]
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};
use tower_idempotency_core::store::{OwnerToken, StoreError, StoreErrorKind};

/// A [`Store`](tower_idempotency_core::store::Store) in a SQL database: PostgreSQL,
/// MySQL / MariaDB or SQLite (on sqlx).
///
/// Every record is **one row** of the table `idempotency_records`, whose
/// primary key is the stored key, so the database's unique index is what
/// lets one claim win:
///
/// | column | what |
/// |---|---|
/// | `idem_key` | the stored key (bytes), primary key |
/// | `state` | 0 released or forgotten, 1 in flight, 2 completed, 3 client token, 4 client token taken |
/// | `owner_token` | the claim's owner (16 bytes); for a taken token, the request that took it |
/// | `fence` | the fencing token of the row's last claim (see below) |
/// | `lease_until` | end of the lease of an in-flight claim |
/// | `fingerprint` | fingerprint of the request (16 bytes) |
/// | `response` | the completed record: status, headers, trailers, body |
/// | `created_at` | when the claim was made |
/// | `expires_at` | when the row may be deleted: the lease's end, then the window's |
///
/// Times are milliseconds since the Unix epoch, **read from the database's
/// clock**, so that instances whose clocks differ still agree on when a
/// lease ends. [`migrate`](SqlStore::migrate) creates the table and its index
/// on `expires_at` if they are missing; every constructor runs it.
///
/// # Statements
///
/// | call | statements |
/// |---|---|
/// | claim | 1 `INSERT … ON CONFLICT DO UPDATE … WHERE` (PostgreSQL, SQLite: inserts an absent key, or takes over a row whose lease or window ended; `RETURNING` says whether it won); when it did not win, 1 `SELECT` of the row (MySQL has no `RETURNING`: 1 `INSERT … ON DUPLICATE KEY UPDATE`, then the `SELECT`, which also reads the winner's fencing token) |
/// | complete | 1 upsert that changes only the owner's claim (MySQL: an `UPDATE`, and an `INSERT … WHERE NOT EXISTS` if the row was swept) |
/// | renew, release | 1 `UPDATE` checked against the owner token |
/// | client token: issue / consume | 1 upsert / 1 `UPDATE` |
/// | advance (an object's position, table `idempotency_positions`) | 1 upsert whose `WHERE` compares the kept `(version, state_rank)` (MySQL: an upsert whose assignments compare it and a read of the row it locked, in one transaction); when refused, 1 `SELECT` of the position |
///
/// A duplicate that finds the key in flight waits on a watch that this
/// instance shares per key; every [`poll_interval`](SqlStore::poll_interval)
/// (25 ms by default), while anyone waits, one small `SELECT` (no response
/// bytes, up to 500 keys a statement) looks at every key this instance's
/// duplicates wait on, however many keys and waiters there are; an owner on the same instance wakes its
/// waiters at once when it completes or releases. On PostgreSQL, completing
/// and releasing also send a `NOTIFY` on the channel `idempotency_records`
/// (the key in hex; sent when the transaction commits), which one `LISTEN`
/// connection per store (opened by the first waiter) turns into an
/// immediate wake-up of that instance's waiters.
///
/// Expired rows are deleted in the background, in batches of at most
/// [`sweep`](SqlStore::sweep) rows, every minute by default; a row whose
/// time has passed is treated as absent before it is deleted. A released
/// claim or a forgotten record stays as a row of state 0 (absent to every
/// call) until a minute past its release, so that its fence is kept.
///
/// # Fencing tokens
///
/// Every claim that wins gets the fencing token `max(fence + 1, now in µs)`,
/// in the claim's own statement: `fence` is the row's (its last claim's, kept
/// through release and forget), `now` the database's clock in microseconds
/// (SQLite: of millisecond resolution), which is the token of a key that has
/// no row. So the tokens of one key grow across release, lease takeover,
/// forget and window expiry, even after the sweep deleted the row: a row is
/// swept only after its lease or window ended (at least a millisecond after
/// its claim) or a minute after its release, and by then the clock has
/// passed every token the row had, unless the database's clock steps back
/// by more than that. A resent claim by the same owner gets its own token
/// again.
///
/// # Completing inside the business transaction
///
/// Behind the dedup layer, the handler finds an
/// [`ActiveClaim`](tower_idempotency_core::store::ActiveClaim) in the request's extensions.
/// [`ActiveClaim::complete_in`](tower_idempotency_core::store::ActiveClaim::complete_in)
/// writes the completed record in the handler's own transaction on the same
/// database, so that the business write and the record commit together: an
/// instance that dies before the commit leaves neither (the next copy runs),
/// one that dies after it leaves both (the next copy replays).
///
/// ```no_run
/// use tower_idempotency_sqlx::SqlStore;
/// use tower_idempotency::IdempotencyLayer;
///
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = SqlStore::connect("postgres://app@localhost/shop").await?;
/// // or "mysql://app@localhost/shop", "sqlite:shop.db"
/// let layer = IdempotencyLayer::wechatpay_v3().with_store(store);
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqlStore {
    pool: Pool,
    poll_interval: Duration,
    pollers: KeyPollers,
    /// Whether the loop that looks at every watched key runs.
    polling: Arc<std::sync::atomic::AtomicBool>,
    /// Stops the background sweep when the last clone is dropped.
    sweeper: Arc<Mutex<Option<DropGuard>>>,
    /// PostgreSQL: the `LISTEN` task, started by the first waiter; stops
    /// when the last clone is dropped.
    #[cfg(feature = "postgres")]
    listener: Arc<std::sync::OnceLock<DropGuard>>,
}

/// One connection pool of one of the three databases (of those whose
/// feature is on: without any, no store can be built).
#[derive(Clone, Debug)]
pub(crate) enum Pool {
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
    #[cfg(feature = "mysql")]
    MySql(MySqlPool),
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
}

impl fmt::Debug for SqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let db = match self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Pool::MySql(_) => "mysql",
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => "sqlite",
        };
        f.debug_struct("SqlStore")
            .field("database", &db)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// How often expired rows are swept by default, and how many at most per
/// statement.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
const SWEEP_BATCH: u32 = 1000;
/// How long `connect` (and a call that finds every connection busy) waits
/// for a connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

impl SqlStore {
    /// Connects to `url` and applies the migrations:
    /// `postgres://user:password@host/db` (or `postgresql://`; feature
    /// `postgres`), `mysql://user:password@host/db` (MariaDB too;
    /// `mariadb://` is taken as `mysql://`; feature `mysql`), or
    /// `sqlite:PATH` (feature `sqlite`: created if missing, in WAL mode,
    /// with a 10 s busy timeout; `sqlite::memory:` is refused, each
    /// connection would see its own database). No TLS. The pool has sqlx's
    /// defaults (10 connections), and gives up on a connection after 5 s:
    /// a database that cannot be reached now fails `connect` within that.
    ///
    /// A URL of a database whose feature is off fails with
    /// [`StoreErrorKind::Unsupported`], which names the feature.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let mysql_url;
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => {
                mysql_url = format!("mysql://{rest}");
                &mysql_url
            }
            None => url,
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            connect_postgres(url).await
        } else if url.starts_with("mysql://") {
            connect_mysql(url).await
        } else if url.starts_with("sqlite:") {
            if url.contains(":memory:") || url.contains("mode=memory") {
                return Err(StoreError::new(
                    StoreErrorKind::Unsupported,
                    "an in-memory SQLite database is not shared between connections: use a file",
                ));
            }
            connect_sqlite(url).await
        } else {
            Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "unknown database URL: expected postgres://, mysql://, mariadb:// or sqlite:",
            ))
        }
    }

    /// A store over a PostgreSQL pool you built; applies the migrations.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres(pool: PgPool) -> Result<Self, StoreError> {
        Self::new(Pool::Postgres(pool)).await
    }

    /// A store over a MySQL / MariaDB pool you built; applies the migrations.
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn mysql(pool: MySqlPool) -> Result<Self, StoreError> {
        Self::new(Pool::MySql(pool)).await
    }

    /// A store over a SQLite pool you built; applies the migrations. Give
    /// it a busy timeout (sqlx's default is 5 s) and, for concurrent
    /// readers, WAL.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite(pool: SqlitePool) -> Result<Self, StoreError> {
        Self::new(Pool::Sqlite(pool)).await
    }

    async fn new(pool: Pool) -> Result<Self, StoreError> {
        let store = Self {
            pool,
            poll_interval: Duration::from_millis(25),
            pollers: KeyPollers::new(),
            polling: Arc::default(),
            sweeper: Arc::default(),
            #[cfg(feature = "postgres")]
            listener: Arc::default(),
        };
        store.migrate().await?;
        Ok(store.sweep(Some(SWEEP_EVERY), SWEEP_BATCH))
    }

    /// Creates the table and its index if they are missing. Safe to run
    /// from many instances at once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let err = |e| map_err("migrate", e);
        match self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(ref pool) => {
                let mut tx = pool.begin().await.map_err(err)?;
                sqlx::query(postgres::MIGRATE_LOCK)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
                for m in postgres::MIGRATIONS {
                    sqlx::query(m).execute(&mut *tx).await.map_err(err)?;
                }
                tx.commit().await.map_err(err)?;
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(ref pool) => {
                for m in mysql::MIGRATIONS {
                    sqlx::query(m).execute(pool).await.map_err(err)?;
                }
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(ref pool) => {
                for m in sqlite::MIGRATIONS {
                    sqlx::query(m).execute(pool).await.map_err(err)?;
                }
            }
        }
        Ok(())
    }

    /// How often one instance looks at the keys that duplicates wait on
    /// (one small `SELECT` per interval for all of them, up to 500 keys a
    /// statement, shared by all their waiters).
    /// Clamped to 1 ms – 1 s. Defaults to 25 milliseconds.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.clamp(Duration::from_millis(1), Duration::from_secs(1));
        self
    }

    /// Deletes expired rows in the background every `every` (`None`: never;
    /// call [`sweep_expired`](Self::sweep_expired) yourself), at most
    /// `batch` rows per statement, so that a large backlog never holds a
    /// long lock. Defaults to every minute, 1000 rows a batch. Needs a
    /// Tokio runtime; stops when the last clone of the store is dropped.
    pub fn sweep(self, every: Option<Duration>, batch: u32) -> Self {
        let mut sweeper = lock(&self.sweeper);
        // The old sweep (if any) stops.
        *sweeper = None;
        if let (Some(every), Ok(runtime)) = (every, tokio::runtime::Handle::try_current()) {
            let token = CancellationToken::new();
            runtime.spawn(watch::sweep_loop(
                self.pool.clone(),
                every,
                batch.max(1),
                token.clone(),
            ));
            *sweeper = Some(token.drop_guard());
        }
        drop(sweeper);
        self
    }

    /// Deletes every expired row now, `batch` at a time; returns how many.
    pub async fn sweep_expired(&self, batch: u32) -> Result<u64, StoreError> {
        watch::sweep_all(&self.pool, batch.max(1))
            .await
            .map_err(|e| map_err("sweep", e))
    }

    /// The PostgreSQL pool, if this store is on PostgreSQL (for the
    /// handler's own transactions).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn as_postgres(&self) -> Option<&PgPool> {
        match self.pool {
            Pool::Postgres(ref p) => Some(p),
            #[cfg(any(feature = "mysql", feature = "sqlite"))]
            _ => None,
        }
    }

    /// The MySQL / MariaDB pool, if this store is on MySQL.
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub fn as_mysql(&self) -> Option<&MySqlPool> {
        match self.pool {
            Pool::MySql(ref p) => Some(p),
            #[cfg(any(feature = "postgres", feature = "sqlite"))]
            _ => None,
        }
    }

    /// The SQLite pool, if this store is on SQLite.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn as_sqlite(&self) -> Option<&SqlitePool> {
        match self.pool {
            Pool::Sqlite(ref p) => Some(p),
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            _ => None,
        }
    }
}

#[cfg(feature = "postgres")]
async fn connect_postgres(url: &str) -> Result<SqlStore, StoreError> {
    let pool = PgPoolOptions::new()
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|e| map_err("connect", e))?;
    SqlStore::postgres(pool).await
}

#[cfg(feature = "mysql")]
async fn connect_mysql(url: &str) -> Result<SqlStore, StoreError> {
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|e| map_err("connect", e))?;
    SqlStore::mysql(pool).await
}

#[cfg(feature = "sqlite")]
async fn connect_sqlite(url: &str) -> Result<SqlStore, StoreError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|e| map_err("connect", e))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| map_err("connect", e))?;
    SqlStore::sqlite(pool).await
}

#[cfg(not(feature = "postgres"))]
async fn connect_postgres(_url: &str) -> Result<SqlStore, StoreError> {
    Err(without("postgres", "postgres://"))
}

#[cfg(not(feature = "mysql"))]
async fn connect_mysql(_url: &str) -> Result<SqlStore, StoreError> {
    Err(without("mysql", "mysql:// and mariadb://"))
}

#[cfg(not(feature = "sqlite"))]
async fn connect_sqlite(_url: &str) -> Result<SqlStore, StoreError> {
    Err(without("sqlite", "sqlite:"))
}

/// A URL of a database whose feature is off.
#[cfg(not(all(feature = "postgres", feature = "mysql", feature = "sqlite")))]
fn without(feature: &str, urls: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unsupported,
        format!(
            "{urls} URLs need the feature `{feature}` of tower-idempotency-sqlx, \
             which this build does not have"
        ),
    )
}

/// What `postgres::complete` and its siblings write (the argument of the
/// sealed [`SqlConnection`]'s hidden method).
#[doc(hidden)]
#[derive(Debug)]
pub struct CompleteArgs<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) owner: [u8; 16],
    pub(crate) fingerprint: [u8; 16],
    pub(crate) bytes: &'a [u8],
    pub(crate) window_ms: i64,
}

/// A row as [`postgres::READ`] and its siblings read it.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) state: i32,
    pub(crate) owner: Option<Vec<u8>>,
    pub(crate) fingerprint: Option<Vec<u8>>,
    pub(crate) response: Option<Vec<u8>>,
    /// Milliseconds until the row expires (0 or less: expired).
    pub(crate) remaining: i64,
    /// The fencing token of the row's last claim.
    pub(crate) fence: i64,
}

/// A released claim or a forgotten record: absent to every call, but kept
/// (with its fence) a minute past its expiry before the sweep deletes it.
pub(crate) const RELEASED: i32 = 0;
pub(crate) const IN_FLIGHT: i32 = 1;
pub(crate) const COMPLETED: i32 = 2;

/// An owner token as the table keeps it.
pub(crate) fn owner_bytes(token: OwnerToken) -> [u8; 16] {
    token.as_u128().to_be_bytes()
}

/// Milliseconds for a lease, window or ttl: at least 1, at most ten years.
pub(crate) fn millis(d: Duration) -> i64 {
    let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    ms.clamp(1, 10 * 365 * 24 * 3600 * 1000)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn map_err(op: &str, e: sqlx::Error) -> StoreError {
    let kind = match &e {
        sqlx::Error::PoolTimedOut => StoreErrorKind::Timeout,
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => StoreErrorKind::Corrupt,
        _ => StoreErrorKind::Backend,
    };
    StoreError::new(kind, format!("sql {op} failed: {e}")).with_source(e)
}

pub(crate) fn corrupt(what: impl fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("unreadable idempotency record in sql: {what}"),
    )
}
