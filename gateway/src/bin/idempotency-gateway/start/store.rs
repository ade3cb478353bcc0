//! The store picked on the command line: the memory store, or one of Redis,
//! Redis Cluster, a SQL database and Redis (or Redis Cluster) in front of a
//! SQL database (`--backstop`) as a `BoxStore`; with the memory store, the
//! budget of each route's records. The network stores' calls are boxed:
//! their futures are kilobytes, and inline they would make every request's
//! future, the memory store's too, as large.

use crate::redact::{redact, scrub};
use crate::settings::parse::StoreSpec;
use crate::settings::routes::RouteSettings;
use idempotency_gateway::proxy::Target;
use std::collections::HashMap;
use tower_idempotency::store::{BoxStore, Either, MemoryStore, OwnerToken, Store, TieredStore};
use tower_idempotency::Preset;
use tower_idempotency_redis::{RedisClusterStore, RedisStore};
use tower_idempotency_sqlx::SqlStore;

/// The gateway's store; clones share it.
pub(crate) type GatewayStore = Either<MemoryStore, BoxStore>;

/// Redis in front of the `--backstop` database.
type RedisBacked = TieredStore<RedisStore, SqlStore>;
/// Redis Cluster in front of the `--backstop` database.
type ClusterBacked = TieredStore<RedisClusterStore, SqlStore>;

/// Budgets of the stores' memory.
pub(crate) struct Budgets {
    /// The memory store's budget.
    pub(crate) max_memory: u64,
    /// The Redis store's local tier.
    pub(crate) local_max_memory: u64,
}

/// Connects to the store, and to the `backstop` database behind it (only
/// with a Redis store: the settings refuse it otherwise).
pub(crate) async fn connect(
    spec: &StoreSpec,
    backstop: Option<&str>,
    budgets: &Budgets,
) -> Result<GatewayStore, String> {
    let front = connect_one(spec, budgets).await?;
    let Some(url) = backstop else {
        return Ok(front);
    };
    let back = SqlStore::connect(url).await.map_err(|e| {
        let scheme = url.split(':').next().unwrap_or_default();
        format!("cannot open the {scheme} backstop: {}", scrub(url, e))
    })?;
    let front = front.right();
    let front = front.as_ref();
    if let Some(redis) = front.and_then(BoxStore::downcast_ref::<RedisStore>) {
        Ok(networked(TieredStore::new(redis.clone(), back)))
    } else if let Some(cluster) = front.and_then(BoxStore::downcast_ref::<RedisClusterStore>) {
        Ok(networked(TieredStore::new(cluster.clone(), back)))
    } else {
        Err("`--backstop` goes behind a Redis store (`--store redis://…`)".into())
    }
}

fn networked(store: impl Store) -> GatewayStore {
    Either::Right(BoxStore::new(store))
}

async fn connect_one(spec: &StoreSpec, budgets: &Budgets) -> Result<GatewayStore, String> {
    Ok(match spec {
        StoreSpec::Memory => {
            Either::Left(MemoryStore::builder().max_bytes(budgets.max_memory).build())
        }
        StoreSpec::Redis(url) => networked(
            RedisStore::standalone(url.as_str())
                .await
                .map_err(|e| format!("cannot reach Redis at {}: {}", redact(url), scrub(url, e)))?
                .local_max_bytes(budgets.local_max_memory),
        ),
        StoreSpec::Cluster(nodes) => networked(
            RedisStore::cluster(nodes.iter().map(String::as_str))
                .await
                .map_err(|e| {
                    let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
                    let e = nodes.iter().fold(e.to_string(), |e, n| scrub(n, e));
                    format!("cannot reach the Redis Cluster at {shown:?}: {e}")
                })?
                .local_max_bytes(budgets.local_max_memory),
        ),
        // The URL may carry a password: the message names the scheme only.
        StoreSpec::Sql(url) => networked(SqlStore::connect(url).await.map_err(|e| {
            let scheme = url.split(':').next().unwrap_or_default();
            format!("cannot open the {scheme} store: {e}")
        })?),
    })
}

/// The store's kind, for the start-up log line.
pub(crate) fn describe(store: &GatewayStore) -> &'static str {
    let Either::Right(store) = store else {
        return "memory";
    };
    if store.downcast_ref::<RedisStore>().is_some() {
        "redis"
    } else if store.downcast_ref::<RedisClusterStore>().is_some() {
        "redis-cluster"
    } else if store.downcast_ref::<SqlStore>().is_some() {
        "sql"
    } else if store.downcast_ref::<RedisBacked>().is_some() {
        "redis+sql-backstop"
    } else if store.downcast_ref::<ClusterBacked>().is_some() {
        "redis-cluster+sql-backstop"
    } else {
        "other"
    }
}

/// What `/readyz` says of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// The store answers.
    Ready,
    /// The database behind answers, Redis in front does not: every call
    /// goes to the database alone (slower, still exactly once).
    FrontDown,
    /// The store (with a backstop: the database) does not answer.
    Down,
}

