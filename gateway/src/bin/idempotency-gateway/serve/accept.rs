//! Accepting connections: TLS, a cap on connections, header read timeout,
//! idle connections closed (HTTP/2 too), request ids, each request's root
//! span, the access log; and the drain on SIGTERM or SIGINT.

use crate::serve::access::Ratios;
use crate::serve::tls::Tls;
use http::HeaderValue;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use idempotency_gateway::proxy::{ClientConn, Gateway, MatchedRoute};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_idempotency::limit::BodyLimitError;
use tracing::{debug, warn, Instrument as _};

use crate::start::store::GatewayStore;

/// How connections are served; every serving thread shares one.
#[derive(Clone)]
pub(crate) struct Limits {
    /// One permit per open client connection, across every serving thread.
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) header_timeout: Duration,
    pub(crate) tls: Option<Tls>,
    /// The duplicate-ratio gauge, fed by every serving thread.
    pub(crate) ratios: &'static Ratios,
    pub(crate) h2_max_streams: u32,
}

/// The connections a serving thread still has open.
pub(crate) struct Open {
    close: CancellationToken,
    tasks: TaskTracker,
}

impl Open {
    /// How many.
    pub(crate) fn count(&self) -> usize {
        self.tasks.len()
    }

    /// Asks each to finish its requests in flight and close, and waits.
    pub(crate) async fn shutdown(self) {
        self.close.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Serves until `stop` resolves; returns the connections still open. The
/// listener is closed on return.
pub(crate) async fn accept_until(
    listener: TcpListener,
    gateway: Gateway<GatewayStore>,
    limits: &Limits,
    stop: impl std::future::Future<Output = ()>,
) -> Open {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true)
        // A connection's read buffer grows up to this: what a flood of bulk
        // bodies holds beyond the bodies themselves. Headers must fit in it,
        // and a hostile one (a 400 KB `Stripe-Signature` list) must reach the
        // verifier to get its channel's 401 rather than a bare 431: a little
        // above hyper's default (about 408 KiB).
        .max_buf_size(448 << 10);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_max_streams)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    let open = Open {
        close: CancellationToken::new(),
        tasks: TaskTracker::new(),
    };
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            permit = limits.permits.clone().acquire_owned() => permit.expect("never closed"),
            () = &mut stop => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = ClientConn::new(peer, limits.tls.is_some());
        // Bumped by each request: a connection that got none for a while
        // is closed (HTTP/2 has no header timeout between streams).
        let requests = Arc::new(AtomicUsize::new(0));
        let svc = service(gateway.clone(), conn, limits.ratios, requests.clone());
        let (builder, tls) = (builder.clone(), limits.tls.clone());
        let header_timeout = limits.header_timeout;
        let watch = Watch::new(open.close.clone(), requests, header_timeout);
        open.tasks.spawn(async move {
            let _permit = permit;
            if let Err(e) = serve_stream(stream, tls.as_ref(), &builder, svc, watch).await {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    open
}

/// When a connection should finish: the drain, or no request for `idle`.
pub(crate) struct Watch {
    close: CancellationToken,
    requests: Arc<AtomicUsize>,
    idle: Duration,
}

impl Watch {
    /// Closes the connection when `close` is cancelled, or once `idle`
    /// passes with no request counted in `requests` (the service counts).
    pub(crate) fn new(
        close: CancellationToken,
        requests: Arc<AtomicUsize>,
        idle: Duration,
    ) -> Self {
        Self {
            close,
            requests,
            idle,
        }
    }
}

use tower::BoxError;

/// Serves one accepted connection, over TLS when `tls` is set (the
/// handshake bounded by the watch's idle time, the header timeout).
pub(crate) async fn serve_stream<S, B>(
    stream: tokio::net::TcpStream,
    tls: Option<&Tls>,
    builder: &auto::Builder<TokioExecutor>,
    svc: S,
    watch: Watch,
) -> Result<(), BoxError>
where
    S: hyper::service::Service<http::Request<Incoming>, Response = http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let Some(tls) = tls else {
        return serve_io(stream, builder, svc, watch).await;
    };
    match tokio::time::timeout(watch.idle, tls.acceptor().accept(stream)).await {
        Ok(Ok(stream)) => serve_io(stream, builder, svc, watch).await,
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err("TLS handshake timed out".into()),
    }
}

async fn serve_io<I, S, B>(
    io: I,
    builder: &auto::Builder<TokioExecutor>,
    svc: S,
    watch: Watch,
) -> Result<(), BoxError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<http::Request<Incoming>, Response = http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
    tokio::pin!(conn);
    let start = tokio::time::Instant::now() + watch.idle;
    let mut idle = tokio::time::interval_at(start, watch.idle);
    loop {
        tokio::select! {
            done = conn.as_mut() => return done,
            () = watch.close.cancelled() => break,
            _ = idle.tick() => {
                // Graceful: requests in flight finish first.
                if watch.requests.swap(0, Ordering::Relaxed) == 0 {
                    break;
                }
            }
        }
    }
    conn.as_mut().graceful_shutdown();
    conn.await
}

/// The gateway for one connection: its client's address, request ids
/// (`x-request-id`, made if absent, sent upstream and back), the access
/// log; an HTTP/1 connection whose body ran past its deadline or the budget
/// is closed (the rest of that body is not read).
fn service(
    gateway: Gateway<GatewayStore>,
    conn: ClientConn,
    ratios: &'static Ratios,
    requests: Arc<AtomicUsize>,
) -> impl hyper::service::Service<
    http::Request<Incoming>,
    Response = idempotency_gateway::proxy::GatewayResponse,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Send
       + 'static {
    let svc = tower::service_fn(move |mut req: http::Request<Incoming>| {
        let gateway = gateway.clone();
        requests.fetch_add(1, Ordering::Relaxed);
        let request_id = set_request_id(&mut req);
        req.extensions_mut().insert(conn);
        let http1 = req.version() < http::Version::HTTP_2;
        let (span, trace_id) = request_span(&req);
        let routed = span.clone();
        let answer = async move {
            // What the access line needs, kept only when it is logged.
            let line = tracing::enabled!(target: "gateway::access", tracing::Level::INFO)
                .then(|| (req.method().clone(), req.uri().path().to_owned()));
            // The clock is read only for what reads the latency: the
            // histogram (a metrics recorder) or the access line.
            let started = (line.is_some() || ratios.timed()).then(Instant::now);
            let mut res = gateway.oneshot(req).await?;
            if http1 && res.extensions().get::<BodyLimitError>().is_some() {
                res.headers_mut()
                    .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            }
            if let (false, Some(route)) =
                (routed.is_disabled(), res.extensions().get::<MatchedRoute>())
            {
                routed.record("route", &*route.0);
            }
            ratios.record(line, started, &res, trace_id.as_deref());
            // The request's id goes back, unless the answer has one.
            if let http::header::Entry::Vacant(e) = res.headers_mut().entry(REQUEST_ID) {
                e.insert(request_id);
            }
            Ok(res)
        };
        answer.instrument(span)
    });
    TowerToHyperService::new(svc)
}

