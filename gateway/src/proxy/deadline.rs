//! A body that fails once a deadline has passed.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tower::BoxError;

/// The upstream's body, failing once the request's deadline has passed.
pub(crate) struct Deadline<B> {
    pub(crate) body: B,
    pub(crate) sleep: Pin<Box<tokio::time::Sleep>>,
    /// The call's slot in the upstream's cap, held until the body is dropped.
    pub(crate) _slot: Option<super::upstream::CallPermit>,
    /// The call's slot in its route's cap, if it has one.
    pub(crate) _route: Option<crate::shed::Slot>,
}

impl<B> Body for Deadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err("upstream body timed out".into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
