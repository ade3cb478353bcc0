//! The normalize layer: turns the inner result and the other layers' own
//! answers into the exact reply a channel expects.
//!
//! A handler answers any 2xx for success; this layer replaces it with the
//! channel's success reply (WeChat Pay's `{"code":"SUCCESS","message":"成功"}`,
//! Alipay's `success`, …), keeping `idempotent-replayed`. Anything else becomes
//! the channel's failure reply, so the channel retries. Client errors that
//! retrying cannot fix (400, 401, 403, 404, 413) keep their status.
//!
//! gRPC requests (`content-type: application/grpc…`) that the layers refuse
//! (400, 409, 413, 422, 503, …) get a trailers-only gRPC answer instead of a
//! text body, so that gRPC clients can read it: 400 → `INVALID_ARGUMENT`,
//! 409 and 503 → `UNAVAILABLE` (retryable), 413 → `RESOURCE_EXHAUSTED`,
//! 422 → `FAILED_PRECONDITION`, with the reason in `grpc-message`.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::normalize::NormalizeLayer;
//! use tower_idempotency::Preset;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = ServiceBuilder::new()
//!     .layer(NormalizeLayer::new(Preset::alipay().reply().clone()))
//!     .service(service_fn(|_req: Request<Full<Bytes>>| async {
//!         Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"order paid"))))
//!     }));
//! let res = svc.oneshot(Request::post("/").body(Full::default()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), StatusCode::OK);
//! assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "success");
//! # }
//! ```

mod problem;

pub(crate) use crate::body::text_response;
use crate::body::Rejection;
use crate::headers::is_grpc;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// The mark of a response to a request passed on without a key where the
/// key is optional: the reply format leaves it as the handler answered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unkeyed;

/// One fixed reply: status, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedReply {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Option<Bytes>,
}

impl FixedReply {
    /// A reply with this status and body (`None` keeps the body it replaces).
    pub const fn new(
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Option<Bytes>,
    ) -> Self {
        Self {
            status,
            content_type,
            body,
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body, if fixed.
    pub fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }
}

/// How a channel wants to be answered.
///
/// `None` for success or failure passes that kind of response through as the
/// inner service answered it (client APIs pass both through).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reply {
    success: Option<FixedReply>,
    failure: Option<FixedReply>,
    /// The key's header when the layers' own refusals are problem details.
    problems: Option<&'static str>,
    /// Whether a request passed on without a key keeps the handler's answer
    /// (a preset whose key is optional).
    unkeyed: bool,
}

impl Reply {
    /// A reply format from a success and a failure reply.
    pub const fn new(success: Option<FixedReply>, failure: Option<FixedReply>) -> Self {
        Self {
            success,
            failure,
            problems: None,
            unkeyed: false,
        }
    }

    /// Pass every response through unchanged.
    pub const fn pass_through() -> Self {
        Self {
            success: None,
            failure: None,
            problems: None,
            unkeyed: false,
        }
    }

    /// This format with the layers' own refusals (400 missing or malformed
    /// key, 409 in flight, 422 reused with another payload, 413, 503…)
    /// written as RFC 9457 problem details, `application/problem+json` with
    /// `type`, `title`, `status` and `detail`, titled as the IETF
    /// Idempotency-Key draft's examples are (`"Idempotency-Key is missing"`,
    /// `"A request is outstanding for this Idempotency-Key"`,
    /// `"Idempotency-Key is already used"`) with the key's `header` name.
    /// The handler's own responses are never touched. The `idempotency-key`
    /// preset answers so.
    ///
    /// ```
    /// use tower_idempotency::Preset;
    /// assert_eq!(Preset::idempotency_key().reply().problem_details(), Some("Idempotency-Key"));
    /// assert_eq!(Preset::stripe().reply().problem_details(), None);
    /// ```
    pub const fn with_problem_details(mut self, header: &'static str) -> Self {
        self.problems = Some(header);
        self
    }

    /// This format leaving the answer to a request passed on without a key
    /// as the handler gave it (for a preset whose key is optional).
    pub(crate) const fn keeping_unkeyed(mut self) -> Self {
        self.unkeyed = true;
        self
    }

    /// Whether `res` answers a request passed on without a key, which this
    /// format leaves alone.
    fn is_unkeyed<B>(&self, res: &Response<B>) -> bool {
        self.unkeyed && res.extensions().get::<Unkeyed>().is_some()
    }

    /// The key's header name when refusals are problem details (see
    /// [`with_problem_details`](Self::with_problem_details)).
    pub const fn problem_details(&self) -> Option<&'static str> {
        self.problems
    }

    /// The success reply.
    pub fn success(&self) -> Option<&FixedReply> {
        self.success.as_ref()
    }

    /// The failure reply.
    pub fn failure(&self) -> Option<&FixedReply> {
        self.failure.as_ref()
    }

    /// Rewrites one response into the channel's form. A request passed on
    /// without a key (where the key is optional, such as a configured
    /// preset's `WithoutKey::Pass` handshake) keeps the handler's answer.
    pub fn apply<B: From<Bytes>>(&self, res: Response<B>) -> Response<B> {
        if self.is_unkeyed(&res) {
            return res;
        }
        if let Some(header) = self.problems
            && res.extensions().get::<Rejection>().is_some()
        {
            return problem::rewrite(res, header);
        }
        let success = res.status().is_success();
        let fixed = if success {
            &self.success
        } else {
            &self.failure
        };
        let Some(fixed) = fixed else {
            return res;
        };
        let (mut parts, body) = res.into_parts();
        parts.status = if success || !is_final_client_error(parts.status) {
            fixed.status
        } else {
            parts.status
        };
        let body = match &fixed.body {
            Some(bytes) => {
                drop(body);
                parts.headers.remove(header::CONTENT_LENGTH);
                parts.headers.remove(header::CONTENT_ENCODING);
                parts.headers.remove(header::RETRY_AFTER);
                match &fixed.content_type {
                    Some(ct) => parts.headers.insert(header::CONTENT_TYPE, ct.clone()),
                    None => parts.headers.remove(header::CONTENT_TYPE),
                };
                B::from(bytes.clone())
            }
            None => body,
        };
        Response::from_parts(parts, body)
    }
}

