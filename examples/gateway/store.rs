//! The store picked on the command line: the library's `Either` of the
//! memory store, Redis, Redis Cluster and a SQL database.

use crate::parse::StoreSpec;
use tower_idempotency::store::{
    Either, MemoryStore, OwnerToken, RedisClusterStore, RedisStore, SqlStore, Store,
};

/// The gateway's store; clones share it.
pub type GatewayStore =
    Either<MemoryStore, Either<RedisStore, Either<RedisClusterStore, SqlStore>>>;

/// Budgets of the stores' memory.
pub struct Budgets {
    /// The memory store's budget.
    pub max_memory: u64,
    /// The Redis store's local tier.
    pub local_max_memory: u64,
}

/// Connects to the store.
pub async fn connect(spec: &StoreSpec, budgets: &Budgets) -> Result<GatewayStore, String> {
    Ok(match spec {
        StoreSpec::Memory => {
            Either::Left(MemoryStore::builder().max_bytes(budgets.max_memory).build())
        }
        StoreSpec::Redis(url) => Either::Right(Either::Left(
            RedisStore::standalone(url.as_str())
                .await
                .map_err(|e| format!("cannot reach Redis at {url}: {e}"))?
                .local_max_bytes(budgets.local_max_memory),
        )),
        StoreSpec::Cluster(nodes) => Either::Right(Either::Right(Either::Left(
            RedisStore::cluster(nodes.iter().map(String::as_str))
                .await
                .map_err(|e| format!("cannot reach the Redis Cluster at {nodes:?}: {e}"))?
                .local_max_bytes(budgets.local_max_memory),
        ))),
        // The URL may carry a password: the message names the scheme only.
        StoreSpec::Sql(url) => Either::Right(Either::Right(Either::Right(
            SqlStore::connect(url).await.map_err(|e| {
                let scheme = url.split(':').next().unwrap_or_default();
                format!("cannot open the {scheme} store: {e}")
            })?,
        ))),
    })
}

/// The store's kind, for the start-up log line.
pub fn describe(store: &GatewayStore) -> &'static str {
    match store {
        Either::Left(_) => "memory",
        Either::Right(Either::Left(_)) => "redis",
        Either::Right(Either::Right(Either::Left(_))) => "redis-cluster",
        Either::Right(Either::Right(Either::Right(_))) => "sql",
    }
}

/// Whether the store answers: one read of a key nobody writes.
pub async fn ready(store: &GatewayStore) -> bool {
    store
        .take_token("gateway:readyz-probe", OwnerToken::new())
        .await
        .is_ok()
}
