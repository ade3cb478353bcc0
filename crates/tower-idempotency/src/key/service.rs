use super::layer::{KeyConfig, KeyLayer};
use super::{
    route_of, CapturedRequest, ExtractKey, FingerprintExtra, IdempotencyKey, KeyBody, Principal,
};
use crate::body::text_response_owned;
use crate::body::{too_large, BodyBuffer};
use crate::outcome::{self, Outcome};
use bytes::Bytes;
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// Buffers the body, reads the key, passes `Request<Full<Bytes>>` on.
#[derive(Clone)]
pub struct Key<S> {
    pub(super) inner: S,
    pub(super) config: Arc<KeyConfig>,
}

impl<S> Key<S> {
    /// Wraps `inner`, reading keys with `extractor` and the
    /// [`KeyLayer::new`] defaults. Use [`KeyLayer`] to change them.
    pub fn new(inner: S, extractor: impl ExtractKey) -> Self {
        KeyLayer::new(extractor).layer(inner)
    }

    /// A layer for this service.
    pub fn layer(extractor: impl ExtractKey) -> KeyLayer {
        KeyLayer::new(extractor)
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

impl<S: fmt::Debug> fmt::Debug for Key<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

/// Whether the layers guard a request of this method: `POST`, `PUT`,
/// `PATCH` and `DELETE`. Every other method passes through unkeyed.
pub fn is_guarded_method(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Key<S>
where
    S: Service<Request<KeyBody>, Response = Response<ResBody>> + Clone,
    ReqBody: Body,
    ReqBody::Error: Into<crate::body::BoxError>,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<ReqBody, S, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > self.config.max_body as u64) {
            outcome::record(&self.config.preset, Outcome::RejectedBadInput);
            return ResponseFuture::done(too_large());
        }
        ResponseFuture {
            state: State::Collecting {
                body,
                buf: BodyBuffer::default(),
                parts: Some(parts),
                inner: Some(inner),
                config: self.config.clone(),
            },
        }
    }
}

pin_project! {
    /// Response future of [`Key`].
    pub struct ResponseFuture<ReqBody, S, ResBody>
    where
        S: Service<Request<KeyBody>>,
    {
        #[pin]
        state: State<ReqBody, S, ResBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<ReqBody, S, ResBody>
    where
        S: Service<Request<KeyBody>>,
    {
        Collecting {
            #[pin]
            body: ReqBody,
            buf: BodyBuffer,
            parts: Option<Parts>,
            inner: Option<S>,
            config: Arc<KeyConfig>,
        },
        Calling {
            #[pin]
            fut: S::Future,
            captured: Option<CapturedRequest>,
            // A request without a key passed on where the key is optional:
            // its answer is the handler's, untouched by the reply format.
            unkeyed: bool,
        },
        Done {
            res: Option<Response<ResBody>>,
        },
    }
}

impl<ReqBody, S, ResBody> ResponseFuture<ReqBody, S, ResBody>
where
    S: Service<Request<KeyBody>>,
{
    fn done(res: Response<ResBody>) -> Self {
        Self {
            state: State::Done { res: Some(res) },
        }
    }
}

impl<ReqBody, S, ResBody> fmt::Debug for ResponseFuture<ReqBody, S, ResBody>
where
    S: Service<Request<KeyBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("key::ResponseFuture")
            .finish_non_exhaustive()
    }
}

/// A 400 with `message`, its outcome in the extensions.
fn refused<B: From<Bytes>>(outcome: Outcome, message: String) -> Response<B> {
    let mut res = text_response_owned(StatusCode::BAD_REQUEST, Bytes::from(message));
    res.extensions_mut().insert(outcome);
    res
}

