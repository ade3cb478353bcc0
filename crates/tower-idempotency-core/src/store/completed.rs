//! Completed records in memory (the memory store, and the Redis store's
//! local tier): one buffer per record (key and encoded response together),
//! in shards kept in least-recently-used order, bounded by the bytes the
//! records really occupy.

use crate::store::codec;
use crate::store::{CompletedRecord, StoredResponse};
use bytes::Bytes;
use foldhash::fast::RandomState;
use hashlink::LinkedHashMap;
use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
// tokio's clock (the system's, unless a test pauses it): leases, windows
// and token lifetimes follow `tokio::time::pause` and `advance`.
use tokio::time::Instant;

/// What each record costs beyond its buffer, measured with
/// `benches/memory_budget.rs` (glibc, 64-bit): the map's node (key handle,
/// expiry and list links: 64 bytes as allocated), its share of the hash
/// table (9 bytes a bucket, at most 7/8 full, doubling as it grows), the
/// buffer's shared header once the record has been replayed (32 bytes), and
/// the allocator's slack.
pub(crate) const ENTRY_OVERHEAD: u64 = 136;

/// A shard holds at least this many bytes (a small store has one shard), so
/// that the newest records of a small store are never spread too thin.
const MIN_SHARD_BYTES: u64 = 4 << 20;
const MAX_SHARDS: u64 = 64;
/// Buffer header: written (seconds since the store started), key length.
const HEADER: usize = 8;

/// The bytes a buffer of `len` bytes occupies in the allocator: glibc rounds
/// a request plus its 8-byte header up to 16 (at least 32); above its mmap
/// threshold it maps whole pages.
fn alloc_size(len: usize) -> u64 {
    let len = len as u64;
    if len >= 128 * 1024 {
        (len + 16).div_ceil(4096) * 4096
    } else {
        ((len + 8 + 15) & !15).max(32)
    }
}

/// What a record of `len` buffer bytes is charged against the budget.
pub(crate) fn charge(len: usize) -> u64 {
    alloc_size(len) + ENTRY_OVERHEAD
}

/// One record: `written u32 | key length u32 | key | encoded record`.
struct Slot(Bytes);

impl Slot {
    fn key_len(&self) -> usize {
        u32::from_be_bytes([self.0[4], self.0[5], self.0[6], self.0[7]]) as usize
    }

    fn key(&self) -> &[u8] {
        &self.0[HEADER..HEADER + self.key_len()]
    }

    fn written(&self) -> u32 {
        u32::from_be_bytes([self.0[0], self.0[1], self.0[2], self.0[3]])
    }

    fn record(&self) -> Bytes {
        self.0.slice(HEADER + self.key_len()..)
    }
}

impl Borrow<[u8]> for Slot {
    fn borrow(&self) -> &[u8] {
        self.key()
    }
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Slot {}

impl Hash for Slot {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The same as hashing the key as `[u8]`, so lookups by key work.
        self.key().hash(state);
    }
}

/// Milliseconds since the store started, when the record's window ends.
type Expires = u64;

struct Shard {
    map: LinkedHashMap<Slot, Expires, RandomState>,
    bytes: u64,
    /// The shard's record replayed last, decoded, with the slice of the
    /// buffer it was decoded from (which keeps that buffer alive, so its
    /// address names that record and no other): a retry storm replays the
    /// same few records over and over, and each is then decoded once, not
    /// once per copy. Only a record of at most [`HOT_MAX`] bytes is kept
    /// so, beyond the budget: one per shard.
    hot: Option<(Bytes, Arc<CompletedRecord>)>,
}

/// The largest encoded record a shard keeps decoded (see `Shard::hot`):
/// with the most shards, at most a megabyte beyond the budget.
const HOT_MAX: usize = 16 << 10;

/// Counters shared by every shard.
#[derive(Default)]
struct Stats {
    bytes: AtomicU64,
    records: AtomicU64,
    evicted_early: AtomicU64,
    expired: AtomicU64,
    /// When the last early-eviction warning was written (ms since start + 1).
    last_warning: AtomicU64,
}

/// Completed records in this process, bounded by the bytes they occupy:
/// the memory store's records, and the local tier of a network store (a
/// repeat that this instance answered before is replayed without a round
/// trip). One buffer per record, in shards kept in least-recently-used
/// order; a record leaves when its window ends or, if the budget is
/// spent, when it is the least recently used.
pub struct Completed {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_bytes: u64,
    shard_budget: u64,
    origin: Instant,
    /// Warn about early evictions and export metrics (not for a cache in
    /// front of another store, whose evictions lose nothing).
    report: bool,
    stats: Stats,
}

