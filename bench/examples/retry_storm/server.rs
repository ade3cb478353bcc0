//! The systems under the storm, each served over a real loopback hyper
//! server: the bare handler, our stack, axum-idempotent.

use bytes::Bytes;
use http::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_idempotency::store::{MemoryStore, Store, TieredStore};
use tower_idempotency::{IdempotencyLayer, Preset};
use tower_idempotency_redis::RedisStore;
use tower_idempotency_sqlx::SqlStore;

use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, SessionLayer};
use tower_cookies::CookieManagerLayer;

use crate::args::{Baseline, Scenario, StoreArg, NOTIFY_PATH, ORDERS_PATH};
use crate::upstream::Handler;

/// The channel presets' dedup window, given to axum-idempotent too.
const WINDOW_SECS: u64 = 25 * 3600;
/// The session cookie's name in the axum-idempotent modes.
pub(crate) const SESSION_COOKIE: &str = "session";

/// Serves `svc` on 127.0.0.1:0 (HTTP/1 and HTTP/2) and returns the address.
pub(crate) async fn serve<S, B>(svc: S) -> std::io::Result<SocketAddr>
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    eprintln!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let svc = hyper_util::service::TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// `instances` dedup stacks (each its own layer and server) over one store:
/// for the memory store, the one store all instances of a process share.
async fn serve_stacks<St: Store>(
    store: St,
    handler: &Handler,
    instances: usize,
    scenario: Scenario,
) -> std::io::Result<Vec<SocketAddr>> {
    let preset = match scenario {
        Scenario::Burst | Scenario::Outage => Preset::wechatpay_v3(),
        Scenario::DoubleSubmit => Preset::idempotency_key(),
    };
    let mut addrs = Vec::with_capacity(instances);
    for _ in 0..instances {
        let stack = ServiceBuilder::new()
            .layer(IdempotencyLayer::new_in(preset.clone(), store.clone()))
            .service(handler.clone());
        addrs.push(serve(stack).await?);
    }
    Ok(addrs)
}

/// `instances` servers of the handler in an axum `Router` behind
/// axum-idempotent 0.6, in the layer order its README prescribes
/// (`CookieManagerLayer`, `SessionLayer`, `IdempotentLayer`), all sharing one
/// in-memory session store (as the dedup stacks share one `MemoryStore`).
///
/// Its best case for a WeChat storm: the key is the method and path only, so
/// that within one transaction's session every copy shares it (hashing the
/// body, its default, would give every re-encrypted copy its own key).
async fn serve_axum_idempotent(
    handler: &Handler,
    instances: usize,
) -> std::io::Result<Vec<SocketAddr>> {
    let store = Arc::new(MokaStore::builder().max_capacity(1 << 24).build());
    let options = IdempotentOptions::default()
        .ignore_body(true)
        .ignore_all_headers()
        .expire_after(WINDOW_SECS as i64);
    let cookie_options = CookieOptions::build()
        .name(SESSION_COOKIE)
        .path("/")
        .max_age(WINDOW_SECS);
    let mut addrs = Vec::with_capacity(instances);
    for _ in 0..instances {
        let app = axum::Router::new()
            .route(NOTIFY_PATH, axum::routing::post_service(handler.clone()))
            .route(ORDERS_PATH, axum::routing::post_service(handler.clone()))
            .layer(IdempotentLayer::<MokaStore>::new(options.clone()))
            .layer(SessionLayer::new(store.clone()).with_cookie_options(cookie_options.clone()))
            .layer(CookieManagerLayer::new());
        addrs.push(serve(app).await?);
    }
    Ok(addrs)
}

/// Serves `baseline` in front of `handler` on `instances` servers and
/// returns their addresses.
pub(crate) async fn serve_baseline(
    baseline: Baseline,
    store: &StoreArg,
    handler: &Handler,
    instances: usize,
    scenario: Scenario,
) -> Result<Vec<SocketAddr>, Box<dyn std::error::Error>> {
    let addrs = match (baseline, store) {
        (Baseline::None, _) => {
            let mut addrs = Vec::with_capacity(instances);
            for _ in 0..instances {
                addrs.push(serve(handler.clone()).await?);
            }
            addrs
        }
        (Baseline::AxumIdempotent | Baseline::AxumIdempotentNoCookie, _) => {
            serve_axum_idempotent(handler, instances).await?
        }
        (Baseline::Dedup, StoreArg::Memory) => {
            serve_stacks(MemoryStore::new(), handler, instances, scenario).await?
        }
        // Each instance gets its own connection, local tier and pollers, as
        // separate processes would.
        (Baseline::Dedup, StoreArg::Redis(url)) => {
            let mut addrs = Vec::with_capacity(instances);
            for _ in 0..instances {
                let store = RedisStore::standalone(url.as_str()).await?;
                addrs.extend(serve_stacks(store, handler, 1, scenario).await?);
            }
            addrs
        }
        (Baseline::Dedup, StoreArg::Cluster(nodes)) => {
            let mut addrs = Vec::with_capacity(instances);
            for _ in 0..instances {
                let store = RedisStore::cluster(nodes.clone()).await?;
                addrs.extend(serve_stacks(store, handler, 1, scenario).await?);
            }
            addrs
        }
        (Baseline::Dedup, StoreArg::Sql(url)) => {
            let mut addrs = Vec::with_capacity(instances);
            for _ in 0..instances {
                let store = SqlStore::connect(url).await?;
                addrs.extend(serve_stacks(store, handler, 1, scenario).await?);
            }
            addrs
        }
        (Baseline::Dedup, StoreArg::Tiered { redis, sql }) => {
            let mut addrs = Vec::with_capacity(instances);
            for _ in 0..instances {
                let front = RedisStore::standalone(redis.as_str()).await?;
                let store = TieredStore::new(front, SqlStore::connect(sql).await?);
                addrs.extend(serve_stacks(store, handler, 1, scenario).await?);
            }
            addrs
        }
    };
    Ok(addrs)
}
