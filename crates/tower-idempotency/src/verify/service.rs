//! [`Verify`]: buffers the body, checks the signature, passes the request on.

use super::{Verified, VerifyError, VerifyLayer};
use crate::body::{text_response_owned, BodyBuffer};
use crate::outcome::{self, log_warn, Outcome};
use bytes::{Buf, Bytes};
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tower_service::Service;

/// Refuses requests whose signature does not verify; see the
/// [module docs](crate::verify).
#[derive(Clone)]
pub struct Verify<S> {
    pub(crate) inner: S,
    pub(crate) config: Arc<VerifyLayer>,
}

impl<S> Verify<S> {
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

impl<S: fmt::Debug> fmt::Debug for Verify<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verify")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

pin_project! {
    /// The request body after [`Verify`]: the original body when verification
    /// is off, else the verified bytes.
    #[derive(Debug)]
    pub struct VerifyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Unchecked { #[pin] body: B },
        Verified { #[pin] body: Full<Bytes> },
    }
}

impl<B> VerifyBody<B> {
    fn unchecked(body: B) -> Self {
        Self {
            kind: Kind::Unchecked { body },
        }
    }

    fn verified(body: Bytes) -> Self {
        Self {
            kind: Kind::Verified {
                body: Full::new(body),
            },
        }
    }
}

impl<B: Body> Body for VerifyBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Unchecked { body } => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining()))))),
            KindProj::Verified { body } => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(|never| match never {}))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Unchecked { body } => body.is_end_stream(),
            Kind::Verified { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Unchecked { body } => body.size_hint(),
            Kind::Verified { body } => body.size_hint(),
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Verify<S>
where
    S: Service<Request<VerifyBody<ReqBody>>, Response = Response<ResBody>> + Clone,
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
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // A request verified before (a queued notification delivered later:
        // its transmission was used and its timestamp may be stale by now)
        // is not checked again.
        if self.config.verifier.is_none() || req.extensions().get::<Verified>().is_some() {
            let (parts, body) = req.into_parts();
            let req = Request::from_parts(parts, VerifyBody::unchecked(body));
            return ResponseFuture {
                state: State::Calling {
                    fut: inner.call(req),
                },
            };
        }
        let (parts, body) = req.into_parts();
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
    /// Response future of [`Verify`].
    pub struct ResponseFuture<ReqBody, S, ResBody>
    where
        S: Service<Request<VerifyBody<ReqBody>>>,
    {
        #[pin]
        state: State<ReqBody, S, ResBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<ReqBody, S, ResBody>
    where
        S: Service<Request<VerifyBody<ReqBody>>>,
    {
        Collecting {
            #[pin]
            body: ReqBody,
            buf: BodyBuffer,
            parts: Option<Parts>,
            inner: Option<S>,
            config: Arc<VerifyLayer>,
        },
        Calling {
            #[pin]
            fut: S::Future,
        },
        Done {
            res: Option<Response<ResBody>>,
        },
    }
}

impl<ReqBody, S, ResBody> fmt::Debug for ResponseFuture<ReqBody, S, ResBody>
where
    S: Service<Request<VerifyBody<ReqBody>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("verify::ResponseFuture")
            .finish_non_exhaustive()
    }
}

/// The refusal of an unverified request: 401, outcome `unverified`.
fn refuse<B: From<Bytes>>(config: &VerifyLayer, parts: &Parts, err: &VerifyError) -> Response<B> {
    outcome::record(&config.preset, Outcome::Unverified);
    let channel = config.verifier.as_ref().map_or("custom", |v| v.channel());
    let path = parts.uri.path();
    // The request's id (tower-http's `SetRequestIdLayer` sets it), when it
    // has one: the line names no empty id.
    let request_id = parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok());
    log_warn!(preset = %config.preset, channel, path, request_id, reason = %err, "unverified request refused");
    let _ = (channel, path, request_id, err);
    // The sender learns only that the signature did not verify; which check
    // failed goes to the log, with the request id.
    let mut res = text_response_owned(
        StatusCode::UNAUTHORIZED,
        Bytes::from_static(b"signature invalid\n"),
    );
    res.extensions_mut().insert(Outcome::Unverified);
    res
}

impl<ReqBody, S, ResBody> Future for ResponseFuture<ReqBody, S, ResBody>
where
    S: Service<Request<VerifyBody<ReqBody>>, Response = Response<ResBody>>,
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
                    if let Some(res) = failure {
                        let outcome = res.extensions().get::<Outcome>();
                        let outcome = outcome.copied().unwrap_or(Outcome::RejectedBadInput);
                        outcome::record(&config.preset, outcome);
                        State::Done { res: Some(res) }
                    } else {
                        let body = std::mem::take(buf).into_bytes();
                        let verifier = config.verifier.as_ref().expect("verification is on");
                        let verified = {
                            let _span = crate::span::verify().entered();
                            verifier.verify(&mut parts, &body, (config.clock)())
                        };
                        match verified {
                            Ok(verified) => {
                                parts.extensions.insert(verified);
                                let body = VerifyBody::verified(body);
                                State::Calling {
                                    fut: inner.call(Request::from_parts(parts, body)),
                                }
                            }
                            Err(err) => State::Done {
                                res: Some(refuse(config, &parts, &err)),
                            },
                        }
                    }
                }
                StateProj::Calling { fut } => return fut.poll(cx),
                StateProj::Done { res } => {
                    return Poll::Ready(Ok(res.take().expect("polled after completion")))
                }
            };
            this.state.set(next);
        }
    }
}
