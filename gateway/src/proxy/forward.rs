//! [`Forward`]: the service that sends each request to the upstream.

use super::deadline::Deadline;
use super::headers::{
    set_forwarded, set_idempotency, strip_request, strip_response_hop_by_hop, ClientConn,
};
use super::pool::Pool;
use super::upstream::{CallLimit, DEFAULT_MAX_UPSTREAM_CALLS};
use super::{plain, ProxyBody, Upstream};
use crate::shed::{Gauge, Slot, Slots};
use bytes::Bytes;
use http::{header, Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::BodyExt;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tower::BoxError;
use tower_service::Service;

/// Forwards each request to one [`Upstream`] over a pooled HTTP/1.1 client
/// (TLS for `https://` upstreams), streaming both bodies.
///
/// The keep-alive connections are pooled by the forwarder itself: the one
/// given back last is taken first, one closed by the upstream is never
/// used (a request it closed before writing is sent again on another), one
/// whose answer was dropped before its end is closed, one whose request's
/// body was not written whole when its answer ended (an upstream that
/// answered early) is closed, one on which the upstream sent bytes that
/// belong to no request is closed and the answer just read on it ends with
/// an error (it may be another request's: never recorded), and one idle past
/// [`ForwardBuilder::pool_idle_timeout`] is closed
/// ([`ForwardBuilder::upstream_keepalive`] turns keeping off). A forwarder has one
/// upstream, so its pool needs no key: hyper-util's general client builds
/// and hashes one to take each connection and again to give it back.
/// Connecting (TCP, TLS) is hyper-util's `HttpConnector` with rustls, and
/// HTTP/1.1 is hyper's client connection.
///
/// The upstream gets the request's path (under its base path) and query,
/// its body as it arrives, `Host` set to the upstream, `x-forwarded-for`
/// with the client's address appended (from [`ClientConn`]),
/// `x-forwarded-proto`, `x-forwarded-host`, and no hop-by-hop headers (nor
/// `Expect`) but `TE: trailers` when the client accepts trailers. Behind the
/// dedup layer (an [`ActiveClaim`](tower_idempotency::store::ActiveClaim) in the
/// request's extensions) it also gets `idempotency-fencing-token` (the
/// claim's fencing token, decimal) and `idempotency-key` with the SHA-256 of
/// the stored key (64 hex digits; the key is scoped by route and principal,
/// so two tenants' `Idempotency-Key: order-1001` are two hashes). A
/// client's own `Idempotency-Key` goes upstream as `idempotency-client-key`;
/// a client's own `idempotency-fencing-token` or `idempotency-client-key`
/// is never forwarded, nor a header spelling one the gateway sets or strips
/// with `_` for `-` (`Idempotency_Fencing_Token`: CGI and WSGI servers read
/// both spellings as one). The
/// answer keeps its `Trailer` header, so that its trailers reach a client
/// that accepts them. An upstream that refuses or resets the connection gets
/// `502 Bad Gateway`; one that does not answer in full within the timeout
/// gets `504 Gateway Timeout`. Both are failures, so the idempotency layers
/// never cache them. The service never returns `Err`.
///
/// With the `otel` feature the upstream also gets the W3C `traceparent`
/// (and `tracestate`) of the span the call runs in (see the `trace`
/// module); a client's own are dropped first unless `accept_traceparent`
/// is on.
#[derive(Clone)]
pub struct Forward {
    /// Cloned for every request: one reference count, not the client's
    /// several.
    shared: Arc<Shared>,
    timeout: Duration,
    /// A route's own cap, in front of the upstream's (guarded routes).
    route: Option<Arc<RouteLimit>>,
    /// Asked before each call: a paused route calls nothing.
    pause: Option<super::pause::PauseGate>,
    /// Whether answers carry an [`UpstreamAnswer`].
    answer_extension: bool,
    /// Whether a client's `traceparent` and `tracestate` go on upstream
    /// (when no span's context replaces them).
    accept_traceparent: bool,
}

/// A route's cap on its calls in flight, its queue wait and its gauge.
pub(crate) struct RouteLimit {
    pub(crate) slots: Slots,
    pub(crate) queue_wait: Duration,
    pub(crate) gauge: Gauge,
}

/// What every clone of a [`Forward`] shares.
struct Shared {
    pool: Arc<Pool>,
    upstream: Upstream,
    calls: CallLimit,
    /// The upstream's name: the `upstream` label of its errors.
    name: Arc<str>,
}

impl fmt::Debug for Forward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Forward")
            .field("upstream", &self.shared.upstream)
            .field("timeout", &self.timeout)
            .field("calls", &self.shared.calls)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Forward`]; from [`Forward::builder`].
#[derive(Debug, Clone)]
pub struct ForwardBuilder {
    upstream: Upstream,
    timeout: Duration,
    pool_idle_timeout: Duration,
    keepalive: bool,
    roots: Vec<CertificateDer<'static>>,
    calls: Option<CallLimit>,
    accept_traceparent: bool,
    name: Arc<str>,
}

impl Forward {
    /// A forwarder to `upstream` with every default.
    pub fn new(upstream: Upstream) -> Self {
        Self::builder(upstream).build()
    }

    /// A builder for a forwarder to `upstream`.
    pub fn builder(upstream: Upstream) -> ForwardBuilder {
        ForwardBuilder {
            upstream,
            timeout: Duration::from_secs(30),
            pool_idle_timeout: Duration::from_secs(30),
            keepalive: true,
            roots: Vec::new(),
            calls: None,
            accept_traceparent: false,
            name: Arc::from(DEFAULT_UPSTREAM_NAME),
        }
    }

    /// The upstream.
    pub fn upstream(&self) -> &Upstream {
        &self.shared.upstream
    }

    /// The upstream's name (see [`ForwardBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The deadline for the upstream's whole answer (see
    /// [`ForwardBuilder::timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// This forwarder with another deadline, sharing its connection pool.
    pub(crate) fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            timeout,
            ..self.clone()
        }
    }

    /// This forwarder with or without the [`UpstreamAnswer`] of each answer
    /// (on unless a gateway is told that nobody reads it).
    pub(crate) fn with_answer_extension(&self, on: bool) -> Self {
        Self {
            answer_extension: on,
            ..self.clone()
        }
    }

    /// This forwarder asking `gate` before each call: while it holds, the
    /// call is answered 503 with `Retry-After`, never sent.
    pub(crate) fn with_pause(&self, gate: super::pause::PauseGate) -> Self {
        Self {
            pause: Some(gate),
            ..self.clone()
        }
    }

    /// This forwarder with a route's own cap in front of the upstream's.
    pub(crate) fn with_route_limit(&self, limit: RouteLimit) -> Self {
        Self {
            route: Some(Arc::new(limit)),
            ..self.clone()
        }
    }

    /// This forwarder following clients' `traceparent` or not (see
    /// [`ForwardBuilder::accept_traceparent`]), sharing its connection pool.
    pub(crate) fn with_accept_traceparent(&self, accept: bool) -> Self {
        Self {
            accept_traceparent: accept,
            ..self.clone()
        }
    }

    /// Whether clients' `traceparent` and `tracestate` are followed (see
    /// [`ForwardBuilder::accept_traceparent`]).
    pub fn accepts_traceparent(&self) -> bool {
        self.accept_traceparent
    }

    /// The cap on this upstream's calls in flight (see
    /// [`ForwardBuilder::call_limit`]).
    pub fn call_limit(&self) -> &CallLimit {
        &self.shared.calls
    }

    async fn forward(self, req: Request<ProxyBody>) -> Response<ProxyBody> {
        if let Some(gate) = &self.pause
            && gate.holds(req.uri().path())
        {
            return paused();
        }
        // The route's slot first: a route at its cap takes none of the
        // upstream's from the other routes.
        let mut route_slot = match &self.route {
            Some(route) => match route.slots.acquire_within(route.queue_wait).await {
                Some(permit) => Some(route.slots.hold(permit, &route.gauge)),
                None => return shed(&self.shared, route.slots.max()),
            },
            None => None,
        };
        let Some(slot) = self.shared.calls.acquire().await else {
            return shed(&self.shared, self.shared.calls.max());
        };
        let started = tokio::time::Instant::now();
        let deadline = started + self.timeout;
        let (mut parts, body) = req.into_parts();
        let upstream = &self.shared.upstream;
        let uri = match upstream.uri(parts.uri.path_and_query()) {
            Ok(uri) => uri,
            Err(e) => return plain(StatusCode::BAD_REQUEST, format!("bad path: {e}\n")),
        };
        let conn = parts.extensions.get::<ClientConn>().copied();
        let request_id = parts.headers.get("x-request-id").cloned();
        let authority = parts.uri.authority().map(|a| a.to_string());
        strip_request(&mut parts.headers);
        // Room for what is set below (`x-forwarded-*`, the claim's two,
        // `Host`): one growth of the map at most, not one per insert.
        parts.headers.reserve(6);
        set_forwarded(&mut parts.headers, conn, authority.as_deref());
        let claim = parts
            .extensions
            .get::<tower_idempotency::store::ActiveClaim>();
        // A destination's delivery: the notification's key, not the claim's.
        let shared = parts
            .extensions
            .get::<super::destination::NotificationKey>();
        set_idempotency(&mut parts.headers, claim, shared.map(|k| &*k.0));
        tower_idempotency::trace::pass_on(&mut parts.headers, self.accept_traceparent);
        parts.headers.insert(header::HOST, upstream.host().clone());
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        let req = Request::from_parts(parts, body);
        // One timer for the head and then the body.
        let mut sleep = Box::pin(tokio::time::sleep_until(deadline));
        // An adaptive route limit hears of a call still unanswered past
        // its latency threshold at once, not when it ends.
        if let Some(slot) = &mut route_slot {
            slot.start();
        }
        let mut slow_at = route_slot.as_ref().and_then(Slot::slow_at);
        let mut request = std::pin::pin!(self.shared.pool.send(req, started));
        let answer = loop {
            let slow = async {
                match slow_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                answer = &mut request => break Ok(answer),
                () = sleep.as_mut() => break Err(()),
                () = slow => {
                    slow_at = None;
                    if let Some(slot) = &mut route_slot {
                        slot.slow();
                    }
                }
            }
        };
        let sample = |slot: &mut Option<Slot>, failed: Option<bool>| {
            if let Some(slot) = slot {
                slot.answered(failed);
            }
        };
        match answer {
            Ok(Ok(res)) if res.status() == StatusCode::SWITCHING_PROTOCOLS => {
                // Every request goes upstream without `Upgrade` (a hop-by-hop
                // header), and a server may switch protocols only when asked
                // to (RFC 9110, section 15.2.2): this upstream is broken.
                // What follows on its connection is not HTTP, so the answer
                // is dropped (which closes the connection) and never relayed
                // or recorded. hyper hands on no other 1xx answer.
                sample(&mut route_slot, Some(true));
                upstream_error(&self.shared.name, "other");
                let request_id = request_id
                    .as_ref()
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                tracing::warn!(
                    upstream = %upstream,
                    request_id,
                    "upstream answered 101 Switching Protocols to a request without Upgrade"
                );
                let _ = &request_id;
                drop(res);
                plain(StatusCode::BAD_GATEWAY, "bad gateway\n")
            }
            Ok(Ok(res)) => {
                sample(&mut route_slot, crate::shed::failed(res.status()));
                let (mut parts, body) = res.into_parts();
                strip_response_hop_by_hop(&mut parts.headers);
                parts.version = Version::default();
                if self.answer_extension {
                    parts.extensions.insert(UpstreamAnswer {
                        status: parts.status,
                        took: started.elapsed(),
                    });
                }
                let body = Deadline {
                    body,
                    sleep,
                    _slot: Some(slot),
                    _route: route_slot,
                };
                Response::from_parts(parts, body.boxed_unsync())
            }
            Ok(Err(e)) => {
                // The client's body ran past its deadline or budget.
                if let Some(limit) = tower_idempotency::limit::BodyLimitError::find(&e) {
                    let res = limit.response::<http_body_util::Full<Bytes>>();
                    return res.map(|b| b.map_err(|never| match never {}).boxed_unsync());
                }
                sample(&mut route_slot, Some(true));
                let kind = if e.is_connect() { "connect" } else { "other" };
                upstream_error(&self.shared.name, kind);
                let error = error_chain(&e);
                let request_id = request_id
                    .as_ref()
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                tracing::warn!(upstream = %upstream, request_id, %error, "upstream failed");
                let _ = (&error, &request_id);
                // The error chain goes to the log only: it names internal
                // hosts and ports.
                let mut res = plain(StatusCode::BAD_GATEWAY, "bad gateway\n");
                res.extensions_mut().insert(UpstreamFailed(failure_of(&e)));
                res
            }
            Err(_) => {
                sample(&mut route_slot, Some(true));
                upstream_error(&self.shared.name, "timeout");
                tracing::warn!(upstream = %upstream, timeout = ?self.timeout, "upstream timed out");
                let mut res = plain(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("upstream did not answer within {:?}\n", self.timeout),
                );
                res.extensions_mut().insert(UpstreamFailed("timed out"));
                res
            }
        }
    }
}

