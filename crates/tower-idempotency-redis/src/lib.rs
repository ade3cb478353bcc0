//! The Redis store of [`tower_idempotency`](https://docs.rs/tower-idempotency): many instances share one record
//! per key, on a standalone Redis or a Redis Cluster. Add it to a service
//! that runs more than one instance, or that must not run a handler twice
//! after a restart.
//!
//! ```no_run
//! use tower_idempotency::IdempotencyLayer;
//! use tower_idempotency_redis::RedisStore;
//!
//! # async fn run() -> Result<(), tower_idempotency::store::StoreError> {
//! let store = RedisStore::standalone("redis://127.0.0.1:6379/").await?;
//! let layer = IdempotencyLayer::wechatpay_v3().with_store(store);
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! Everything public is on [`RedisStore`]; its docs list the value layout,
//! what a request costs in Redis commands and how failures map to
//! [`StoreError`]s. In short:
//!
//! | path | commands |
//! |---|---|
//! | first copy (runs the inner service) | 1 `EVALSHA` to claim, 1 `EVALSHA` to complete (or release), 1 `EVALSHA` per renewal (every `lease/3`) |
//! | repeat of a completed record | 0 commands when this instance holds it in its local tier, else 1 `EVALSHA` |
//! | duplicate of a running request | 1 `EVALSHA` to claim, 1 more each time the record changes; plus, per instance and key (not per waiter), 1 `GETRANGE` per poll interval while anyone waits |

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod epoch;
mod ops;
mod poller;
mod scripts;

use self::epoch::{Epoch, EPOCH_INTERVAL};

use self::poller::KeyPollers;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, RedisError};
use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower_idempotency_core::store::CompletedCache as Completed;
use tower_idempotency_core::store::{StoreError, StoreErrorKind};

