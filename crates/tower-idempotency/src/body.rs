//! The response body type of the dedup layer.

use crate::limit::BodyLimitError;
use crate::Outcome;
use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};

pin_project! {
    /// Body of the responses that pass through [`Dedup`](crate::dedup::Dedup).
    ///
    /// A replay or one of the layer's own answers is a complete buffer with
    /// optional trailers; the first success of a guarded request is streamed
    /// from the task that records it (a few frames at a time, so memory does
    /// not grow with the response's size); requests that are not guarded and
    /// failures stream the inner service's body untouched.
    ///
    /// Errors are boxed: a streamed success that is cut short (its body failed,
    /// or it ran past the run limit) ends in an error, never in a clean end
    /// that would pass a truncated body for a whole one.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Stream { #[pin] body: B },
        Channel { rx: mpsc::Receiver<Piece>, hint: SizeHint, done: bool, _cancel: Option<CancelOnDrop> },
    }
}

/// Cancels a guarded call when dropped, unless [disarmed](Self::disarm):
/// the sending half of a `oneshot` whose receiver the call watches, for
/// which a sender dropped unsent means "stop", and a value "never mind".
/// (A `CancellationToken` costs a tree node and its mutex per call.)
#[derive(Debug)]
pub(crate) struct CancelOnDrop(oneshot::Sender<()>);

impl CancelOnDrop {
    /// A guard, and what the call awaits: it resolves only if the guard is
    /// dropped armed.
    pub(crate) fn new() -> (Self, impl std::future::Future<Output = ()> + Send) {
        let (tx, rx) = oneshot::channel();
        let cancelled = async move {
            if rx.await.is_ok() {
                // Disarmed: never cancelled.
                std::future::pending::<()>().await;
            }
        };
        (Self(tx), cancelled)
    }

    /// Lets the call go on whatever happens to the guard.
    pub(crate) fn disarm(self) {
        let _ = self.0.send(());
    }
}

impl<B> ResponseBody<B> {
    /// A buffered body followed by optional trailers.
    pub fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = if data.is_empty() { None } else { Some(data) };
        Self {
            kind: Kind::Full { data, trailers },
        }
    }

    /// The inner service's body, streamed untouched.
    pub fn stream(body: B) -> Self {
        Self {
            kind: Kind::Stream { body },
        }
    }

    /// A body fed by the task that runs a guarded call. Dropping it drops
    /// `cancel` (which cancels that call when finishing on disconnect is off).
    pub(crate) fn channel(
        rx: mpsc::Receiver<Piece>,
        hint: SizeHint,
        cancel: Option<CancelOnDrop>,
    ) -> Self {
        Self {
            kind: Kind::Channel {
                rx,
                hint,
                done: false,
                _cancel: cancel,
            },
        }
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self::full(Bytes::new(), None)
    }
}

impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data, None)
    }
}

