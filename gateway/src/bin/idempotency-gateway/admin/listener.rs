//! `/metrics`, `/healthz` and `/readyz` on `--admin-listen`.
//!
//! The Prometheus exporter's own HTTP listener answers `/metrics` only, so
//! this listener serves the three paths itself, `/metrics` with the
//! exporter's `PrometheusHandle::render`. It is served as the main listener
//! is (`serve::accept`): a header timeout, the main one's but at most
//! [`HEADER_TIMEOUT`] (also its TLS handshake's and idle connections'
//! bound), and a cap on connections that a few slow clients cannot fill,
//! so that a liveness probe is answered beside them and idle clients cannot
//! hold descriptors for long; with `--admin-tls-cert` it speaks HTTPS.

pub(crate) use crate::admin::api::{read_token, Admin};
use crate::serve::accept::{serve_stream, Watch};
use crate::serve::tls::Tls;
use crate::start::store::GatewayStore;
use axum::body::Body;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;
use tower_idempotency_queue::RedbQueue;
use tracing::{debug, info};
use tracing_appender::non_blocking::ErrorCounter;

/// The most connections the listener serves at once; more wait to be
/// accepted. Scrapers, probes and the admin commands need a few; the rest
/// is room for slow clients, each closed at the header timeout, beside
/// which a probe is still answered at once.
pub(crate) const MAX_CONNECTIONS: usize = 1024;

/// The longest the listener waits for a request's headers (or a TLS
/// handshake, or on an idle connection): scrapers, probes and the admin
/// commands send theirs at once.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How the listener serves its connections.
pub(crate) struct Listening {
    /// The main listener's `--header-timeout`.
    pub(crate) header_timeout: Duration,
    /// `--admin-tls-cert` and `--admin-tls-key`, loaded.
    pub(crate) tls: Option<Tls>,
}

/// Installs the recorder and serves the three paths; `store` and `queue`
/// (the embedded queue of the ack-then-deliver routes) answer `/readyz`.
pub(crate) async fn start(
    addr: SocketAddr,
    store: GatewayStore,
    queue: Option<RedbQueue>,
    dropped: ErrorCounter,
    series: &Series<'_>,
    admin: Option<Admin>,
    listening: Listening,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?;
    let handle = install()?;
    zeros(series);
    if let Some(admin) = &admin {
        let samples = crate::admin::samples::Samples::default();
        samples.spawn(handle.clone());
        admin.set_samples(samples);
    }
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the metrics address: {e}"))?;
    let scheme = if listening.tls.is_some() {
        "https"
    } else {
        "http"
    };
    info!("metrics on {scheme}://{local}/metrics, health on /healthz and /readyz");
    let upkeep = handle.clone();
    let Listening {
        header_timeout,
        tls,
    } = listening;
    let header_timeout = header_timeout.min(HEADER_TIMEOUT);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(16);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let admin_api = admin.map(|admin| admin.router(store.clone()));
    Ok(tokio::spawn(async move {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                upkeep.run_upkeep();
            }
        });
        loop {
            let permit = permits.clone().acquire_owned().await.expect("never closed");
            let Ok((stream, peer)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let (handle, store, dropped) = (handle.clone(), store.clone(), dropped.clone());
            let (admin, queue) = (admin_api.clone(), queue.clone());
            // Bumped by each request: a connection idle for the header
            // timeout is closed.
            let requests = Arc::new(AtomicUsize::new(0));
            let counted = requests.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                counted.fetch_add(1, Ordering::Relaxed);
                let (handle, store, dropped) = (handle.clone(), store.clone(), dropped.clone());
                let (admin, queue) = (admin.clone(), queue.clone());
                async move {
                    if crate::admin::console::is_console(req.uri().path()) {
                        return Ok(match admin {
                            Some(_) => {
                                crate::admin::console::answer(req.method(), req.uri().path())
                            }
                            None => crate::admin::api::not_found(),
                        });
                    }
                    if req.uri().path().starts_with("/admin/") {
                        return match admin {
                            Some(admin) => admin.oneshot(req).await,
                            None => Ok(crate::admin::api::not_found()),
                        };
                    }
                    let ready = Ready {
                        store: &store,
                        queue: queue.as_ref(),
                    };
                    let res = answer(req, &handle, ready, &dropped).await;
                    Ok::<_, Infallible>(res.map(Body::new))
                }
            });
            let watch = Watch::new(CancellationToken::new(), requests, header_timeout);
            let (builder, tls) = (builder.clone(), tls.clone());
            tokio::spawn(async move {
                let _permit = permit;
                if let Err(e) = serve_stream(stream, tls.as_ref(), &builder, svc, watch).await {
                    debug!(%peer, error = %e, "metrics connection ended with an error");
                }
            });
        }
    }))
}

/// What `/readyz` asks.
#[derive(Clone, Copy)]
struct Ready<'a> {
    store: &'a GatewayStore,
    queue: Option<&'a RedbQueue>,
}