/// Marks the answer of a paused route's forwarder (in the response's
/// extensions): the upstream was not called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutePaused;

/// How long a paused route asks its callers to wait, in seconds.
const PAUSED_RETRY_AFTER: &str = "30";

/// The answer of a paused route: 503 with `Retry-After`, marked as shed
/// for the dedup layer's count and as [`RoutePaused`].
fn paused() -> Response<ProxyBody> {
    let mut res = plain(
        StatusCode::SERVICE_UNAVAILABLE,
        "this route is paused by its operator; retry later\n",
    );
    res.headers_mut().insert(
        header::RETRY_AFTER,
        http::HeaderValue::from_static(PAUSED_RETRY_AFTER),
    );
    res.extensions_mut()
        .insert(tower_idempotency::Outcome::Shed);
    res.extensions_mut().insert(RoutePaused);
    res
}

/// The answer to a call past the cap: 503 with `Retry-After`, marked as
/// shed for the dedup layer's count.
fn shed(shared: &Shared, max: usize) -> Response<ProxyBody> {
    let upstream = &shared.upstream;
    upstream_error(&shared.name, "shed");
    tracing::warn!(upstream = %upstream, max, "calls in flight at their cap; request shed");
    let mut res = plain(
        StatusCode::SERVICE_UNAVAILABLE,
        "too many calls in progress to the upstream; retry later\n",
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    res.extensions_mut()
        .insert(tower_idempotency::Outcome::Shed);
    res
}

/// What the upstream answered, in the response's extensions: its status
/// and how long its head took. Outer layers may rewrite the status (a
/// channel's reply); this keeps the upstream's own. A
/// [`Gateway`](super::Gateway) built without response extensions (see
/// [`GatewayBuilder::response_extensions`](super::GatewayBuilder::response_extensions))
/// leaves it out, but on the acknowledge-then-deliver routes, whose
/// deliveries read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct UpstreamAnswer {
    /// The upstream's status.
    pub status: StatusCode,
    /// From sending the request to the answer's head.
    pub took: Duration,
}

