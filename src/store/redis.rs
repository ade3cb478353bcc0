//! The Redis store: many instances, one record per key, standalone or Cluster.
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

use super::{
    Claim, CompletedRecord, OwnerToken, Store, StoreError, StoreErrorKind, StoredResponse, Watch,
    WatchSender,
};
use crate::Fingerprint;
use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{IntoConnectionInfo, RedisError, Script};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

/// First byte of an in-flight value.
const IN_FLIGHT: u8 = 0xF1;
/// First byte of a completed record (its format version).
const VERSION: u8 = 0x01;
/// The value of an issued client token.
const TOKEN_VALUE: &[u8] = b"\x7etoken";
/// A consumed client token: this tag, then the owner token of the request
/// that took it.
const TOKEN_TAKEN: &[u8] = b"\x7etaken";
/// Tag + owner token: what complete, renew and release compare.
const OWNER_LEN: usize = 17;
/// Tag + owner token + fingerprint.
const IN_FLIGHT_LEN: usize = 33;

/// Claims an absent key, or returns what is there: nil when acquired (also
/// when the key holds this very claim: a resent script), the
/// in-flight value, or the completed record with its remaining time to live
/// (for the local tier).
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v then
  if string.byte(v, 1) == 241 then
    if string.sub(v, 1, 17) == string.sub(ARGV[1], 1, 17) then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return false
    end
    return string.sub(v, 1, 33)
  end
  return {v, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
",
    )
});

/// Owner's claim (or an absent key) → completed record with the window.
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == false or string.sub(v, 1, 17) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
",
    )
});

/// Owner's claim → new lease.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 17) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
",
    )
});

/// Owner's claim → absent.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 17) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
",
    )
});

/// A client token → taken by this request (same expiry); never touches
/// anything else. Taken by this request already (a resent script) → 1 again.
static TAKE_TOKEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0
",
    )
});

/// A [`Store`] in Redis, standalone or Cluster.
///
/// Each record is **one Redis string** under one key, so every command and
/// script touches exactly one key and works unchanged across Cluster slots:
///
/// | state | value | expiry |
/// |---|---|---|
/// | in flight | `0xF1`, owner token (16 bytes), fingerprint (16 bytes) | `PX lease` |
/// | completed | version byte `0x01`, fingerprint, status, flags, headers, trailers, body | `PX window` |
///
/// # What a request costs
///
/// | path | commands |
/// |---|---|
/// | first copy (runs the inner service) | 1 `EVALSHA` to claim, 1 `EVALSHA` to complete (or release), plus 1 `EVALSHA` per renewal (every `lease/3` while it runs) |
/// | repeat of a completed record | none when this instance holds it in its [local tier](RedisStore::local_tier) (it completed or replayed it before), else 1 `EVALSHA` (the claim returns the record and its remaining window) |
/// | duplicate of a running request | 1 `EVALSHA` to claim, then 1 `EVALSHA` each time the record changes |
/// | client token: issue / consume | 1 `SET … PX` / 1 `EVALSHA` (compare and delete) |
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
/// [`OnStoreError`](crate::OnStoreError) policy. The connections reconnect by
/// themselves: a command that meets a dropped connection fails, the next ones
/// succeed once the server is back.
///
/// [`complete`](Store::complete) also succeeds when the key is **absent**
/// (the owner's lease ran out and nobody claimed it since): the inner service
/// did succeed, and recording that prevents a second execution. It never
/// overwrites another owner's claim or a completed record.
///
/// Keep Redis persistence (RDB or AOF) on if completed records must survive a
/// Redis restart; without it, a restart forgets every record and the next
/// retry of each key runs the inner service again.
///
/// ```no_run
/// use tower_idempotency::store::RedisStore;
/// use tower_idempotency::IdempotencyLayer;
///
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = RedisStore::standalone("redis://127.0.0.1:6379/").await?;
/// let layer = IdempotencyLayer::wechatpay_v3().store(store);
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
/// use tower_idempotency::store::RedisStore;
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
    pollers: Arc<Mutex<HashMap<String, Arc<Poller>>>>,
    local: Option<LocalTier>,
}

/// Completed records this instance has seen, until their window ends.
type LocalTier =
    moka::sync::Cache<String, (Arc<CompletedRecord>, Instant), foldhash::fast::RandomState>;

/// The default size of the local tier, in records.
const LOCAL_TIER_RECORDS: u64 = 100_000;

