use super::guard::{ClaimGuard, Detach};
use super::layer::{DedupConfig, DedupLayer, OnStoreError};
use super::{BODY_OMITTED_HEADER, REPLAYED_HEADER};
use crate::body::{text_response, BodyBuffer, ResponseBody};
use crate::key::is_guarded_method;
use crate::outcome::{self, log_warn, Outcome};
use crate::store::{Claim, CompletedRecord, OwnerToken, Store, StoreError, StoredResponse};
use crate::IdempotencyKey;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower_service::Service;

/// Runs the inner service at most once per key. See the [module docs](crate::dedup).
pub struct Dedup<S, St> {
    inner: S,
    store: St,
    config: Arc<DedupConfig>,
    tasks: TaskTracker,
}

impl<S: Clone, St: Clone> Clone for Dedup<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Dedup<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedup")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, St: Store> Dedup<S, St> {
    /// Wraps `inner` with the default settings over `store`.
    pub fn new(inner: S, store: St) -> Self {
        Self::from_parts(
            inner,
            store,
            Arc::new(DedupConfig::new()),
            TaskTracker::new(),
        )
    }

    pub(crate) fn from_parts(
        inner: S,
        store: St,
        config: Arc<DedupConfig>,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            inner,
            store,
            config,
            tasks,
        }
    }

    /// A layer over `store`.
    pub fn layer(store: St) -> DedupLayer<St> {
        DedupLayer::new(store)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

pin_project! {
    /// Response future of [`Dedup`].
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // Not guarded: the inner future, its body streamed.
        Unguarded { #[pin] fut: F },
        // Guarded: the claim, wait, replay or execution.
        Guarded { fut: BoxFuture<Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Unguarded { .. } => "Unguarded",
            Kind::Guarded { .. } => "Guarded",
        };
        f.debug_tuple("dedup::ResponseFuture").field(&kind).finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Unguarded { fut } => fut
                .poll(cx)
                .map(|r| r.map(|res| res.map(ResponseBody::stream))),
            KindProj::Guarded { fut } => fut.as_mut().poll(cx),
        }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Dedup<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let key = match req.extensions().get::<IdempotencyKey>() {
            Some(key) if is_guarded_method(req.method()) => key.clone(),
            _ => {
                return ResponseFuture {
                    kind: Kind::Unguarded {
                        fut: self.inner.call(req),
                    },
                }
            }
        };
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let run = Run {
            inner,
            store: self.store.clone(),
            config: self.config.clone(),
            key,
        };
        ResponseFuture {
            kind: Kind::Guarded {
                fut: Box::pin(run.run(req)),
            },
        }
    }
}

/// One guarded request.
struct Run<S, St> {
    inner: S,
    store: St,
    config: Arc<DedupConfig>,
    key: IdempotencyKey,
}

/// What the inner service produced.
enum Produced<B> {
    /// A 2xx whose body was read completely.
    Success {
        parts: http::response::Parts,
        body: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// A failure, streamed back untouched.
    Failure(http::response::Parts, B),
    /// The body of a 2xx failed half way.
    BodyError,
}

trait Inner<ReqBody, ResBody>:
    Service<Request<ReqBody>, Response = Response<ResBody>, Future = Self::Fut, Error = Self::Err>
    + Send
    + 'static
{
    type Fut: Future<Output = Result<Response<ResBody>, Self::Err>> + Send + 'static;
    type Err: Send + 'static;
}

impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Fut = S::Future;
    type Err = S::Error;
}