/// Why a call to the upstream got no answer (in the response's
/// extensions): `connect refused`, `connect timed out`, `connect failed`,
/// `reset`, `timed out` or `failed`, so that a queued delivery records
/// what happened rather than the route's failure reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UpstreamFailed(pub(crate) &'static str);

/// What `e` says of the call, from the I/O error under it.
fn failure_of(e: &super::pool::CallError) -> &'static str {
    use std::io::ErrorKind;
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    let mut kind = None;
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            kind = Some(io.kind());
            break;
        }
        source = s.source();
    }
    match (e.is_connect(), kind) {
        (_, Some(ErrorKind::ConnectionRefused)) => "connect refused",
        (true, Some(ErrorKind::TimedOut)) => "connect timed out",
        (false, Some(ErrorKind::TimedOut)) => "timed out",
        (
            _,
            Some(ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe),
        ) => "reset",
        (true, _) => "connect failed",
        (false, _) => "failed",
    }
}

/// The name of a forwarder's upstream unless it is given one
/// ([`ForwardBuilder::name`]).
pub const DEFAULT_UPSTREAM_NAME: &str = "default";

/// Counts an upstream failure in
/// `gateway_upstream_errors_total{upstream, kind}`.
fn upstream_error(name: &str, kind: &'static str) {
    metrics::counter!(
        "gateway_upstream_errors_total",
        "upstream" => name.to_owned(),
        "kind" => kind
    )
    .increment(1);
}