fn local_tier(records: u64) -> LocalTier {
    moka::sync::Cache::builder()
        .max_capacity(records)
        .time_to_live(Duration::from_secs(25 * 3600))
        .build_with_hasher(foldhash::fast::RandomState::default())
}

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
        let client = ::redis::Client::open(url).map_err(|e| map_err("connect", e))?;
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
    /// or a [`MultiplexedConnection`](::redis::aio::MultiplexedConnection)).
    /// It should reconnect by itself and have a response timeout.
    pub fn from_connection(conn: C) -> Self {
        Self {
            conn,
            prefix: Cow::Borrowed(""),
            poll_interval: Duration::from_millis(25),
            pollers: Arc::default(),
            local: Some(local_tier(LOCAL_TIER_RECORDS)),
        }
    }

    /// The local tier: completed records are immutable, so this instance
    /// keeps up to `records` of them (for the rest of their window) and
    /// answers repeats without a Redis round trip. `0` turns it off.
    /// Defaults to 100,000 records.
    pub fn local_tier(mut self, records: u64) -> Self {
        self.local = (records > 0).then(|| local_tier(records));
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

    /// The owner on this instance completed or released `key`: wake this
    /// instance's waiters now instead of at the poller's next look. (The
    /// poller itself stops at its next look, when it sees the change.)
    fn wake_local_waiters(&self, key: &str) {
        let poller = lock(&self.pollers).remove(key);
        if let Some(poller) = poller {
            poller.sender.notify();
        }
    }

    /// A watch shared by every waiter of this instance on `key` while it is
    /// held by the in-flight value starting with `owner`.
    fn watch(&self, key: String, owner: [u8; OWNER_LEN]) -> Watch {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Watch::poll(self.poll_interval);
        };
        let mut pollers = lock(&self.pollers);
        if let Some(poller) = pollers.get(&key) {
            if poller.owner == owner {
                *lock(&poller.last_subscribed) = Instant::now();
                return poller.sender.subscribe();
            }
        }
        let poller = Arc::new(Poller {
            owner,
            sender: WatchSender::new(),
            last_subscribed: Mutex::new(Instant::now()),
        });
        let watch = poller.sender.subscribe();
        // A replaced poller watched an older owner: it notices the change at
        // its next look and wakes its waiters.
        pollers.insert(key.clone(), poller.clone());
        drop(pollers);
        runtime.spawn(poll(
            self.conn.clone(),
            self.pollers.clone(),
            key,
            poller,
            self.poll_interval,
        ));
        watch
    }
}

/// One instance's look-out on one in-flight key.
struct Poller {
    owner: [u8; OWNER_LEN],
    sender: WatchSender,
    last_subscribed: Mutex<Instant>,
}

/// A poller stops after this long without a new waiter; it wakes the
/// waiters left, which claim again and start a new one if they still wait.
const POLLER_IDLE: Duration = Duration::from_secs(5);

async fn poll<C: ConnectionLike + Send>(
    mut conn: C,
    pollers: Arc<Mutex<HashMap<String, Arc<Poller>>>>,
    key: String,
    poller: Arc<Poller>,
    interval: Duration,
) {
    loop {
        tokio::time::sleep(interval).await;
        if lock(&poller.last_subscribed).elapsed() > POLLER_IDLE {
            break;
        }
        let head: Result<Vec<u8>, RedisError> = ::redis::cmd("GETRANGE")
            .arg(&key)
            .arg(0)
            .arg(OWNER_LEN - 1)
            .query_async(&mut conn)
            .await;
        match head {
            Ok(head) if head == poller.owner => {}
            Ok(_) => break,
            // The waiters claim again and meet the error themselves.
            Err(_) => break,
        }
    }
    {
        let mut pollers = lock(&pollers);
        if pollers.get(&key).is_some_and(|p| Arc::ptr_eq(p, &poller)) {
            pollers.remove(&key);
        }
    }
    poller.sender.notify();
}

/// Releases a claim that may have been made by a call that did not return
/// it. Safe whatever happened: the release compares the owner token, and it
/// is queued behind the claim on the same connection.
struct Undo<C: ConnectionLike + Send + 'static>(Option<(C, String, [u8; OWNER_LEN])>);

impl<C: ConnectionLike + Send + 'static> Drop for Undo<C> {
    fn drop(&mut self) {
        let Some((mut conn, key, owner)) = self.0.take() else {
            return;
        };
        // Without a runtime the lease runs out by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _: Result<i64, RedisError> = RELEASE
                    .key(&key)
                    .arg(&owner[..])
                    .invoke_async(&mut conn)
                    .await;
            });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Never poisoned in a way that matters: every critical section is a few
    // map operations.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Milliseconds for `PX` / `PEXPIRE`: at least 1, at most ten years.
