//! The store picked on the command line.
// The library is getting an object-safe store; until then, one enum.

use crate::parse::StoreSpec;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::{
    Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoreError,
};
use tower_idempotency::Fingerprint;

#[derive(Clone)]
enum Backend {
    Memory(MemoryStore),
    Redis(tower_idempotency::store::RedisStore),
    Cluster(tower_idempotency::store::RedisClusterStore),
}

/// The gateway's store; clones share it.
#[derive(Clone)]
pub struct GatewayStore {
    backend: Backend,
    /// Clones alive: the drain waits for the calls still holding one.
    live: Arc<()>,
}

macro_rules! on_backend {
    ($self:ident, $s:ident => $e:expr) => {
        match &$self.backend {
            Backend::Memory($s) => $e,
            Backend::Redis($s) => $e,
            Backend::Cluster($s) => $e,
        }
    };
}

impl GatewayStore {
    /// Connects to the store; `max_memory` is the memory store's budget.
    pub async fn connect(spec: &StoreSpec, max_memory: usize) -> Result<Self, String> {
        let backend = match spec {
            StoreSpec::Memory => {
                Backend::Memory(MemoryStore::builder().max_bytes(max_memory as u64).build())
            }
            StoreSpec::Redis(url) => Backend::Redis(
                tower_idempotency::store::RedisStore::standalone(url.as_str())
                    .await
                    .map_err(|e| format!("cannot reach Redis at {url}: {e}"))?,
            ),
            StoreSpec::Cluster(nodes) => Backend::Cluster(
                tower_idempotency::store::RedisStore::cluster(nodes.iter().map(String::as_str))
                    .await
                    .map_err(|e| format!("cannot reach the Redis Cluster at {nodes:?}: {e}"))?,
            ),
        };
        Ok(Self {
            backend,
            live: Arc::new(()),
        })
    }

    pub fn describe(&self) -> &'static str {
        match self.backend {
            Backend::Memory(_) => "memory",
            Backend::Redis(_) => "redis",
            Backend::Cluster(_) => "redis-cluster",
        }
    }

    /// Calls still holding a clone (besides this one).
    pub fn busy(&self) -> usize {
        Arc::strong_count(&self.live) - 1
    }

    /// A handle for health probes, not counted by [`busy`](Self::busy).
    pub fn probe(&self) -> Self {
        Self {
            backend: self.backend.clone(),
            live: Arc::new(()),
        }
    }

    /// Whether the store answers: one read of a key nobody writes.
    pub async fn ready(&self) -> bool {
        self.take_token("gateway:readyz-probe", OwnerToken::new())
            .await
            .is_ok()
    }
}

impl Store for GatewayStore {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        on_backend!(self, s => s.claim(key, fingerprint, token, lease).await)
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, s => s.complete(key, token, record, window).await)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, s => s.renew(key, token, lease).await)
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        on_backend!(self, s => s.release(key, token).await)
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        on_backend!(self, s => s.put_token(key, ttl).await)
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        on_backend!(self, s => s.take_token(key, owner).await)
    }
}