impl ForwardBuilder {
    /// The upstream's name: the `upstream` label of
    /// `gateway_upstream_errors_total`. Defaults to `default`.
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.name = name.into();
        self
    }

    /// The deadline for the upstream's whole answer, body included. Behind
    /// a [`Gateway`](super::Gateway) it is the reply deadline of guarded
    /// routes (the upstream call itself goes on up to the run limit).
    /// Defaults to 30 seconds.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long an idle pooled connection is kept: past it the connection is
    /// closed, whether or not another call comes. Defaults to 30 seconds.
    pub fn pool_idle_timeout(mut self, timeout: Duration) -> Self {
        self.pool_idle_timeout = timeout;
        self
    }

    /// Whether connections to the upstream are kept for the next call.
    /// Off, every call opens a connection of its own and closes it once its
    /// answer has ended: for an upstream that may answer a request before
    /// reading its body and not drain it (the unread body would be read as
    /// the next request, and its answer taken for the next call's). On, a
    /// connection is kept only when its request's body was written whole
    /// and nothing but the answer came back on it. Defaults to `true`.
    pub fn upstream_keepalive(mut self, keepalive: bool) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// The cap on calls in flight to the upstream, shared with every
    /// forwarder given a clone of `limit` (see [`CallLimit`]). Defaults to a
    /// cap of [`DEFAULT_MAX_UPSTREAM_CALLS`] (1024) of this forwarder's own.
    pub fn call_limit(mut self, limit: CallLimit) -> Self {
        self.calls = Some(limit);
        self
    }

    /// Whether a client's own `traceparent` and `tracestate` are followed:
    /// forwarded as they came when no span's context replaces them (a
    /// well-formed `traceparent` only, as [`trace::extract`](tower_idempotency::trace::extract)
    /// reads it: a malformed one is dropped with its `tracestate`), and
    /// taken by a [`Gateway`](super::Gateway) as the parent of its request's
    /// span when no span of the program's is current. Payment channels send
    /// none, and a sender should not choose the trace its notification is
    /// recorded in: off, they are dropped and the upstream gets the
    /// gateway's own context only. Defaults to `false`.
    pub fn accept_traceparent(mut self, accept: bool) -> Self {
        self.accept_traceparent = accept;
        self
    }

    /// Trusts the PEM certificates in `pem` for `https://` upstreams, on top
    /// of the Mozilla roots (webpki-roots). Defaults to those roots only.
    /// An error when `pem` holds no certificate, or a `CERTIFICATE` block
    /// that is not one.
    pub fn add_root_certificates_pem(mut self, pem: &[u8]) -> Result<Self, BoxError> {
        let before = self.roots.len();
        let mut check = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert?;
            // A block that webpki cannot read as a certificate would trust
            // nothing, in silence.
            check.add(cert.clone()).map_err(|e| {
                format!("a CERTIFICATE block is not a certificate a root can be made of: {e}")
            })?;
            self.roots.push(cert);
        }
        if self.roots.len() == before {
            return Err("no PEM certificate found".into());
        }
        Ok(self)
    }

    /// The forwarder.
    pub fn build(self) -> Forward {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for cert in self.roots {
            // A certificate webpki cannot parse trusts nothing; it is skipped.
            let _ = roots.add(cert);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        http.set_connect_timeout(Some(self.timeout.min(Duration::from_secs(5))));
        let connector: HttpsConnector<HttpConnector> = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let pool = Pool::new(
            connector,
            self.upstream.target(),
            self.pool_idle_timeout,
            self.keepalive,
        );
        Forward {
            shared: Arc::new(Shared {
                pool,
                upstream: self.upstream,
                calls: self
                    .calls
                    .unwrap_or_else(|| CallLimit::new(DEFAULT_MAX_UPSTREAM_CALLS)),
                name: self.name,
            }),
            timeout: self.timeout,
            route: None,
            pause: None,
            answer_extension: true,
            accept_traceparent: self.accept_traceparent,
        }
    }
}

impl<B> Service<Request<B>> for Forward
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let req = req.map(|body| body.map_err(Into::into).boxed_unsync());
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// `e: its source: its source...`
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