impl std::fmt::Debug for Completed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletedCache")
            .field("max_bytes", &self.max_bytes)
            .field("records", &self.stats.records.load(Ordering::Relaxed))
            .field("bytes", &self.stats.bytes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Why a record left the store.
#[derive(Clone, Copy)]
enum Reason {
    /// Pushed out by newer records before its window ended.
    Early,
    /// Its window had ended.
    Expired,
}

impl Completed {
    /// A cache of at most `max_bytes` (what each record really occupies,
    /// its buffer and its entry). `report`: warn when a record leaves
    /// before its window ended and export the memory store's metrics; a
    /// cache in front of another store, whose evictions lose nothing, does
    /// not.
    pub fn new(max_bytes: u64, report: bool) -> Self {
        let shards = (max_bytes / MIN_SHARD_BYTES).clamp(1, MAX_SHARDS);
        // A power of two below, so that shards are picked by a mask.
        let shards = 1u64 << (63 - shards.leading_zeros());
        Self {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        map: LinkedHashMap::with_hasher(RandomState::default()),
                        bytes: 0,
                        hot: None,
                    })
                })
                .collect(),
            hasher: RandomState::default(),
            max_bytes,
            shard_budget: max_bytes / shards,
            origin: Instant::now(),
            report,
            stats: Stats::default(),
        }
    }

    /// Its budget in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// How many records were pushed out by newer ones before their window
    /// ended.
    pub fn evicted_early(&self) -> u64 {
        self.stats.evicted_early.load(Ordering::Relaxed)
    }

    /// How many records were dropped because their window ended.
    pub fn expired(&self) -> u64 {
        self.stats.expired.load(Ordering::Relaxed)
    }

    /// How many records it holds now.
    pub fn len(&self) -> u64 {
        self.stats.records.load(Ordering::Relaxed)
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory its records occupy now, in bytes, by the same measure as
    /// the budget: never more than [`max_bytes`](Self::max_bytes).
    pub fn bytes_used(&self) -> u64 {
        self.stats.bytes.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn shard(&self, key: &[u8]) -> MutexGuard<'_, Shard> {
        let i = (self.hasher.hash_one(key) as usize) & (self.shards.len() - 1);
        // A poisoned shard only means a panic elsewhere while it was held;
        // every critical section below leaves the map and its count in step.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The record under `key` if its window has not ended; a hit becomes the
    /// newest record of its shard.
    pub fn get(&self, key: &str) -> Option<Arc<CompletedRecord>> {
        let key = key.as_bytes();
        let now = self.now_ms();
        let buf = {
            let mut shard = self.shard(key);
            let expires = *shard.map.to_back(key)?;
            if expires <= now {
                let (slot, _) = shard.map.pop_back().expect("moved to the back above");
                shard.bytes -= charge(slot.0.len());
                drop(shard);
                self.left(Reason::Expired, &slot, expires, now);
                return None;
            }
            let buf = shard
                .map
                .back()
                .expect("moved to the back above")
                .0
                .record();
            if let Some((hot, record)) = &shard.hot
                && hot.as_ptr() == buf.as_ptr()
                && hot.len() == buf.len()
            {
                return Some(record.clone());
            }
            buf
        };
        // Our own encoding: it always decodes.
        let record = Arc::new(codec::decode(&buf).ok()?);
        if buf.len() <= HOT_MAX {
            self.shard(key).hot = Some((buf, record.clone()));
        }
        Some(record)
    }

    /// The record under `key` and the time left in its window, without
    /// counting it as a use (for operators).
    pub fn peek(&self, key: &str) -> Option<(Arc<CompletedRecord>, Duration)> {
        let now = self.now_ms();
        let (buf, expires) = {
            let shard = self.shard(key.as_bytes());
            let (slot, &expires) = shard.map.get_key_value(key.as_bytes())?;
            (slot.record(), expires)
        };
        if expires <= now {
            return None;
        }
        let record = codec::decode(&buf).ok()?;
        Some((Arc::new(record), Duration::from_millis(expires - now)))
    }

    /// Deletes the record under `key`; `true` if there was one whose
    /// window had not ended.
    pub fn remove(&self, key: &str) -> bool {
        let now = self.now_ms();
        let mut shard = self.shard(key.as_bytes());
        let Some((slot, expires)) = shard.map.remove_entry(key.as_bytes()) else {
            return false;
        };
        let cost = charge(slot.0.len());
        shard.bytes -= cost;
        drop(shard);
        self.stats.records.fetch_sub(1, Ordering::Relaxed);
        self.stats.bytes.fetch_sub(cost, Ordering::Relaxed);
        self.publish();
        expires > now
    }

    /// Keeps `record` under `key` for `window`, replacing what was there,
    /// and evicts the oldest records of its shard past the budget.
    pub fn insert(&self, key: &str, record: &CompletedRecord, window: Duration) {
        let now = self.now_ms();
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let expires = now.saturating_add(window_ms);
        let len = HEADER + key.len() + codec::encoded_len(record);
        let mut buf = Vec::with_capacity(len);
        let written = u32::try_from(now / 1000).unwrap_or(u32::MAX);
        buf.extend_from_slice(&written.to_be_bytes());
        buf.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_be_bytes());
        buf.extend_from_slice(key.as_bytes());
        codec::encode_into(&mut buf, record);
        debug_assert_eq!(buf.len(), len);
        let slot = Slot(Bytes::from(buf));
        let cost = charge(slot.0.len());
        let mut shard = self.shard(key.as_bytes());
        if let Some((old, _)) = shard.map.remove_entry(key.as_bytes()) {
            shard.bytes -= charge(old.0.len());
            self.lost(charge(old.0.len()));
        }
        if cost > self.shard_budget {
            drop(shard);
            // Larger than its shard can hold. A store of record keeps the
            // record without its body, as for a body past the cache limit:
            // the call never runs again, and its replay says the body was
            // omitted. A cache in front of another store (which has it
            // whole) does not keep it.
            if self.report && !record.response.body_omitted {
                return self.insert(key, &without_body(record), window);
            }
            self.gained(cost);
            self.left_with(Reason::Early, cost, window_ms, 0, now);
            return;
        }
        shard.map.insert(slot, expires);
        shard.bytes += cost;
        self.gained(cost);
        let mut gone = Vec::new();
        while shard.bytes > self.shard_budget {
            let Some((oldest, ends)) = shard.map.pop_front() else {
                break;
            };
            shard.bytes -= charge(oldest.0.len());
            gone.push((oldest, ends));
        }
        // Records whose window ended go too, a few per insert.
        while gone.len() < 4 && shard.map.front().is_some_and(|(_, &ends)| ends <= now) {
            let (oldest, ends) = shard.map.pop_front().expect("checked above");
            shard.bytes -= charge(oldest.0.len());
            gone.push((oldest, ends));
        }
        drop(shard);
        for (slot, ends) in gone {
            let reason = if ends > now {
                Reason::Early
            } else {
                Reason::Expired
            };
            self.left(reason, &slot, ends, now);
        }
        self.publish();
    }

    fn left(&self, reason: Reason, slot: &Slot, ends: Expires, now: u64) {
        let written = u64::from(slot.written()) * 1000;
        self.left_with(
            reason,
            charge(slot.0.len()),
            ends.saturating_sub(written),
            now.saturating_sub(written),
            now,
        );
    }

    /// Counts a record that left `age_ms` after it was written, of a window
    /// of `window_ms`.
    fn left_with(&self, reason: Reason, cost: u64, window_ms: u64, age_ms: u64, now: u64) {
        self.lost(cost);
        let label = match reason {
            Reason::Early => {
                self.stats.evicted_early.fetch_add(1, Ordering::Relaxed);
                if self.report {
                    self.warn_early(window_ms, age_ms, now);
                }
                "early"
            }
            Reason::Expired => {
                self.stats.expired.fetch_add(1, Ordering::Relaxed);
                "expired"
            }
        };
        if !self.report {
            return;
        }
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotency_store_evictions_total", "reason" => label).increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = label;
    }

    /// At most once a minute: records are leaving before their window ends.
    fn warn_early(&self, window_ms: u64, age_ms: u64, now: u64) {
        let last = self.stats.last_warning.load(Ordering::Relaxed);
        if last != 0 && now + 1 < last + 60_000 {
            return;
        }
        if self
            .stats
            .last_warning
            .compare_exchange(last, now + 1, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        #[cfg(feature = "tracing")]
        {
            // A record written `age_ms` ago was pushed out: holding a whole
            // window takes about window / age times the budget.
            let window_ms = if window_ms > 0 {
                window_ms
            } else {
                25 * 3_600_000
            };
            let needed = if age_ms == 0 {
                None
            } else {
                let factor = window_ms as f64 / age_ms as f64;
                Some((self.max_bytes as f64 * factor.max(1.0)) as u64)
            };
            // How long records last now says more than a huge `needed` when
            // a burst filled the store in seconds.
            tracing::warn!(
                budget_bytes = self.max_bytes,
                needed_bytes = needed,
                records_last_secs = age_ms / 1000,
                window_secs = window_ms / 1000,
                evicted_early = self.stats.evicted_early.load(Ordering::Relaxed),
                "idempotency store full: completed records are evicted before their window \
                 ends (a retry of one runs again): records last about records_last_secs of \
                 window_secs; at this rate a budget of about needed_bytes would hold a whole window"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = (window_ms, age_ms);
    }

    /// Counts a record of `cost` that came in.
    fn gained(&self, cost: u64) {
        self.stats.records.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes.fetch_add(cost, Ordering::Relaxed);
        if self.report {
            REPORTED.records.fetch_add(1, Ordering::Relaxed);
            REPORTED.bytes.fetch_add(cost, Ordering::Relaxed);
        }
    }

    /// Counts a record of `cost` that left.
    fn lost(&self, cost: u64) {
        self.stats.records.fetch_sub(1, Ordering::Relaxed);
        self.stats.bytes.fetch_sub(cost, Ordering::Relaxed);
        if self.report {
            REPORTED.records.fetch_sub(1, Ordering::Relaxed);
            REPORTED.bytes.fetch_sub(cost, Ordering::Relaxed);
        }
    }

    /// Sets the gauges (feature `metrics`): the sums over every store of
    /// record in the process (a gateway keeps one per route).
    fn publish(&self) {
        #[cfg(feature = "metrics")]
        if self.report {
            metrics::gauge!("idempotency_store_bytes")
                .set(REPORTED.bytes.load(Ordering::Relaxed) as f64);
            metrics::gauge!("idempotency_store_records")
                .set(REPORTED.records.load(Ordering::Relaxed) as f64);
        }
    }
}

impl Drop for Completed {
    fn drop(&mut self) {
        if self.report {
            let records = self.stats.records.load(Ordering::Relaxed);
            let bytes = self.stats.bytes.load(Ordering::Relaxed);
            REPORTED.records.fetch_sub(records, Ordering::Relaxed);
            REPORTED.bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
    }
}

/// What every store of record in the process holds, for the gauges.
struct Reported {
    records: AtomicU64,
    bytes: AtomicU64,
}

static REPORTED: Reported = Reported {
    records: AtomicU64::new(0),
    bytes: AtomicU64::new(0),
};

/// `record` without its body, as a body past the cache limit is kept.
fn without_body(record: &CompletedRecord) -> CompletedRecord {
    let mut headers = record.response.headers.clone();
    headers.remove(http::header::CONTENT_LENGTH);
    CompletedRecord {
        fingerprint: record.fingerprint,
        response: StoredResponse {
            status: record.response.status,
            headers,
            body: Bytes::new(),
            trailers: record.response.trailers.clone(),
            body_omitted: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fingerprint;
    use http::{HeaderMap, HeaderValue, StatusCode};

    fn record(body: &'static [u8]) -> CompletedRecord {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        CompletedRecord {
            fingerprint: Fingerprint::of(body),
            response: StoredResponse {
                status: StatusCode::OK,
                headers,
                body: Bytes::from_static(body),
                trailers: None,
                body_omitted: false,
            },
        }
    }

    /// A record replayed again is the one decoded before; a record written
    /// over it, or another key's, is decoded afresh.
    #[test]
    fn the_record_replayed_last_is_decoded_once() {
        let store = Completed::new(1 << 20, false);
        let window = Duration::from_secs(60);
        store.insert("a", &record(b"first"), window);
        let one = store.get("a").unwrap();
        let two = store.get("a").unwrap();
        assert!(Arc::ptr_eq(&one, &two));
        assert_eq!(two.response.body, "first");

        store.insert("a", &record(b"second"), window);
        let three = store.get("a").unwrap();
        assert!(!Arc::ptr_eq(&two, &three));
        assert_eq!(three.response.body, "second");
        assert_eq!(three.fingerprint, Fingerprint::of(b"second"));

        store.insert("b", &record(b"other"), window);
        assert_eq!(store.get("b").unwrap().response.body, "other");
        assert_eq!(store.get("a").unwrap().response.body, "second");

        // Gone means gone, whatever the shard keeps decoded.
        assert!(store.remove("a"));
        assert!(store.get("a").is_none());
    }

    /// A record larger than the decoded copy's bound is decoded per replay.
    #[test]
    fn a_large_record_is_not_kept_decoded() {
        let store = Completed::new(4 << 20, false);
        let body: &'static [u8] = Box::leak(vec![b'x'; HOT_MAX + 1].into_boxed_slice());
        store.insert("big", &record(body), Duration::from_secs(60));
        let one = store.get("big").unwrap();
        let two = store.get("big").unwrap();
        assert!(!Arc::ptr_eq(&one, &two));
        assert_eq!(two.response.body.len(), HOT_MAX + 1);
    }
}
