//! The in-memory store: one process, nothing to start.

use super::{Claim, CompletedRecord, OwnerToken, Store, StoreError, WatchSender};
use crate::Fingerprint;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const SHARDS: usize = 64;

/// The default store: in-flight claims in a sharded map, completed records in
/// a [moka] cache bounded by bytes.
///
/// In-flight claims are never evicted (their number is bounded by the
/// requests running now). Completed records are evicted when the cache is
/// full, least useful first; a repeat of an evicted record runs the inner
/// service again, so size the cache for a window's worth of responses
/// ([`MemoryStoreBuilder::max_bytes`]). Evictions are counted
/// ([`MemoryStore::evictions`]).
///
/// Every operation holds one shard's lock for a few map operations and never
/// awaits, so claim, complete, renew and release are atomic.
///
/// [moka]: https://docs.rs/moka
///
/// ```
/// use tower_idempotency::store::MemoryStore;
/// let store = MemoryStore::builder().max_bytes(64 * 1024 * 1024).build();
/// assert_eq!(store.evictions(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

type Shard = Mutex<HashMap<Arc<str>, InFlight, RandomState>>;

struct Inner {
    hasher: RandomState,
    shards: Box<[Shard]>,
    completed: moka::sync::Cache<Arc<str>, Completed, RandomState>,
    /// Client tokens: when each expires and which request took it.
    tokens: moka::sync::Cache<Arc<str>, ClientToken, RandomState>,
    evictions: Arc<AtomicU64>,
}

struct InFlight {
    token: OwnerToken,
    fingerprint: Fingerprint,
    deadline: Instant,
    /// Created when the first duplicate waits; dropping it wakes them all.
    watch: Option<WatchSender>,
}

/// An issued client token.
#[derive(Clone, Copy)]
struct ClientToken {
    expires: Instant,
    /// The request that consumed it: its own resent take still succeeds.
    taken_by: Option<OwnerToken>,
}

#[derive(Clone)]
struct Completed {
    record: Arc<CompletedRecord>,
    expires: Instant,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
    max_tokens: u64,
    max_window: Duration,
}

impl MemoryStoreBuilder {
    /// The most bytes of completed records to keep (bodies, headers and a fixed
    /// overhead per record). Defaults to 256 MiB.
    pub const fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The most unconsumed client tokens to keep (tokens live at most 24 h).
    /// Defaults to 1,000,000.
    pub const fn max_tokens(mut self, tokens: u64) -> Self {
        self.max_tokens = tokens;
        self
    }

    /// The longest window any layer over this store uses: records are dropped
    /// from memory at the latest this long after they were written (each
    /// record also ends at its own layer's window). Defaults to 25 hours.
    pub const fn max_window(mut self, window: Duration) -> Self {
        self.max_window = window;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let evictions = Arc::new(AtomicU64::new(0));
        let counter = evictions.clone();
        let completed = moka::sync::Cache::builder()
            .max_capacity(self.max_bytes)
            .weigher(|key: &Arc<str>, value: &Completed| weight(key, &value.record))
            // One TTL for the cache (cheap) and each record's own window
            // checked on read: moka's per-entry expiry costs a timer-wheel
            // update on every insert.
            .time_to_live(self.max_window)
            .eviction_listener(move |_key, _value, cause| {
                if cause == moka::notification::RemovalCause::Size {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build_with_hasher(RandomState::default());
        let tokens = moka::sync::Cache::builder()
            .max_capacity(self.max_tokens)
            // Oldest first: a fresh token is never refused.
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            .time_to_live(Duration::from_secs(24 * 3600))
            .build_with_hasher(RandomState::default());
        let shards = (0..SHARDS)
            .map(|_| Mutex::new(HashMap::with_hasher(RandomState::default())))
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                hasher: RandomState::default(),
                shards,
                completed,
                tokens,
                evictions,
            }),
        }
    }
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024 * 1024,
            max_tokens: 1_000_000,
            max_window: Duration::from_secs(25 * 3600),
        }
    }
}

/// Approximate bytes a completed record holds.
fn weight(key: &str, record: &CompletedRecord) -> u32 {
    let res = &record.response;
    let headers: usize = res
        .headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 32)
        .sum();
    let trailers: usize = res.trailers.as_ref().map_or(0, |t| {
        t.iter().map(|(k, v)| k.as_str().len() + v.len() + 32).sum()
    });
    let total = 160 + key.len() + res.body.len() + headers + trailers;
    u32::try_from(total).unwrap_or(u32::MAX)
}