fn millis(d: Duration) -> u64 {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    ms.clamp(1, 10 * 365 * 24 * 3600 * 1000)
}

fn owner_bytes(token: OwnerToken) -> [u8; OWNER_LEN] {
    let mut out = [0u8; OWNER_LEN];
    out[0] = IN_FLIGHT;
    out[1..].copy_from_slice(&token.as_u128().to_be_bytes());
    out
}

fn in_flight_value(token: OwnerToken, fingerprint: Fingerprint) -> [u8; IN_FLIGHT_LEN] {
    let mut out = [0u8; IN_FLIGHT_LEN];
    out[..OWNER_LEN].copy_from_slice(&owner_bytes(token));
    out[OWNER_LEN..].copy_from_slice(&fingerprint.to_bytes());
    out
}

fn map_err(op: &str, e: RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else {
        StoreErrorKind::Backend
    };
    StoreError::new(kind, format!("redis {op} failed: {e}"))
}

fn corrupt(what: impl fmt::Display) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("unreadable idempotency record in redis: {what}"),
    )
}

impl<C> Store for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let key = self.full_key(key);
        if let Some(local) = &self.local {
            if let Some((record, expires)) = local.get(&key) {
                if expires > Instant::now() {
                    return Ok(Claim::Completed(record));
                }
                local.invalidate(&key);
            }
        }
        let mut conn = self.conn.clone();
        // If this call is cancelled (the layer's store timeout) or fails after
        // the script may have run, nobody would own the claim it may have
        // made: release it, so it does not block the key for a whole lease.
        let mut undo = Undo(Some((self.conn.clone(), key.clone(), owner_bytes(token))));
        let found: ::redis::Value = CLAIM
            .key(&key)
            .arg(&in_flight_value(token, fingerprint)[..])
            .arg(millis(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("claim", e))?;
        undo.0 = None;
        let found = match found {
            ::redis::Value::Nil => return Ok(Claim::Acquired(token)),
            ::redis::Value::BulkString(found) => found,
            ::redis::Value::Array(mut parts) if parts.len() == 2 => {
                let (::redis::Value::BulkString(found), ::redis::Value::Int(ttl)) =
                    (parts.swap_remove(0), parts.swap_remove(0))
                else {
                    return Err(corrupt("claim answer of an unexpected shape"));
                };
                let record = Arc::new(decode(&found)?);
                if let (Some(local), Ok(ttl)) = (&self.local, u64::try_from(ttl)) {
                    let expires = Instant::now() + Duration::from_millis(ttl);
                    local.insert(key, (record.clone(), expires));
                }
                return Ok(Claim::Completed(record));
            }
            other => return Err(corrupt(format_args!("claim answered {other:?}"))),
        };
        match found.first() {
            Some(&IN_FLIGHT) if found.len() == IN_FLIGHT_LEN => {
                let mut owner = [0u8; OWNER_LEN];
                owner.copy_from_slice(&found[..OWNER_LEN]);
                let mut fp = [0u8; 16];
                fp.copy_from_slice(&found[OWNER_LEN..]);
                Ok(Claim::InFlight {
                    fingerprint: Fingerprint::from_bytes(fp),
                    watch: self.watch(key, owner),
                })
            }
            Some(&IN_FLIGHT) => Err(corrupt(format_args!(
                "in-flight value of {} bytes",
                found.len()
            ))),
            _ => Ok(Claim::Completed(Arc::new(decode(&found)?))),
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let value = encode(&record);
        let mut conn = self.conn.clone();
        let done: i64 = COMPLETE
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .arg(value)
            .arg(millis(window))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("complete", e))?;
        if done == 1 {
            if let Some(local) = &self.local {
                local.insert(key.clone(), (record, Instant::now() + window));
            }
            self.wake_local_waiters(&key);
        }
        Ok(done == 1)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let done: i64 = RENEW
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .arg(millis(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("renew", e))?;
        Ok(done == 1)
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let done: i64 = RELEASE
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("release", e))?;
        if done == 1 {
            self.wake_local_waiters(&key);
        }
        Ok(done == 1)
    }

    /// `SET key PX ttl`: one command.
    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        ::redis::cmd("SET")
            .arg(&key)
            .arg(TOKEN_VALUE)
            .arg("PX")
            .arg(millis(ttl))
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| map_err("put_token", e))
    }

    /// One script: marks the token taken by `owner` (keeping its expiry).
    /// Of concurrent takes exactly one sees `1`; an expired token is
    /// already gone. Needs Redis 6 or newer (`KEEPTTL`).
    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let mut taken_by = TOKEN_TAKEN.to_vec();
        taken_by.extend_from_slice(&owner.as_u128().to_be_bytes());
        let taken: i64 = TAKE_TOKEN
            .key(&key)
            .arg(TOKEN_VALUE)
            .arg(taken_by)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("take_token", e))?;
        Ok(taken == 1)
    }
}

