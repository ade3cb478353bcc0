//! What a route's dedup layer calls: the [`Forward`] itself, or the route's
//! [`Order`] in front of it (see [`RouteOptions::order`](super::RouteOptions::order)).

use super::{Forward, ProxyBody};
use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tower::BoxError;
use tower_idempotency::order::Ordered;
use tower_idempotency::store::Store;
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The service behind a route's dedup layer. A route without an order
/// calls its [`Forward`] as it is: no store call, no allocation more.
#[derive(Clone, Debug)]
pub(super) enum ToUpstream<S> {
    /// Straight to the upstream.
    Forward(Forward),
    /// Per object one event at a time, stale events answered here.
    Ordered(Ordered<Answer<Forward>, S>),
}

impl<S, B> Service<Request<B>> for ToUpstream<S>
where
    S: Store,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<ProxyBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Both are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match self {
            // Forward's own future, as a route without an order had it.
            Self::Forward(forward) => forward.call(req),
            Self::Ordered(ordered) => {
                let answer = ordered.call(req);
                Box::pin(async move { Ok(answer.await?.map(|body| body.0)) })
            }
        }
    }
}

/// A service whose answers' body the order can make (its own answer to a
/// stale event): [`Forward`]'s, wrapped.
#[derive(Clone, Debug)]
pub(super) struct Answer<F>(pub(super) F);

impl<B> Service<Request<B>> for Answer<Forward>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<AnswerBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<AnswerBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let answer = self.0.call(req);
        Box::pin(async move { Ok(answer.await?.map(AnswerBody)) })
    }
}

/// [`ProxyBody`], and made from bytes.
pub(super) struct AnswerBody(ProxyBody);

impl From<Bytes> for AnswerBody {
    fn from(bytes: Bytes) -> Self {
        Self(
            Full::new(bytes)
                .map_err(|never| match never {})
                .boxed_unsync(),
        )
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}