/// What to do with a buffered request.
fn admit<B: From<Bytes>>(
    config: &KeyConfig,
    parts: &mut Parts,
    body: &Bytes,
) -> Result<(), Response<B>> {
    let guarded = is_guarded_method(&parts.method);
    match config.extractor.extract(parts, body) {
        Ok(Some(found)) => {
            if found.key.len() > config.max_key_len {
                outcome::record(&config.preset, Outcome::RejectedBadInput);
                return Err(refused(
                    Outcome::RejectedBadInput,
                    format!("idempotency key longer than {} bytes\n", config.max_key_len),
                ));
            }
            let principal = config.principal.principal(parts);
            let route = match &config.route {
                Some(r) => Cow::Borrowed(&**r),
                None => route_of(parts),
            };
            let fingerprint = match parts.extensions.get::<FingerprintExtra>() {
                Some(extra) => found.fingerprint.with_extra(&extra.0),
                None => found.fingerprint,
            };
            let mut key = IdempotencyKey::new(
                &config.prefix,
                config.preset.clone(),
                &route,
                principal.as_deref(),
                &found.key,
                fingerprint,
            );
            if config.consume_token {
                key = key.with_token(IdempotencyKey::token_store_key(
                    &config.prefix,
                    principal.as_deref(),
                    &found.key,
                ));
            }
            parts.extensions.insert(key);
            Ok(())
        }
        Ok(None) if guarded && config.required => {
            outcome::record(&config.preset, Outcome::KeyMissing);
            Err(refused(
                Outcome::KeyMissing,
                format!(
                    "missing idempotency key: expected the {}\n",
                    config.describe
                ),
            ))
        }
        // A key that was sent but cannot be used is refused even where keys
        // are optional: running unguarded would ignore the client's intent.
        Err(e) if guarded && (config.required || e.is_invalid_key()) => {
            outcome::record(&config.preset, Outcome::RejectedBadInput);
            Err(refused(
                Outcome::RejectedBadInput,
                format!("malformed request: {e}\n"),
            ))
        }
        // Optional key, or a safe method: pass through untouched.
        Ok(None) | Err(_) => Ok(()),
    }
}

/// What [`KeyLayer::capture_request`] keeps of a request that has a key.
fn capture(config: &KeyConfig, parts: &Parts, body: &Bytes) -> Option<CapturedRequest> {
    if !config.capture || parts.extensions.get::<IdempotencyKey>().is_none() {
        return None;
    }
    #[cfg(feature = "verify")]
    let decrypted = parts
        .extensions
        .get::<crate::verify::DecryptedResource>()
        .map(|d| d.0.clone());
    #[cfg(not(feature = "verify"))]
    let decrypted = None;
    #[cfg(feature = "verify")]
    let verified = parts.extensions.get::<crate::verify::Verified>().is_some();
    #[cfg(not(feature = "verify"))]
    let verified = false;
    Some(CapturedRequest {
        body: body.clone(),
        decrypted,
        verified,
    })
}

impl<ReqBody, S, ResBody> Future for ResponseFuture<ReqBody, S, ResBody>
where
    S: Service<Request<KeyBody>, Response = Response<ResBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<crate::body::BoxError>,
    ResBody: From<Bytes>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let next = match this.state.as_mut().project() {
                StateProj::Collecting {
                    mut body,
                    buf,
                    parts,
                    inner,
                    config,
                } => {
                    let failure =
                        ready!(buf.poll_collect(body.as_mut(), config.max_body, cx)).err();
                    let mut parts = parts.take().expect("polled after completion");
                    let mut inner = inner.take().expect("polled after completion");
                    match failure {
                        Some(res) => {
                            let outcome = res.extensions().get::<Outcome>();
                            let outcome = outcome.copied().unwrap_or(Outcome::RejectedBadInput);
                            outcome::record(&config.preset, outcome);
                            State::Done { res: Some(res) }
                        }
                        None => {
                            let body = std::mem::take(buf).into_bytes();
                            match admit(config, &mut parts, &body) {
                                Err(res) => State::Done { res: Some(res) },
                                Ok(()) => {
                                    let captured = capture(config, &parts, &body);
                                    let unkeyed = !config.required
                                        && parts.extensions.get::<IdempotencyKey>().is_none();
                                    State::Calling {
                                        fut: inner
                                            .call(Request::from_parts(parts, Full::new(body))),
                                        captured,
                                        unkeyed,
                                    }
                                }
                            }
                        }
                    }
                }
                StateProj::Calling {
                    fut,
                    captured,
                    unkeyed,
                } => {
                    let mut res = ready!(fut.poll(cx));
                    if let (Ok(res), Some(captured)) = (&mut res, captured.take()) {
                        res.extensions_mut().insert(captured);
                    }
                    if let (Ok(res), true) = (&mut res, *unkeyed) {
                        res.extensions_mut().insert(crate::normalize::Unkeyed);
                    }
                    return Poll::Ready(res);
                }
                StateProj::Done { res } => {
                    return Poll::Ready(Ok(res.take().expect("polled after completion")))
                }
            };
            this.state.set(next);
        }
    }
}
