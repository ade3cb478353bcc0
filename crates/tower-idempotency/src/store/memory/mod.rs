//! The in-memory store: one process, nothing to start.

mod builder;

pub use builder::MemoryStoreBuilder;

use super::CompletedCache as Completed;
use super::{
    fence_floor, Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Ownership, Position,
    RecordState, Store, StoreError, WatchSender,
};
use crate::Fingerprint;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
// tokio's clock (the system's, unless a test pauses it): leases, windows
// and token lifetimes follow `tokio::time::pause` and `advance`.
use tokio::time::Instant;

const SHARDS: usize = 64;

/// The default store: in-flight claims in a sharded map, completed records
/// in a byte-bounded map that evicts the oldest first.
///
/// In-flight claims are never evicted (their number is bounded by the
/// requests running now). Each completed record is kept as **one buffer**
/// (its key, status, headers and body, decoded on replay), and the budget
/// [`max_bytes`](MemoryStoreBuilder::max_bytes) counts what records really
/// occupy: the buffer as the allocator rounds it plus a measured per-record
/// overhead (map node, hash table, allocator slack; about 140 bytes).
///
/// When the budget is full, the **least recently used** records go first
/// (a replay counts as a use); a fresh record is never refused. A record
/// larger than its shard can hold (the budget is split into up to 64
/// shards of at least 4 MiB; a smaller store is one shard) is kept without
/// its body, as a body past the dedup layer's `max_cached_body_bytes` is: the call
/// does not run again, and its replay has the status and headers, an empty
/// body and `idempotent-body-omitted: true`. A record
/// pushed out before its window ended is counted in
/// [`evicted_early`](MemoryStore::evicted_early) (and, with the `tracing`
/// feature, warned about at most once a minute with the budget that would
/// have held it): a retry of it runs the inner service again. Records whose
/// window ended are counted in [`expired`](MemoryStore::expired).
///
/// # Sizing
///
/// A record costs its body plus about 300 bytes (key, headers and
/// overhead); `benches/record_size.rs` measures it for your own responses.
/// Budget for a whole window of traffic: `rate × window × (body + 300)`,
/// e.g. 50 notifications a second kept 25 hours with 40-byte answers is
/// 4.5 M records, about 1.5 GiB. The window is the preset's, as long as its
/// channel retries: Adyen's 31 days at 5 notifications a second with its
/// 10-byte `[accepted]` is 13.4 M records, about 3.9 GiB (at 50 a second,
/// 39 GiB: keep such a window in Redis or a SQL database). The process's resident memory grows by
/// about the budget once the store is full (within 15 %, measured by
/// `benches/memory_budget.rs`), so size a container as its baseline plus
/// the budget plus 15 %. With the `metrics` feature the store exports
/// `idempotency_store_bytes`, `idempotency_store_records` and
/// `idempotency_store_evictions_total{reason="early"|"expired"}` (the gauges
/// sum every memory store of the process).
///
/// Every operation holds one shard's lock for a few map operations and never
/// awaits, so claim, complete, renew and release are atomic.
///
/// Fencing tokens come from one counter for the whole store, never below
/// this machine's clock in microseconds: they grow per key (and across the
/// store), and a restarted process, whose counter starts again, still hands
/// out larger ones than before as long as the clock did not step back.
///
/// ```
/// use tower_idempotency::store::MemoryStore;
/// let store = MemoryStore::builder().max_bytes(64 * 1024 * 1024).build();
/// assert_eq!(store.len(), 0);
/// assert_eq!(store.bytes_used(), 0);
/// assert_eq!(store.evicted_early(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

type Shard = Mutex<HashMap<Arc<str>, InFlight, RandomState>>;

struct Inner {
    hasher: RandomState,
    shards: Box<[Shard]>,
    completed: Completed,
    /// Client tokens: when each expires and which request took it.
    tokens: moka::sync::Cache<Arc<str>, ClientToken, RandomState>,
    /// Objects' applied positions, and when each runs out.
    positions: moka::sync::Cache<Arc<str>, Kept, RandomState>,
    /// The last fencing token handed out, for any key.
    fence: AtomicU64,
}

/// An object's applied position.
#[derive(Clone, Copy)]
struct Kept {
    position: Position,
    expires: Instant,
}

struct InFlight {
    token: OwnerToken,
    fence: u64,
    fingerprint: Fingerprint,
    deadline: Instant,
    /// When the owner claimed it (for `inspect`).
    since: Instant,
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

impl MemoryStore {
    /// A store with the default capacity (256 MiB of completed records).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the capacity.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many completed records were pushed out by newer ones before
    /// their window ended (a retry of one runs the inner service again).
    pub fn evicted_early(&self) -> u64 {
        self.inner.completed.evicted_early()
    }

    /// How many completed records were dropped because their window ended.
    pub fn expired(&self) -> u64 {
        self.inner.completed.expired()
    }

    /// How many completed records the store holds now.
    pub fn len(&self) -> u64 {
        self.inner.completed.len()
    }