#[allow(clippy::declare_interior_mutable_const)]
const REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// `x-request-id`: the client's, or a new random (v4) UUID when it sent
/// none, set on the request (for the upstream and the
/// logs); the value for the answer.
///
/// What tower-http's `SetRequestId` and `PropagateRequestId` do, less what
/// nothing here reads: they also put the id in the request's and the
/// answer's extensions, two allocations and the answer's extension map
/// grown past three entries, and a layer of futures each, for every request
/// (about 2,000 instructions of a replay's 51,000, callgrind). The UUID is
/// written straight into the header value, without a `String` and a parse.
fn set_request_id<B>(req: &mut http::Request<B>) -> HeaderValue {
    if let Some(given) = req.headers().get(REQUEST_ID) {
        return given.clone();
    }
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let text = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut text);
    let id = HeaderValue::from_str(text).expect("a UUID is a header value");
    req.headers_mut().insert(REQUEST_ID, id.clone());
    id
}

/// The most bytes of a client's `x-request-id` that go into the logs.
const MAX_LOGGED_REQUEST_ID: usize = 128;

/// The root span of a request, `request` (its `x-request-id`, its route once
/// routed, its trace id), and that trace id when the request is traced: the
/// library's spans are its children, and the upstream gets its trace id in
/// `traceparent`.
fn request_span<B>(req: &http::Request<B>) -> (tracing::Span, Option<String>) {
    // The id is read only when the span is enabled: a disabled span's
    // fields are never evaluated.
    let span = tracing::info_span!(
        "request",
        request_id = logged_request_id(req),
        route = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    let trace_id = crate::serve::otel::exporting()
        .then(|| {
            crate::serve::otel::follow_client(&span, req.headers());
            crate::serve::otel::trace_id(&span)
        })
        .flatten();
    if let Some(trace_id) = &trace_id {
        span.record("trace_id", trace_id.as_str());
    }
    (span, trace_id)
}

/// The request's `x-request-id` as the logs show it: at most
/// [`MAX_LOGGED_REQUEST_ID`] bytes of it, `-` for none.
fn logged_request_id<B>(req: &http::Request<B>) -> &str {
    req.headers().get(REQUEST_ID).map_or("-", |v| {
        let text = v.to_str().unwrap_or("-");
        // A client's id is its own: a huge one is not copied into every line.
        text.get(..MAX_LOGGED_REQUEST_ID.min(text.len()))
            .unwrap_or("-")
    })
}

/// Waits for SIGTERM or SIGINT.
pub(crate) struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