/// A [`Store`](tower_idempotency_core::store::Store) in Redis, standalone or Cluster.
///
/// Each record is **one Redis string** under one key; the claim script also
/// keeps the key's fencing counter under a second key in the same Cluster
/// slot, so every command and script works unchanged across Cluster slots:
///
/// | state | value | expiry |
/// |---|---|---|
/// | in flight | `0xF1`, owner token (16 bytes), fingerprint (16 bytes), fencing token (decimal) | `PX lease` |
/// | completed | version byte `0x01`, fingerprint, status, flags, headers, trailers, body | `PX window` |
/// | fence counter (`{key}%fence`) | the last fencing token of the key (decimal) | `PX lease + 60 s` |
/// | an object's position (`{object}%pos`) | 24 hex digits: the version (sign bit flipped), then the state's rank | `PX ttl` of its last advance |
///
/// # Fencing tokens
///
/// A claim that wins gets the fencing token `max(counter + 1, server time in
/// µs)` (`TIME`), in the claim script. The counter outlives the claim by a
/// minute, so a release, a lease that ran out or a forgotten record followed
/// at once by a new claim still gets a larger token; once the counter has
/// expired, the server's clock, a minute or more later, is larger than every
/// token before. So the tokens of one key grow across release, takeover,
/// forget, window expiry and a Redis that lost its data, as long as the
/// server's clock does not step back by more than the time since the last
/// claim of the key.
///
/// # What a request costs
///
/// | path | commands |
/// |---|---|
/// | first copy (runs the inner service) | 1 `EVALSHA` to claim, 1 `EVALSHA` to complete (or release), plus 1 `EVALSHA` per renewal (every `lease/3` while it runs) |
/// | repeat of a completed record | none when this instance holds it in its [local tier](RedisStore::local_max_bytes) (it completed or replayed it before), else 1 `EVALSHA` (the claim returns the record and its remaining window) |
/// | duplicate of a running request | 1 `EVALSHA` to claim, then 1 `EVALSHA` each time the record changes |
/// | client token: issue / consume | 1 `SET … PX` / 1 `EVALSHA` (compare and delete) |
/// | an object's position: advance / read | 1 `EVALSHA` (compare and set) / 1 `GET` |
///
/// Waiting duplicates on one instance share **one poller per key**: it sends
/// one `GETRANGE key 0 16` (17 bytes back) every
/// [`poll_interval`](RedisStore::poll_interval) (25 ms by default) while at
/// least one duplicate waits, and wakes them all when the owner completes,
/// releases or loses the claim. Each woken duplicate then claims again (one
/// `EVALSHA`), replays the record or takes over. So a storm of *n* copies of
/// one key on one instance costs about `n` claims plus one small read per
/// interval, not `n` reads per interval. When the owner runs on the same
/// instance, its complete or release wakes the waiters at once. Scripts are
/// sent as `EVALSHA`; the
/// first call after a server (re)start costs one extra `SCRIPT LOAD`.
///
/// # Failure behaviour
///
/// Every Redis error becomes a [`StoreError`]: I/O timeouts are
/// [`StoreErrorKind::Timeout`], values this crate cannot read (a foreign
/// value under the key, a record from a newer version) are
/// [`StoreErrorKind::Corrupt`], everything else is
/// [`StoreErrorKind::Backend`]. The dedup layer then applies its
/// [`OnStoreError`](https://docs.rs/tower-idempotency/latest/tower_idempotency/enum.OnStoreError.html) policy. The connections reconnect by
/// themselves: a command that meets a dropped connection fails, the next ones
/// succeed once the server is back.
///
/// [`complete`](tower_idempotency_core::store::Store::complete) also succeeds when the key is **absent**
/// (the owner's lease ran out and nobody claimed it since): the inner service
/// did succeed, and recording that prevents a second execution. It never
/// overwrites another owner's claim or a completed record.
///
/// # Durability: exactly once across a Redis restart
///
/// A completed record must outlive a Redis restart, or the next retry of
/// its key runs the inner service again. Turn on the append-only file and
/// sync it on every write:
///
/// ```text
/// appendonly yes
/// appendfsync always     # or `everysec`, accepting the loss of up to a second
/// ```
///
/// (`kill -9` of Redis in the middle of a storm lost nothing with
/// `appendfsync always`.) RDB snapshots alone lose everything written since
/// the last snapshot.
///
/// To notice a Redis that lost its data anyway (a `FLUSHALL`, a restart
/// without persistence, a failover to an empty replica), the store writes an
/// **epoch marker** on first use: the key `idem:epoch` (after the
/// [prefix](RedisStore::key_prefix)), `SET NX`, without expiry. Each
/// instance looks at it in the background about once a
/// [second](RedisStore::epoch_check_interval) (one `GET`); when a marker it
/// saw is gone or replaced it writes a new one, counts the event
/// ([`data_loss_events`](RedisStore::data_loss_events), and the `metrics`
/// counter `idempotency_store_data_loss_total`) and warns (feature
/// `tracing`). On a Cluster the marker lives on one node: it tells of that
/// node's loss only.
///
/// ```no_run
/// use tower_idempotency_redis::RedisStore;
/// use tower_idempotency::IdempotencyLayer;
///
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = RedisStore::standalone("redis://127.0.0.1:6379/").await?;
/// let layer = IdempotencyLayer::wechatpay_v3().with_store(store);
/// // Cluster: RedisStore::cluster(["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/"]).await?
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Connections
///
/// Generic over the connection: [`ConnectionManager`] (standalone, the
/// default), [`ClusterConnection`] (see [`RedisClusterStore`]) or any other
/// clonable [`ConnectionLike`]. Clones share the connection and the pollers.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_idempotency_redis::RedisStore;
///
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = RedisStore::standalone("redis://127.0.0.1:6379/")
///     .await?
///     .key_prefix("shop:")
///     .poll_interval(Duration::from_millis(20));
/// # let _ = store; Ok(()) }
/// ```
pub struct RedisStore<C = ConnectionManager> {
    conn: C,
    prefix: Cow<'static, str>,
    poll_interval: Duration,
    pollers: KeyPollers,
    /// Completed records this instance has seen, until their window ends.
    local: Option<Arc<Completed>>,
    /// Counts this instance's `forget`s: a record read or completed while
    /// one ran is not copied into the local tier (it may be the record that
    /// was just forgotten).
    forgets: Arc<std::sync::atomic::AtomicU64>,
    epoch: Arc<Epoch>,
    epoch_interval: Option<Duration>,
}

/// The default budget of the local tier: 64 MiB.
const LOCAL_TIER_BYTES: u64 = 64 << 20;

/// A [`RedisStore`] over a Redis Cluster.
pub type RedisClusterStore = RedisStore<ClusterConnection>;

impl<C: Clone> Clone for RedisStore<C> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            prefix: self.prefix.clone(),
            poll_interval: self.poll_interval,
            pollers: self.pollers.clone(),
            local: self.local.clone(),
            forgets: self.forgets.clone(),
            epoch: self.epoch.clone(),
            epoch_interval: self.epoch_interval,
        }
    }
}

impl<C> fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// The timeouts the constructors give the connections: one second to
/// connect, and one second per command (the dedup layer's own store timeout
/// also defaults to one second).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