async fn answer(
    req: Request<Incoming>,
    handle: &PrometheusHandle,
    ready: Ready<'_>,
    dropped: &ErrorCounter,
) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, kind: &'static str| {
        let mut res = Response::new(Full::new(Bytes::from(body)));
        *res.status_mut() = status;
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
        res
    };
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into(), PLAIN);
    }
    match req.uri().path() {
        "/metrics" => {
            metrics::counter!("gateway_log_lines_dropped_total")
                .absolute(dropped.dropped_lines() as u64);
            text(StatusCode::OK, handle.render(), "text/plain; version=0.0.4")
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into(), PLAIN),
        "/readyz" => {
            use crate::start::store::Readiness;
            // A queue that cannot store notifications answers each with the
            // failure reply: the load balancer sends them elsewhere.
            if ready.queue.is_some_and(|q| !q.writable()) {
                return text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the queue cannot store notifications: its disk is full or failing, or has less free than --data-dir-reserve\n".into(),
                    PLAIN,
                );
            }
            match crate::start::store::ready(ready.store, Duration::from_secs(2)).await {
                // A line per named upstream (`[[upstreams]]`) after the verdict.
                Readiness::Ready => text(
                    StatusCode::OK,
                    format!("ready\n{}", crate::settings::upstreams::ready_lines()),
                    PLAIN,
                ),
                Readiness::FrontDown => text(
                    StatusCode::OK,
                    format!(
                        "ready: Redis does not answer, serving from the backstop database\n{}",
                        crate::settings::upstreams::ready_lines()
                    ),
                    PLAIN,
                ),
                Readiness::Down => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the store does not answer\n".into(),
                    PLAIN,
                ),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into(), PLAIN),
    }
}

fn install() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_seconds".into()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ],
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("idempotency_request_seconds".into()),
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                ],
            )
        })
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    metrics::describe_counter!(
        "idempotency_requests_total",
        "Requests at the idempotency layers, by preset and outcome"
    );
    metrics::describe_histogram!(
        "idempotency_store_seconds",
        metrics::Unit::Seconds,
        "Latency of store calls"
    );
    metrics::describe_histogram!(
        "idempotency_request_seconds",
        metrics::Unit::Seconds,
        "Time from a guarded request's arrival to its answer's head, by preset"
    );
    metrics::describe_gauge!(
        "idempotency_duplicate_ratio",
        "Duplicates over guarded requests in the last 5 minutes, by preset"
    );
    metrics::describe_counter!(
        "gateway_upstream_errors_total",
        "Upstream failures: connect, timeout, other"
    );
    metrics::describe_gauge!(
        "idempotency_store_bytes",
        metrics::Unit::Bytes,
        "Bytes of completed records the memory store holds (bounded by --max-memory)"
    );
    metrics::describe_gauge!(
        "idempotency_store_records",
        "Completed records the memory store holds"
    );
    metrics::describe_counter!(
        "idempotency_store_evictions_total",
        "Records evicted: early (before their window ended: raise --max-memory) or expired"
    );
    metrics::describe_counter!(
        "idempotency_store_data_loss_total",
        "Times the Redis store was found to have lost its data (restart without persistence, failover)"
    );
    metrics::describe_counter!(
        "idempotency_order_events_total",
        "Events of routes with an order: advanced, stale, unplaced, failed, busy, store_error"
    );
    metrics::describe_gauge!(
        "idempotency_queue_depth",
        "Acknowledged notifications waiting for delivery"
    );
    metrics::describe_gauge!(
        "idempotency_queue_oldest_seconds",
        metrics::Unit::Seconds,
        "Age of the oldest acknowledged notification not yet delivered"
    );
    metrics::describe_gauge!(
        "idempotency_queue_dead_letters",
        "Notifications in the dead-letter queue"
    );
    metrics::describe_counter!(
        "idempotency_queue_attempts_total",
        "Delivery attempts from the queue, by result"
    );
    metrics::describe_counter!(
        "idempotency_journal_dropped_total",
        "Journal events dropped because the journal's writer fell behind (its channel was full)"
    );
    metrics::describe_counter!(
        "gateway_log_lines_dropped_total",
        "Log lines dropped because stderr was not read fast enough"
    );
    Ok(handle)
}

/// The outcomes the shipped alert rules and dashboard read.
const ALERTED: &[&str] = &[
    "executed",
    "replayed",
    "waited",
    "in_flight_rejected",
    "mismatch",
    "unverified",
    "store_error",
    "shed",
    "too_many_copies",
];

/// Every counter the alert rules read, at zero from the start: Prometheus'
/// `increase()` and `rate()` need a sample before the first event, or the
/// first mismatch, data loss or early eviction would never fire an alert.
/// `presets` are the routes' presets (every built-in one for `auto`).
/// What the series that start at zero are labelled with.
pub(crate) struct Series<'a> {
    /// The routes' presets.
    pub(crate) presets: &'a [&'a str],
    /// The prefixes of the ack-then-deliver routes.
    pub(crate) acked: &'a [&'a str],
}

fn zeros(series: &Series<'_>) {
    for route in series.acked {
        let route = metrics::SharedString::from(route.to_string());
        // 0: the breaker is closed, nothing is being delivered.
        metrics::gauge!("idempotency_upstream_breaker", "route" => route.clone()).set(0.0);
        metrics::gauge!("idempotency_deliveries_in_flight", "route" => route).set(0.0);
    }
    for preset in series.presets {
        for outcome in ALERTED {
            let preset = metrics::SharedString::from(preset.to_string());
            metrics::counter!("idempotency_requests_total", "preset" => preset, "outcome" => *outcome)
                .increment(0);
        }
    }
    for reason in ["early", "expired"] {
        metrics::counter!("idempotency_store_evictions_total", "reason" => reason).increment(0);
    }
    metrics::counter!("idempotency_store_data_loss_total").increment(0);
    for kind in ["connect", "timeout", "other"] {
        metrics::counter!("gateway_upstream_errors_total", "kind" => kind).increment(0);
    }
}