impl<S, St> Run<S, St>
where
    St: Store,
{
    async fn run<ReqBody, ResBody>(
        self,
        req: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
    {
        let fingerprint = self.key.fingerprint();
        let deadline = Instant::now() + self.config.wait;
        let mut waited = false;
        loop {
            let token = OwnerToken::new();
            // Owns whatever claim the call below makes: if the call times out,
            // fails in transport after the store acted, or this future is
            // dropped, the claim is released (owner-checked, so harmless when
            // there was none) instead of blocking the key for a whole lease.
            let mut guard = ClaimGuard::new(
                self.store.clone(),
                self.key.as_arc().clone(),
                token,
                self.config.store_timeout,
            );
            let claim = store_call(
                self.config.store_timeout,
                "claim",
                self.store
                    .claim(self.key.as_str(), fingerprint, token, self.config.lease),
            )
            .await;
            let claim = match claim {
                Ok(claim) => claim,
                Err(e) => {
                    drop(guard);
                    return self.store_failed(e, req).await;
                }
            };
            if !matches!(claim, Claim::Acquired(_)) {
                guard.disarm();
            }
            match claim {
                Claim::Completed(record) => {
                    if record.fingerprint != fingerprint {
                        return Ok(self.mismatch());
                    }
                    if self.config.strict {
                        return Ok(self.duplicate_submission());
                    }
                    let outcome = if waited {
                        Outcome::Waited
                    } else {
                        Outcome::Replayed
                    };
                    outcome::record(self.key.preset_arc(), outcome);
                    return Ok(replay(&record, outcome));
                }
                Claim::InFlight {
                    fingerprint: running,
                    watch,
                } => {
                    if running != fingerprint {
                        return Ok(self.mismatch());
                    }
                    if self.config.strict {
                        return Ok(self.duplicate_submission());
                    }
                    if Instant::now() >= deadline {
                        outcome::record(self.key.preset_arc(), Outcome::InFlightRejected);
                        return Ok(in_flight());
                    }
                    waited = true;
                    let _ = tokio::time::timeout_at(deadline, watch.changed()).await;
                }
                Claim::Acquired(_) => {
                    if let Some(token_key) = self.key.token_key().cloned() {
                        let taken = store_call(
                            self.config.store_timeout,
                            "take_token",
                            self.store.take_token(&token_key),
                        )
                        .await;
                        match taken {
                            // Only a token known to be taken is given back on
                            // failure: restoring an unconfirmed one could mint
                            // a guessed token.
                            Ok(true) => guard.restore_token(token_key, self.config.token_ttl),
                            Ok(false) => {
                                guard.release().await;
                                return Ok(self.unknown_token());
                            }
                            Err(e) => {
                                guard.release().await;
                                return self.store_failed(e, req).await;
                            }
                        }
                    }
                    return self.execute(req, guard).await;
                }
            }
        }
    }
}

pub(super) async fn store_call<T>(
    timeout: Duration,
    op: &'static str,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    #[cfg(feature = "metrics")]
    let start = std::time::Instant::now();
    let res = match tokio::time::timeout(timeout, fut).await {
        Ok(res) => res,
        Err(_) => Err(StoreError::timeout(op, timeout)),
    };
    #[cfg(feature = "metrics")]
    outcome::store_latency(op, start.elapsed().as_secs_f64());
    res
}

impl<S, St> Run<S, St>
where
    St: Store,
{
    async fn store_failed<ReqBody, ResBody>(
        mut self,
        error: StoreError,
        req: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
    {
        outcome::record(self.key.preset_arc(), Outcome::StoreError);
        log_warn!(key = %self.key.redacted(), error = %error, "idempotency store failed");
        let _ = &error;
        match self.config.on_store_error {
            OnStoreError::FailClosed => {
                let mut res = text_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "idempotency store unavailable; retry later\n",
                );
                res.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                res.extensions_mut().insert(Outcome::StoreError);
                Ok(res)
            }
            OnStoreError::FailOpen => {
                outcome::record(self.key.preset_arc(), Outcome::PassedThrough);
                let mut res = self.inner.call(req).await?.map(ResponseBody::stream);
                res.extensions_mut().insert(Outcome::PassedThrough);
                Ok(res)
            }
        }
    }

    fn duplicate_submission<ResBody>(&self) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::InFlightRejected);
        let mut res = text_response(
            StatusCode::CONFLICT,
            "duplicate submission: this request was already received\n",
        );
        res.extensions_mut().insert(Outcome::InFlightRejected);
        res
    }

    fn unknown_token<ResBody>(&self) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::RejectedBadInput);
        let mut res = text_response(
            StatusCode::BAD_REQUEST,
            "unknown, expired or already used idempotency token\n",
        );
        res.extensions_mut().insert(Outcome::RejectedBadInput);
        res
    }

    fn mismatch<ResBody>(&self) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::Mismatch);
        log_warn!(
            key = %self.key.redacted(),
            "idempotency key reused with a different payload: possible tampering"
        );
        let mut res = text_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency key reused with a different request payload\n",
        );
        res.extensions_mut().insert(Outcome::Mismatch);
        res
    }

    /// Runs the inner service as the owner of `token`'s claim.
    async fn execute<ReqBody, ResBody>(
        self,
        req: Request<ReqBody>,
        guard: ClaimGuard<St>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
    {
        let detach = self.config.finish_on_disconnect;
        Detach::new(self.execute_owned(req, guard), detach).await
    }

    async fn execute_owned<ReqBody, ResBody>(
        self,
        req: Request<ReqBody>,
        mut guard: ClaimGuard<St>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
    {
        let Run {
            mut inner,
            config,
            key,
            ..
        } = self;
        let work = async move {
            let res = inner.call(req).await?;
            let (parts, body) = res.into_parts();
            if !parts.status.is_success() || grpc_failed(&parts.headers, None) {
                return Ok(Produced::Failure(parts, body));
            }
            Ok(match read_body(body).await {
                Some((body, trailers)) => Produced::Success {
                    parts,
                    body,
                    trailers,
                },
                None => Produced::BodyError,
            })
        };
        let result = renewing(AssertUnwindSafe(work).catch_unwind(), &guard, &config, &key).await;
        let preset = key.preset_arc();
        match result {
            Err(_panic) => {
                outcome::record(preset, Outcome::Failed);
                log_warn!(key = %key.redacted(), "inner service panicked; claim released");
                guard.release().await;
                let mut res = text_response(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n");
                res.extensions_mut().insert(Outcome::Failed);
                Ok(res)
            }
            Ok(Err(e)) => {
                outcome::record(preset, Outcome::Failed);
                guard.release().await;
                Err(e)
            }
            Ok(Ok(Produced::Failure(parts, body))) => {
                outcome::record(preset, Outcome::Failed);
                guard.release().await;
                let mut res = Response::from_parts(parts, ResponseBody::stream(body));
                res.extensions_mut().insert(Outcome::Failed);
                Ok(res)
            }
            Ok(Ok(Produced::BodyError)) => {
                outcome::record(preset, Outcome::Failed);
                guard.release().await;
                let mut res = text_response(
                    StatusCode::BAD_GATEWAY,
                    "the response body failed before it ended\n",
                );
                res.extensions_mut().insert(Outcome::Failed);
                Ok(res)
            }
            Ok(Ok(Produced::Success {
                parts,
                body,
                trailers,
            })) => {
                if grpc_failed(&parts.headers, Some(trailers.as_ref())) {
                    outcome::record(preset, Outcome::Failed);
                    guard.release().await;
                    let mut res = Response::from_parts(parts, ResponseBody::full(body, trailers));
                    res.extensions_mut().insert(Outcome::Failed);
                    return Ok(res);
                }
                let omitted = body.len() > config.max_cached_body;
                let record = Arc::new(CompletedRecord {
                    fingerprint: key.fingerprint(),
                    response: StoredResponse {
                        status: parts.status,
                        headers: end_to_end(&parts.headers, omitted),
                        // Copied: the response's bytes may be slices of a
                        // connection's read buffer, which the record would
                        // otherwise keep alive for the whole window.
                        body: if omitted {
                            Bytes::new()
                        } else {
                            Bytes::copy_from_slice(&body)
                        },
                        trailers: trailers.as_ref().map(|t| end_to_end(t, false)),
                        body_omitted: omitted,
                    },
                });
                let outcome = complete(&guard, &config, record).await;
                outcome::record(preset, outcome);
                guard.disarm();
                let mut res = Response::from_parts(parts, ResponseBody::full(body, trailers));
                res.extensions_mut().insert(Outcome::Executed);
                Ok(res)
            }
        }
    }
}

/// Polls `work` and renews the claim every `lease/3` until it finishes.
async fn renewing<F: Future, St: Store>(
    work: F,
    guard: &ClaimGuard<St>,
    config: &DedupConfig,
    key: &IdempotencyKey,
) -> F::Output {
    let period = config.lease / 3;
    let mut work = std::pin::pin!(work);
    let mut tick = std::pin::pin!(tokio::time::sleep(period));
    let mut lost = false;
    loop {
        let ready = std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            if !lost && tick.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await;
        if let Some(out) = ready {
            return out;
        }
        let renewed = store_call(
            config.store_timeout,
            "renew",
            guard.store.renew(&guard.key, guard.token, config.lease),
        )
        .await;
        match renewed {
            Ok(true) => {}
            Ok(false) => {
                lost = true;
                outcome::record(key.preset_arc(), Outcome::LeaseLost);
                log_warn!(key = %key.redacted(), "lease lost while the inner service ran");
            }
            // The store is down: keep trying; the lease may still hold.
            Err(_) => {}
        }
        tick.as_mut().reset(Instant::now() + period);
    }
}

/// Stores the completed record. If the store fails, keeps trying in the
/// background for up to one lease, so that the claim does not lapse into a
/// second execution.
async fn complete<St: Store>(
    guard: &ClaimGuard<St>,
    config: &DedupConfig,
    record: Arc<CompletedRecord>,
) -> Outcome {
    let first = store_call(
        config.store_timeout,
        "complete",
        guard
            .store
            .complete(&guard.key, guard.token, record.clone(), config.window),
    )
    .await;
    match first {
        Ok(true) => Outcome::Executed,
        Ok(false) => Outcome::LeaseLost,
        Err(_) => {
            let (store, key, token) = (guard.store.clone(), guard.key.clone(), guard.token);
            let (window, timeout, lease) = (config.window, config.store_timeout, config.lease);
            tokio::spawn(async move {
                let give_up = Instant::now() + lease;
                let mut backoff = Duration::from_millis(50);
                while Instant::now() < give_up {
                    tokio::time::sleep(backoff).await;
                    let fut = store.complete(&key, token, record.clone(), window);
                    if let Ok(Ok(_)) = tokio::time::timeout(timeout, fut).await {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            });
            Outcome::StoreError
        }
    }
}

/// Reads a whole body and its trailers; `None` if the body fails.
async fn read_body<B>(body: B) -> Option<(Bytes, Option<HeaderMap>)>
where
    B: Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    let mut buf = BodyBuffer::default();
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.ok()?;
        match frame.into_data() {
            Ok(data) => buf.push(data),
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    match &mut trailers {
                        Some(existing) => existing.extend(t),
                        None => trailers = Some(t),
                    }
                }
            }
        }
    }
    Some((buf.into_bytes(), trailers))
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// For gRPC responses: whether `grpc-status` says anything but 0.
///
/// With `trailers` = `None` only the headers are known: a trailers-only
/// response carries its status there. With `Some(..)`, the whole response is
/// known and a missing status is a failure.
fn grpc_failed(headers: &HeaderMap, trailers: Option<Option<&HeaderMap>>) -> bool {
    if !is_grpc(headers) {
        return false;
    }
    let status = headers
        .get("grpc-status")
        .or_else(|| trailers.flatten().and_then(|t| t.get("grpc-status")));
    match (status, trailers) {
        (Some(s), _) => s.as_bytes() != b"0",
        (None, None) => false,
        (None, Some(_)) => true,
    }
}

/// The headers kept for replay: end-to-end headers only.
fn end_to_end(headers: &HeaderMap, omitted: bool) -> HeaderMap {
    // Headers that `Connection` names are hop-by-hop too.
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    let dropped = |name: &header::HeaderName| {
        matches!(
            *name,
            header::CONNECTION
                | header::PROXY_AUTHENTICATE
                | header::PROXY_AUTHORIZATION
                | header::TE
                | header::TRAILER
                | header::TRANSFER_ENCODING
                | header::UPGRADE
        ) || name.as_str() == "keep-alive"
            || (omitted && *name == header::CONTENT_LENGTH)
            || named.iter().any(|n| n == name.as_str())
    };
    let keep = |name: &header::HeaderName| !dropped(name);
    // A fresh map sized for what is kept: a stored record lives for the
    // whole window, and a clone of the handler's map would keep its spare
    // capacity (hundreds of bytes) that long.
    let kept = headers.iter().filter(|(name, _)| keep(name)).count();
    let mut out = HeaderMap::with_capacity(kept);
    for (name, value) in headers.iter() {
        if keep(name) {
            out.append(name.clone(), owned(value));
        }
    }
    out
}

/// A header value that owns its bytes (a parsed value may be a slice of a
/// connection's read buffer).
fn owned(value: &HeaderValue) -> HeaderValue {
    match HeaderValue::from_bytes(value.as_bytes()) {
        Ok(mut copy) => {
            copy.set_sensitive(value.is_sensitive());
            copy
        }
        Err(_) => value.clone(),
    }
}

/// A replay of a completed record.
fn replay<B>(record: &CompletedRecord, outcome: Outcome) -> Response<ResponseBody<B>> {
    let stored = &record.response;
    let mut res = Response::new(ResponseBody::full(
        stored.body.clone(),
        stored.trailers.clone(),
    ));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers.clone();
    res.headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if stored.body_omitted {
        res.headers_mut()
            .insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    res.extensions_mut().insert(outcome);
    res
}

fn in_flight<B>() -> Response<ResponseBody<B>> {
    let mut res = text_response(
        StatusCode::CONFLICT,
        "a request with this idempotency key is still in progress; retry later\n",
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res.extensions_mut().insert(Outcome::InFlightRejected);
    res
}