/// The error of a [`ResponseBody`] and of the bodies the layers wrap: the
/// same type as `tower::BoxError`.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the task that runs a guarded call sends to the caller's body.
#[derive(Debug)]
pub(crate) enum Piece {
    /// A data or trailers frame.
    Frame(Frame<Bytes>),
    /// The body ended and was recorded.
    End,
    /// The body was cut short.
    Error(BoxError),
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            KindProj::Stream { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Channel { rx, done, .. } => {
                if *done {
                    return Poll::Ready(None);
                }
                match std::task::ready!(rx.poll_recv(cx)) {
                    Some(Piece::Frame(frame)) => Poll::Ready(Some(Ok(frame))),
                    Some(Piece::End) => {
                        *done = true;
                        Poll::Ready(None)
                    }
                    Some(Piece::Error(e)) => {
                        *done = true;
                        Poll::Ready(Some(Err(e)))
                    }
                    None => {
                        *done = true;
                        Poll::Ready(Some(Err("the response ended before its body".into())))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Stream { body } => body.is_end_stream(),
            Kind::Channel { done, .. } => *done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // With trailers the length is left open, so that HTTP/1.1 uses
            // chunked framing, the only one that can carry them.
            Kind::Full { data, trailers } => {
                let len = data.as_ref().map_or(0, |d| d.len() as u64);
                if trailers.is_some() {
                    let mut hint = SizeHint::new();
                    hint.set_lower(len);
                    hint
                } else {
                    SizeHint::with_exact(len)
                }
            }
            Kind::Stream { body } => body.size_hint(),
            Kind::Channel { hint, .. } => *hint,
        }
    }
}

/// The message of one of our own refusals, kept so that the normalize layer
/// can answer it in another form (a gRPC status).
#[derive(Debug, Clone)]
pub(crate) struct Rejection(pub(crate) Bytes);

/// A small `text/plain` answer of the layers' own (a refusal, a shed call)
/// with the given status. The [normalize layer](crate::normalize) knows it
/// for one of theirs: it answers it in the request's own form (a
/// trailers-only gRPC status for a gRPC request) and, on a channel route,
/// as the channel's failure reply. For a program in front of the layers
/// (a gateway's own answers) that must read the same.
pub fn text_response<B: From<Bytes>>(
    status: http::StatusCode,
    message: &'static str,
) -> http::Response<B> {
    text_response_owned(status, Bytes::from_static(message.as_bytes()))
}

/// [`text_response`] with a message built at run time.
pub fn text_response_owned<B: From<Bytes>>(
    status: http::StatusCode,
    message: Bytes,
) -> http::Response<B> {
    let mut res = http::Response::new(B::from(message.clone()));
    *res.status_mut() = status;
    res.extensions_mut().insert(Rejection(message));
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// The answer to a request body past its limit: 413.
pub(crate) fn too_large<B: From<Bytes>>() -> http::Response<B> {
    text_response(
        http::StatusCode::PAYLOAD_TOO_LARGE,
        "request body too large\n",
    )
}

/// See [`BodyLimitError::response`].
pub(crate) fn body_limit_response<B: From<Bytes>>(error: BodyLimitError) -> http::Response<B> {
    let (mut res, outcome) = match error {
        BodyLimitError::Timeout(_) => (
            text_response(
                http::StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time\n",
            ),
            Outcome::RejectedBadInput,
        ),
        BodyLimitError::OverBudget => {
            let mut res = text_response(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "too many request bodies in progress; retry later\n",
            );
            res.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            (res, Outcome::Shed)
        }
    };
    res.extensions_mut().insert(error);
    res.extensions_mut().insert(outcome);
    res
}

/// Accumulates data frames; a body of one frame is kept without a copy.
#[derive(Debug, Default)]
pub(crate) struct BodyBuffer {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    len: usize,
}

impl BodyBuffer {
    /// The bytes held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn push(&mut self, data: Bytes) {
        self.len += data.len();
        match (&self.first, &mut self.rest) {
            (None, _) => self.first = Some(data),
            (Some(first), None) => {
                let mut buf = BytesMut::with_capacity(first.len() + data.len());
                buf.extend_from_slice(first);
                buf.extend_from_slice(&data);
                self.rest = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&data),
        }
    }

    /// Reads `body`'s data frames into the buffer until the body ends
    /// (`Ok`), passes `limit` bytes (a 413 answer) or fails (a 400 answer,
    /// or [`body_limit_response`] for a [`BodyLimitError`]). Trailers are
    /// not kept.
    pub(crate) fn poll_collect<B, R>(
        &mut self,
        mut body: Pin<&mut B>,
        limit: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), http::Response<R>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
        R: From<Bytes>,
    {
        loop {
            match std::task::ready!(body.as_mut().poll_frame(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Ok(frame)) => {
                    if let Ok(mut data) = frame.into_data() {
                        let data = data.copy_to_bytes(data.remaining());
                        if self.len + data.len() > limit {
                            return Poll::Ready(Err(too_large()));
                        }
                        self.push(data);
                    }
                }
                Some(Err(e)) => {
                    let e: BoxError = e.into();
                    return Poll::Ready(Err(match BodyLimitError::find(&*e) {
                        Some(limit) => body_limit_response(limit),
                        None => text_response(
                            http::StatusCode::BAD_REQUEST,
                            "could not read the request body\n",
                        ),
                    }));
                }
            }
        }
    }

    pub(crate) fn into_bytes(self) -> Bytes {
        match (self.first, self.rest) {
            (_, Some(buf)) => buf.freeze(),
            (Some(first), None) => first,
            (None, None) => Bytes::new(),
        }
    }
}