// ---------------------------------------------------------------------------
// Record encoding
//
// version u8 | fingerprint [16] | status u16 | flags u8 (1 = body omitted,
// 2 = has trailers) | headers | trailers (if flag 2) | body: u32 len, bytes
// headers = count u32, then per entry: name u16 len, name, value u32 len, value
// All integers big-endian.
// ---------------------------------------------------------------------------

const FLAG_BODY_OMITTED: u8 = 1;
const FLAG_TRAILERS: u8 = 2;

/// Encodes a completed record into one binary string.
fn encode(record: &CompletedRecord) -> Vec<u8> {
    let res = &record.response;
    let headers_len = |h: &HeaderMap| -> usize {
        4 + h
            .iter()
            .map(|(k, v)| 6 + k.as_str().len() + v.len())
            .sum::<usize>()
    };
    let mut out = Vec::with_capacity(
        24 + headers_len(&res.headers)
            + res.trailers.as_ref().map_or(0, headers_len)
            + res.body.len(),
    );
    out.push(VERSION);
    out.extend_from_slice(&record.fingerprint.to_bytes());
    out.extend_from_slice(&res.status.as_u16().to_be_bytes());
    let mut flags = 0;
    if res.body_omitted {
        flags |= FLAG_BODY_OMITTED;
    }
    if res.trailers.is_some() {
        flags |= FLAG_TRAILERS;
    }
    out.push(flags);
    encode_headers(&mut out, &res.headers);
    if let Some(trailers) = &res.trailers {
        encode_headers(&mut out, trailers);
    }
    put_len32(&mut out, res.body.len());
    out.extend_from_slice(&res.body);
    out
}

fn put_len32(out: &mut Vec<u8>, len: usize) {
    // Bodies above 4 GiB are never cached (the dedup layer's limit is far
    // below); saturate rather than wrap so that decoding fails loudly.
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
}

fn encode_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    put_len32(out, headers.len());
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        // Header names are short tokens; http rejects anything near 64 KiB.
        let len = u16::try_from(name.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&name[..usize::from(len)]);
        put_len32(out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
}