/// A refusal as a trailers-only gRPC response.
fn grpc_refusal<B: From<Bytes>>(res: Response<B>) -> Response<B> {
    let (parts, _body) = res.into_parts();
    let code: u16 = match parts.status.as_u16() {
        400 => 3,                    // INVALID_ARGUMENT
        401 => 16,                   // UNAUTHENTICATED
        403 => 7,                    // PERMISSION_DENIED
        404 => 12,                   // UNIMPLEMENTED
        409 | 429 | 502..=504 => 14, // UNAVAILABLE: retry later
        413 => 8,                    // RESOURCE_EXHAUSTED
        422 => 9,                    // FAILED_PRECONDITION
        500 => 13,                   // INTERNAL
        _ => 2,                      // UNKNOWN
    };
    let message = match parts.extensions.get::<Rejection>() {
        Some(r) => String::from_utf8_lossy(&r.0).trim().to_owned(),
        None => parts
            .status
            .canonical_reason()
            .unwrap_or("refused")
            .to_owned(),
    };
    let mut out = Response::new(B::from(Bytes::new()));
    *out.extensions_mut() = parts.extensions;
    let headers = out.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        headers.insert("grpc-message", v);
    }
    if let Some(retry) = parts.headers.get(header::RETRY_AFTER) {
        headers.insert(header::RETRY_AFTER, retry.clone());
    }
    out
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII and `%`
/// are percent-encoded.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Client errors that a retry cannot fix: reported with their own status.
fn is_final_client_error(status: StatusCode) -> bool {
    matches!(status.as_u16(), 400 | 401 | 403 | 404 | 413)
}

/// Applies [`Normalize`] to a service.
#[derive(Debug, Clone)]
pub struct NormalizeLayer {
    reply: Arc<Reply>,
}

impl NormalizeLayer {
    /// A normalize layer answering in `reply`'s form.
    pub fn new(reply: Reply) -> Self {
        Self {
            reply: Arc::new(reply),
        }
    }
}

impl<S> Layer<S> for NormalizeLayer {
    type Service = Normalize<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Normalize {
            inner,
            reply: self.reply.clone(),
        }
    }
}

/// Rewrites responses into a channel's reply form. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Normalize<S> {
    inner: S,
    reply: Arc<Reply>,
}

impl<S> Normalize<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, reply: Reply) -> Self {
        Self {
            inner,
            reply: Arc::new(reply),
        }
    }

    /// A layer answering in `reply`'s form.
    pub fn layer(reply: Reply) -> NormalizeLayer {
        NormalizeLayer::new(reply)
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Normalize<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body + From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let grpc = is_grpc(req.headers());
        // The request's span, the outermost of the stack's: the layers
        // behind open theirs under it.
        let span = crate::span::request();
        let fut = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        ResponseFuture {
            state: State::Call { fut },
            reply: self.reply.clone(),
            grpc,
            span,
        }
    }
}

pin_project! {
    /// Response future of [`Normalize`].
    ///
    /// A success that the channel's fixed reply replaces is answered only
    /// once the inner body has ended: the dedup layer records the success
    /// when its body ends, so the channel is told "success" only after the
    /// record is kept, and a body that fails half way gets the failure reply.
    pub struct ResponseFuture<F, B> {
        #[pin]
        state: State<F, B>,
        reply: Arc<Reply>,
        grpc: bool,
        span: crate::span::Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
        Call { #[pin] fut: F },
        Drain { parts: Option<http::response::Parts>, #[pin] body: B },
    }
}

impl<F, B> fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("normalize::ResponseFuture")
            .field("reply", &self.reply)
            .finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body + From<Bytes>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                StateProj::Call { fut } => {
                    let res = ready!(fut.poll(cx))?;
                    crate::span::record_answer(this.span, &res);
                    if *this.grpc && !res.status().is_success() && !is_grpc(res.headers()) {
                        return Poll::Ready(Ok(grpc_refusal(res)));
                    }
                    let replaced = res.status().is_success()
                        && !this.reply.is_unkeyed(&res)
                        && this.reply.success().is_some_and(|r| r.body().is_some());
                    if !replaced {
                        return Poll::Ready(Ok(this.reply.apply(res)));
                    }
                    let (parts, body) = res.into_parts();
                    this.state.set(State::Drain {
                        parts: Some(parts),
                        body,
                    });
                }
                StateProj::Drain { parts, mut body } => {
                    // The frames are discarded: the fixed reply replaces them.
                    while let Some(frame) = ready!(body.as_mut().poll_frame(cx)) {
                        if frame.is_err() {
                            let mut failed = Response::new(B::from(Bytes::new()));
                            *failed.status_mut() = StatusCode::BAD_GATEWAY;
                            return Poll::Ready(Ok(this.reply.apply(failed)));
                        }
                    }
                    let parts = parts.take().expect("polled after completion");
                    return Poll::Ready(Ok(this
                        .reply
                        .apply(Response::from_parts(parts, B::from(Bytes::new())))));
                }
            }
        }
    }
}