impl RedisStore<ConnectionManager> {
    /// Connects to a standalone Redis (`redis://host:port/db`, `rediss://`
    /// with TLS features of the `redis` crate, `redis+unix://`).
    ///
    /// The connection is a [`ConnectionManager`]: one multiplexed connection
    /// that reconnects by itself after a drop (a command that meets the drop
    /// fails after a few quick attempts; later commands reconnect again, for
    /// as long as the outage lasts). Connecting and each command time out
    /// after one second. Fails if the server cannot be reached now.
    pub async fn standalone(url: impl IntoConnectionInfo) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| map_err("connect", e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            // A command that meets a dropped connection waits for the
            // reconnection attempts (50 + 100 + 200 ms when the server
            // refuses): fail within the layer's store timeout, and try again
            // on the next command.
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| map_err("connect", e))?;
        Ok(Self::from_connection(conn))
    }
}

impl RedisStore<ClusterConnection> {
    /// Connects to a Redis Cluster through one or more of its nodes
    /// (`redis://host:port/`).
    ///
    /// The connection follows slot moves and reconnects by itself.
    /// Connecting and each command time out after one second. Fails if no
    /// node can be reached now.
    pub async fn cluster<I, T>(nodes: I) -> Result<Self, StoreError>
    where
        I: IntoIterator<Item = T>,
        T: IntoConnectionInfo,
    {
        let client = ClusterClient::builder(nodes)
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .build()
            .map_err(|e| map_err("connect", e))?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| map_err("connect", e))?;
        Ok(Self::from_connection(conn))
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store over a connection you built (for other settings, TLS, auth,
    /// or a [`MultiplexedConnection`](redis::aio::MultiplexedConnection)).
    /// It should reconnect by itself and have a response timeout.
    pub fn from_connection(conn: C) -> Self {
        Self {
            conn,
            prefix: Cow::Borrowed(""),
            poll_interval: Duration::from_millis(25),
            pollers: KeyPollers::new(),
            local: Some(Arc::new(Completed::new(LOCAL_TIER_BYTES, false))),
            forgets: Arc::default(),
            epoch: Epoch::new(),
            epoch_interval: Some(EPOCH_INTERVAL),
        }
    }

    /// How often this instance looks at the epoch marker (one `GET`, in the
    /// background, on a claim once the interval has passed); `None` turns
    /// the marker off. Defaults to one second.
    pub fn epoch_check_interval(mut self, interval: Option<Duration>) -> Self {
        self.epoch_interval = interval;
        self
    }

    /// How many times this instance (and its clones) found that Redis lost
    /// its data: the epoch marker it saw before was gone or replaced.
    pub fn data_loss_events(&self) -> u64 {
        self.epoch.losses()
    }

    /// The local tier: completed records are immutable, so this instance
    /// keeps those it completed or replayed (for the rest of their window,
    /// the least recently used evicted first) in at most `max_bytes` of
    /// memory, measured as the memory store measures its budget, and
    /// answers repeats without a Redis round trip. `0` turns it off.
    /// Defaults to 64 MiB.
    pub fn local_max_bytes(mut self, max_bytes: u64) -> Self {
        self.local = (max_bytes > 0).then(|| Arc::new(Completed::new(max_bytes, false)));
        self
    }

    /// Prepended to every key, as it is. The keys the dedup layer passes are
    /// already scoped (`idem:preset:route:…`), so this is only needed to
    /// share a Redis with other users. Defaults to none.
    ///
    /// In the layer's keys `%`, `{` and `}` are stored as `%25`, `%7B` and
    /// `%7D`, so that a client cannot choose a Cluster hash tag; a hash tag
    /// in this prefix (`"{idem}:"`) is kept, and puts every key in one slot.
    pub fn key_prefix(mut self, prefix: impl Into<Cow<'static, str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How often one instance looks at a key that duplicates are waiting on
    /// (one `GETRANGE` per interval and key, shared by all its waiters).
    /// Capped at one second. Defaults to 25 milliseconds.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.clamp(Duration::from_millis(1), Duration::from_secs(1));
        self
    }

    /// The connection.
    pub fn connection(&self) -> &C {
        &self.conn
    }

    fn full_key(&self, key: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + key.len() + 8);
        k.push_str(&self.prefix);
        // Keys carry client-chosen text; escape braces so that no client can
        // pick a Cluster hash tag (`{…}`) and pile its keys on one slot.
        // `%` is escaped too, so the mapping stays one-to-one.
        for c in key.chars() {
            match c {
                '%' => k.push_str("%25"),
                '{' => k.push_str("%7B"),
                '}' => k.push_str("%7D"),
                c => k.push(c),
            }
        }
        k
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Never poisoned in a way that matters: every critical section is a few
    // map operations.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn map_err(op: &str, e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else {
        StoreErrorKind::Backend
    };
    StoreError::new(kind, format!("redis {op} failed: {e}")).with_source(e)
}

fn corrupt(what: impl fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("unreadable idempotency record in redis: {what}"),
    )
}