impl MemoryStore {
    /// A store with the default capacity (256 MiB of completed records).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the capacity.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many completed records were evicted because the store was full.
    pub fn evictions(&self) -> u64 {
        self.inner.completed.run_pending_tasks();
        self.inner.evictions.load(Ordering::Relaxed)
    }

    /// How many completed records the store holds now (approximate).
    pub fn completed_len(&self) -> u64 {
        self.inner.completed.run_pending_tasks();
        self.inner.completed.entry_count()
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<Arc<str>, InFlight, RandomState>> {
        let i = (self.inner.hasher.hash_one(key) as usize) % SHARDS;
        // A poisoned shard only means a panic elsewhere while it was held; the
        // map itself is always left consistent by the code below.
        self.inner.shards[i]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn claim_now(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Claim {
        let now = Instant::now();
        let mut shard = self.shard(key);
        if let Some(current) = shard.get_mut(key) {
            if current.token == token {
                // A resent claim finds its own claim: it is still the owner.
                current.deadline = now + lease;
                return Claim::Acquired(token);
            }
            if current.deadline > now {
                return Claim::InFlight {
                    fingerprint: current.fingerprint,
                    watch: current
                        .watch
                        .get_or_insert_with(WatchSender::new)
                        .subscribe(),
                };
            }
            // The owner's lease ran out: the key is claimable again. Dropping
            // the old entry wakes its waiters.
            shard.remove(key);
        }
        if let Some(done) = self.inner.completed.get(key) {
            if done.expires > now {
                return Claim::Completed(done.record);
            }
            self.inner.completed.invalidate(key);
        }
        shard.insert(
            Arc::from(key),
            InFlight {
                token,
                fingerprint,
                deadline: now + lease,
                watch: None,
            },
        );
        Claim::Acquired(token)
    }

    fn complete_now(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> bool {
        let mut shard = self.shard(key);
        match shard.get(key) {
            Some(current) if current.token == token => {}
            _ => return false,
        }
        let (key, _in_flight) = shard.remove_entry(key).expect("checked above");
        self.inner.completed.insert(
            key,
            Completed {
                record,
                expires: Instant::now() + window,
            },
        );
        // `_in_flight` (and its watch sender) drops after the record is
        // visible, so woken waiters find it.
        drop(shard);
        true
    }

    fn renew_now(&self, key: &str, token: OwnerToken, lease: Duration) -> bool {
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(current) if current.token == token => {
                current.deadline = Instant::now() + lease;
                true
            }
            _ => false,
        }
    }

    fn release_now(&self, key: &str, token: OwnerToken) -> bool {
        let mut shard = self.shard(key);
        match shard.get(key) {
            Some(current) if current.token == token => {
                shard.remove(key);
                true
            }
            _ => false,
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("completed", &self.inner.completed.entry_count())
            .field("evictions", &self.inner.evictions.load(Ordering::Relaxed))
            .finish()
    }
}

impl Store for MemoryStore {
    fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> impl std::future::Future<Output = Result<Claim, StoreError>> + Send {
        std::future::ready(Ok(self.claim_now(key, fingerprint, token, lease)))
    }

    fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        std::future::ready(Ok(self.complete_now(key, token, record, window)))
    }

    fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        std::future::ready(Ok(self.renew_now(key, token, lease)))
    }

    fn release(
        &self,
        key: &str,
        token: OwnerToken,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        std::future::ready(Ok(self.release_now(key, token)))
    }

    fn put_token(
        &self,
        key: &str,
        ttl: Duration,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.inner.tokens.insert(
            Arc::from(key),
            ClientToken {
                expires: Instant::now() + ttl,
                taken_by: None,
            },
        );
        std::future::ready(Ok(()))
    }

    fn take_token(
        &self,
        key: &str,
        owner: OwnerToken,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        use moka::ops::compute::Op;
        // Calls on one key run one at a time: of two concurrent takes by
        // different requests, one gets the token.
        let mut taken = false;
        self.inner
            .tokens
            .entry(Arc::from(key))
            .and_compute_with(|found| {
                let Some(found) = found else { return Op::Nop };
                let token = *found.value();
                if token.expires <= Instant::now() {
                    return Op::Remove;
                }
                match token.taken_by {
                    None => {
                        taken = true;
                        Op::Put(ClientToken {
                            taken_by: Some(owner),
                            ..token
                        })
                    }
                    Some(by) => {
                        taken = by == owner;
                        Op::Nop
                    }
                }
            });
        std::future::ready(Ok(taken))
    }
}
