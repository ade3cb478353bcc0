//! [`MemoryStoreBuilder`]: the memory store's bounds.

use super::{Inner, MemoryStore, SHARDS};
use crate::store::CompletedCache as Completed;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
    max_tokens: u64,
    max_positions: u64,
}

impl MemoryStoreBuilder {
    /// The most memory completed records may occupy, in bytes: their keys,
    /// headers and bodies as allocated, and the store's own overhead per
    /// record. Defaults to 256 MiB.
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

    /// The most objects whose applied position to keep (see
    /// [`Store::advance`](crate::store::Store::advance)): past it, the
    /// least recently advanced go first, and an event of such an object is
    /// judged as the object's first. Defaults to 1,000,000 (about 100 MiB).
    pub const fn max_positions(mut self, positions: u64) -> Self {
        self.max_positions = positions;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let completed = Completed::new(self.max_bytes, true);
        let tokens = moka::sync::Cache::builder()
            .max_capacity(self.max_tokens)
            // Oldest first: a fresh token is never refused.
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            .time_to_live(Duration::from_secs(24 * 3600))
            .build_with_hasher(RandomState::default());
        let positions = moka::sync::Cache::builder()
            .max_capacity(self.max_positions)
            // Oldest first: a fresh position is never refused.
            .eviction_policy(moka::policy::EvictionPolicy::lru())
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
                positions,
                fence: AtomicU64::new(0),
            }),
        }
    }
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024 * 1024,
            max_tokens: 1_000_000,
            max_positions: 1_000_000,
        }
    }
}