/// Reads a record written by [`encode`].
fn decode(bytes: &[u8]) -> Result<CompletedRecord, StoreError> {
    let mut r = Reader { bytes, pos: 0 };
    let version = r.u8()?;
    if version != VERSION {
        return Err(corrupt(format_args!(
            "unknown record version {version:#04x} (written by a newer release, or not ours)"
        )));
    }
    let fingerprint = Fingerprint::from_bytes(r.array()?);
    let status = StatusCode::from_u16(r.u16()?).map_err(corrupt)?;
    let flags = r.u8()?;
    if flags & !(FLAG_BODY_OMITTED | FLAG_TRAILERS) != 0 {
        return Err(corrupt(format_args!("unknown flags {flags:#04x}")));
    }
    let headers = r.headers()?;
    let trailers = if flags & FLAG_TRAILERS != 0 {
        Some(r.headers()?)
    } else {
        None
    };
    let body_len = r.u32()?;
    let body = Bytes::copy_from_slice(r.take(body_len)?);
    if r.pos != bytes.len() {
        return Err(corrupt(format_args!(
            "{} trailing bytes",
            bytes.len() - r.pos
        )));
    }
    Ok(CompletedRecord {
        fingerprint,
        response: StoredResponse {
            status,
            headers,
            body,
            trailers,
            body_omitted: flags & FLAG_BODY_OMITTED != 0,
        },
    })
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| corrupt(format_args!("truncated at byte {}", self.pos)))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<usize, StoreError> {
        // u32 always fits in usize on the 32- and 64-bit targets we build for.
        Ok(u32::from_be_bytes(self.array()?) as usize)
    }

    fn headers(&mut self) -> Result<HeaderMap, StoreError> {
        let count = self.u32()?;
        // Each entry takes at least 6 bytes: refuse absurd counts before
        // allocating for them.
        if count > (self.bytes.len() - self.pos) / 6 {
            return Err(corrupt(format_args!("header count {count} too large")));
        }
        let mut headers = HeaderMap::with_capacity(count);
        for _ in 0..count {
            let name_len = usize::from(self.u16()?);
            let name = HeaderName::from_bytes(self.take(name_len)?).map_err(corrupt)?;
            let value_len = self.u32()?;
            let value = HeaderValue::from_bytes(self.take(value_len)?).map_err(corrupt)?;
            headers.append(name, value);
        }
        Ok(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(trailers: bool, omitted: bool) -> CompletedRecord {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.insert("x-bin", HeaderValue::from_bytes(b"\xff\xfe ok").unwrap());
        let trailers = trailers.then(|| {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", HeaderValue::from_static("0"));
            t.insert("grpc-message", HeaderValue::from_static(""));
            t
        });
        CompletedRecord {
            fingerprint: Fingerprint::of(b"order 42"),
            response: StoredResponse {
                status: StatusCode::CREATED,
                headers,
                body: if omitted {
                    Bytes::new()
                } else {
                    Bytes::from_static(
                        "{\"code\":\"SUCCESS\",\"message\":\"成功\"}\0\u{1}".as_bytes(),
                    )
                },
                trailers,
                body_omitted: omitted,
            },
        }
    }

    fn assert_same(a: &CompletedRecord, b: &CompletedRecord) {
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.response.status, b.response.status);
        assert_eq!(a.response.headers, b.response.headers);
        assert_eq!(a.response.body, b.response.body);
        assert_eq!(a.response.trailers, b.response.trailers);
        assert_eq!(a.response.body_omitted, b.response.body_omitted);
    }

    #[test]
    fn round_trips() {
        for (trailers, omitted) in [(false, false), (true, false), (false, true), (true, true)] {
            let rec = record(trailers, omitted);
            let bytes = encode(&rec);
            assert_eq!(bytes[0], VERSION);
            assert_same(&decode(&bytes).unwrap(), &rec);
        }
    }

    #[test]
    fn round_trips_empty_trailers_and_headers() {
        let rec = CompletedRecord {
            fingerprint: Fingerprint::from_bytes([7; 16]),
            response: StoredResponse {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::new(),
                trailers: Some(HeaderMap::new()),
                body_omitted: false,
            },
        };
        let bytes = encode(&rec);
        assert_eq!(bytes.len(), 1 + 16 + 2 + 1 + 4 + 4 + 4);
        assert_same(&decode(&bytes).unwrap(), &rec);
    }

    #[test]
    fn every_truncation_is_corrupt() {
        let bytes = encode(&record(true, false));
        for len in 0..bytes.len() {
            let err = decode(&bytes[..len]).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "len {len}");
        }
    }

    #[test]
    fn trailing_bytes_are_corrupt() {
        let mut bytes = encode(&record(false, false));
        bytes.push(0);
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
    }

    #[test]
    fn bad_fields_are_corrupt() {
        let good = encode(&record(false, false));
        // Unknown version.
        let mut bytes = good.clone();
        bytes[0] = 9;
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // In-flight tag is not a record.
        bytes[0] = IN_FLIGHT;
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // Status 1000.
        let mut bytes = good.clone();
        bytes[17..19].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // Unknown flag.
        let mut bytes = good.clone();
        bytes[19] = 0x80;
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // Header count far beyond the bytes.
        let mut bytes = good.clone();
        bytes[20..24].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // Invalid header name (a space).
        let mut bytes = good;
        let first_name = 24 + 2;
        bytes[first_name] = b' ';
        assert_eq!(decode(&bytes).unwrap_err().kind(), StoreErrorKind::Corrupt);
        // Garbage.
        assert_eq!(
            decode(b"hello world").unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
    }

    #[test]
    fn in_flight_layout() {
        let token = OwnerToken::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let fp = Fingerprint::from_bytes([0xaa; 16]);
        let v = in_flight_value(token, fp);
        assert_eq!(v[0], IN_FLIGHT);
        assert_eq!(&v[1..17], &token.as_u128().to_be_bytes());
        assert_eq!(&v[17..], &[0xaa; 16]);
        assert_eq!(&v[..OWNER_LEN], &owner_bytes(token));
    }

    #[test]
    fn millis_is_clamped() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(10)), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
        assert_eq!(millis(Duration::MAX), 10 * 365 * 24 * 3600 * 1000);
    }
}