    /// Whether the store holds no completed record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory the completed records occupy now, in bytes, by the same
    /// measure as the budget: never more than
    /// [`max_bytes`](Self::max_bytes).
    pub fn bytes_used(&self) -> u64 {
        self.inner.completed.bytes_used()
    }

    /// The budget set with [`MemoryStoreBuilder::max_bytes`].
    pub fn max_bytes(&self) -> u64 {
        self.inner.completed.max_bytes()
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
        let mut shard = self.shard(key);
        // The clock is read only when it decides something: not for a
        // replay (the completed records keep their own clock).
        let mut now = None;
        if let Some(current) = shard.get_mut(key) {
            let now = *now.get_or_insert_with(Instant::now);
            if current.token == token {
                // A resent claim finds its own claim: it is still the owner.
                current.deadline = now + lease;
                return Claim::Acquired(Ownership::new(token, current.fence));
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
        if let Some(record) = self.inner.completed.get(key) {
            return Claim::Completed(record);
        }
        let fence = self.next_fence();
        let now = now.unwrap_or_else(Instant::now);
        shard.insert(
            Arc::from(key),
            InFlight {
                token,
                fence,
                fingerprint,
                deadline: now + lease,
                since: now,
                watch: None,
            },
        );
        Claim::Acquired(Ownership::new(token, fence))
    }

    /// The next fencing token: one counter for the whole store, so it grows
    /// per key whatever happened to the key's record, and never below this
    /// machine's clock in microseconds, so that a restarted process (whose
    /// counter starts again) still hands out larger tokens than before.
    fn next_fence(&self) -> u64 {
        let floor = fence_floor();
        let mut last = self.inner.fence.load(Ordering::Relaxed);
        loop {
            let next = last.saturating_add(1).max(floor);
            match self.inner.fence.compare_exchange_weak(
                last,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return next,
                Err(seen) => last = seen,
            }
        }
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
        let _in_flight = shard.remove(key).expect("checked above");
        self.inner.completed.insert(key, &record, window);
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

    fn inspect_now(&self, key: &str) -> RecordState {
        let now = Instant::now();
        let shard = self.shard(key);
        if let Some(current) = shard.get(key).filter(|c| c.deadline > now) {
            return RecordState::InFlight {
                fingerprint: current.fingerprint,
                age: Some(now - current.since),
                lease_left: current.deadline - now,
            };
        }
        match self.inner.completed.peek(key) {
            Some((record, left)) => RecordState::Completed { record, left },
            None => RecordState::Absent,
        }
    }

    fn forget_now(&self, key: &str) -> Forgotten {
        let now = Instant::now();
        // The in-flight shard's lock is held while the record goes, so a
        // claim cannot slip in between.
        let shard = self.shard(key);
        if shard.get(key).is_some_and(|c| c.deadline > now) {
            return Forgotten::InFlight;
        }
        let deleted = self.inner.completed.remove(key);
        drop(shard);
        if deleted {
            Forgotten::Deleted
        } else {
            Forgotten::Absent
        }
    }

    fn replace_now(&self, key: &str, record: &CompletedRecord, window: Duration) -> bool {
        let now = Instant::now();
        // The in-flight shard's lock is held while the record changes, so a
        // claim cannot find the key absent in between.
        let shard = self.shard(key);
        if shard.get(key).is_some_and(|c| c.deadline > now) {
            return false;
        }
        if self.inner.completed.peek(key).is_none() {
            return false;
        }
        self.inner.completed.insert(key, record, window);
        drop(shard);
        true
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
            .field("completed", &self.len())
            .field("bytes_used", &self.bytes_used())
            .field("evicted_early", &self.evicted_early())
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

    fn inspect(
        &self,
        key: &str,
    ) -> impl std::future::Future<Output = Result<RecordState, StoreError>> + Send {
        std::future::ready(Ok(self.inspect_now(key)))
    }

    fn forget(
        &self,
        key: &str,
    ) -> impl std::future::Future<Output = Result<Forgotten, StoreError>> + Send {
        std::future::ready(Ok(self.forget_now(key)))
    }

    fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        std::future::ready(Ok(self.replace_now(key, &record, window)))
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

    fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> impl std::future::Future<Output = Result<Advance, StoreError>> + Send {
        use moka::ops::compute::Op;
        let now = Instant::now();
        let kept = Kept {
            position,
            expires: now + ttl,
        };
        // Calls on one object run one at a time: a compare-and-set.
        let mut answer = Advance::Moved;
        self.inner
            .positions
            .entry(Arc::from(object))
            .and_compute_with(|found| match found.map(|f| *f.value()) {
                Some(at) if at.expires > now && at.position >= position => {
                    answer = Advance::Behind(at.position);
                    Op::Nop
                }
                _ => Op::Put(kept),
            });
        std::future::ready(Ok(answer))
    }

    fn position(
        &self,
        object: &str,
    ) -> impl std::future::Future<Output = Result<Option<Position>, StoreError>> + Send {
        let at = self
            .inner
            .positions
            .get(object)
            .filter(|at| at.expires > Instant::now())
            .map(|at| at.position);
        std::future::ready(Ok(at))
    }
}