/// Whether the store answers: one read of a key nobody writes, within
/// `within`. With a backstop the database decides: the tiered store serves
/// from it alone while Redis is away, so the gateway stays ready (taking
/// every instance out of the balancer when the shared Redis fails would
/// turn a slower service into none).
pub(crate) async fn ready(store: &GatewayStore, within: std::time::Duration) -> Readiness {
    async fn answers(store: &impl Store, within: std::time::Duration) -> bool {
        let probe = store.take_token("gateway:readyz-probe", OwnerToken::new());
        matches!(tokio::time::timeout(within, probe).await, Ok(Ok(_)))
    }
    async fn tiered(
        front: &impl Store,
        back: &impl Store,
        within: std::time::Duration,
    ) -> Readiness {
        match tokio::join!(answers(front, within), answers(back, within)) {
            (_, false) => Readiness::Down,
            (true, true) => Readiness::Ready,
            (false, true) => Readiness::FrontDown,
        }
    }
    let boxed = store.as_ref().right();
    if let Some(t) = boxed.and_then(BoxStore::downcast_ref::<RedisBacked>) {
        tiered(t.front(), t.back(), within).await
    } else if let Some(t) = boxed.and_then(BoxStore::downcast_ref::<ClusterBacked>) {
        tiered(t.front(), t.back(), within).await
    } else if answers(store, within).await {
        Readiness::Ready
    } else {
        Readiness::Down
    }
}

/// The smallest memory budget of one route's records (of each half of an
/// `auto` route's): a few records' heads.
pub(crate) const MIN_ROUTE_MEMORY: usize = 64 << 10;

/// The memory budget of one route's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RouteBudget {
    pub(crate) prefix: String,
    /// The channels' records (every record of a preset route).
    pub(crate) channels: usize,
    /// An `auto` route's client-key records, kept apart from its channels'.
    pub(crate) clients: Option<usize>,
}

/// Splits `total` (`--max-memory`) between the routes: a route with its
/// own `max_memory` (in `own`) gets it, the others share what is left
/// evenly, and an `auto` route gives half of its budget to channels and
/// half to client keys, so that client keys (which anyone can make up)
/// never push a channel's records out. `Err` is the reason to exit 2.
pub(crate) fn split(
    total: usize,
    routes: &[RouteSettings],
    own: &[(String, usize)],
) -> Result<Vec<RouteBudget>, String> {
    let own: HashMap<&str, usize> = own.iter().map(|(p, n)| (p.as_str(), *n)).collect();
    let given: usize = routes
        .iter()
        .filter_map(|r| own.get(r.prefix.as_str()))
        .fold(0usize, |sum, n| sum.saturating_add(*n));
    let rest: Vec<&str> = routes
        .iter()
        .map(|r| r.prefix.as_str())
        .filter(|p| !own.contains_key(p))
        .collect();
    if given > total || (given == total && !rest.is_empty()) {
        return Err(format!(
            "the routes' own `max_memory` add up to {given} bytes, which leaves nothing of \
             `--max-memory` ({total} bytes){}: raise `--max-memory` (the total of every route)",
            if rest.is_empty() {
                String::new()
            } else {
                format!(" for {}", rest.join(", "))
            }
        ));
    }
    let share = match rest.len() {
        0 => 0,
        n => (total - given) / n,
    };
    routes
        .iter()
        .map(|RouteSettings { prefix, target, .. }| {
            let (budget, whose) = match own.get(prefix.as_str()) {
                Some(n) => (*n, "its `max_memory`"),
                None => (share, "its share of `--max-memory`"),
            };
            let auto = matches!(target, Target::Auto);
            let least = if auto {
                2 * MIN_ROUTE_MEMORY
            } else {
                MIN_ROUTE_MEMORY
            };
            if budget < least {
                return Err(format!(
                    "route {prefix}: {whose} is {budget} bytes; a route needs at least {least} \
                     bytes{}",
                    if auto {
                        " (an `auto` route keeps channels and client keys apart, half each)"
                    } else {
                        ""
                    }
                ));
            }
            Ok(RouteBudget {
                prefix: prefix.clone(),
                channels: if auto { budget - budget / 2 } else { budget },
                clients: auto.then_some(budget / 2),
            })
        })
        .collect()
}

/// One memory store per route (two for an `auto` route: channels, client
/// keys) with its budget: the gateway's `stores` picker. `None` for the
/// Redis stores, which keep every route's records in Redis.
pub(crate) fn per_route(
    spec: &StoreSpec,
    routes: &[RouteSettings],
) -> Option<impl Fn(&str, &Preset) -> GatewayStore + Send + Sync + 'static> {
    if !matches!(spec, StoreSpec::Memory) {
        return None;
    }
    let memory = |n: usize| Either::Left(MemoryStore::builder().max_bytes(n as u64).build());
    let stores: HashMap<String, (GatewayStore, Option<GatewayStore>)> = (routes.iter())
        .filter_map(|r| r.budget.as_ref())
        .map(|b| {
            let stores = (memory(b.channels), b.clients.map(memory));
            (same_prefix(&b.prefix).to_owned(), stores)
        })
        .collect();
    let fallback = memory(MIN_ROUTE_MEMORY);
    Some(move |prefix: &str, preset: &Preset| {
        match stores.get(same_prefix(prefix)) {
            Some((_, Some(clients))) if preset.is_client_api() => clients.clone(),
            Some((channels, _)) => channels.clone(),
            // Every route has its budget; a route without one would be a
            // bug of ours, and gets a small store rather than a shared one.
            None => fallback.clone(),
        }
    })
}

/// A prefix as the gateway's route table writes it (no trailing `/`, but
/// `/` itself).
fn same_prefix(prefix: &str) -> &str {
    match prefix.trim_end_matches('/') {
        "" => "/",
        p => p,
    }
}
