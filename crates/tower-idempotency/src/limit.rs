//! Bounds on reading request bodies: a deadline per body and one budget of
//! bytes for every body being read at once.
//!
//! The key and verify layers buffer a request's body before anything else
//! happens (up to their size limit). A sender that sends the head and part
//! of a body, then stalls, would hold that buffer (and its connection) for
//! as long as it likes; a thousand of them would hold a thousand buffers.
//! [`BodyLimitsLayer`] (the layer of the [`BodyLimits`] service) wraps each
//! request body in a [`LimitedBody`] that fails
//! with a [`BodyLimitError`] when the body is not whole within the
//! deadline, or when reading its next frame would take the bytes held by
//! every body still being read past the shared [`BodyBudget`]. The
//! buffering layers answer those failures themselves:
//!
//! - past the deadline, `408 Request Timeout` (or the channel's failure
//!   reply): the sender may retry;
//! - past the budget, at once, the retryable failure: `503` with
//!   `Retry-After`, or the channel's failure reply, counted as
//!   [`Outcome::Shed`](crate::Outcome::Shed).
//!
//! Both answers carry the [`BodyLimitError`] in their extensions, so a
//! server can close the connection (its body was not read to the end).
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use std::time::Duration;
//! use tower_idempotency::limit::{BodyBudget, BodyLimitError, BodyLimitsLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let budget = BodyBudget::new(16);
//! let limits = BodyLimitsLayer::new().timeout(Duration::from_secs(10)).budget(budget.clone());
//!
//! let fits = limits.wrap(Full::new(Bytes::from_static(b"{\"id\":\"evt_1\"}")));
//! assert_eq!(fits.collect().await.unwrap().to_bytes().len(), 14);
//!
//! let too_much = limits.wrap(Full::new(Bytes::from(vec![b'x'; 17])));
//! let err = too_much.collect().await.unwrap_err();
//! assert_eq!(BodyLimitError::find(&*err), Some(BodyLimitError::OverBudget));
//! assert_eq!(budget.used(), 0);
//! # }
//! ```

use crate::body::BoxError;
use bytes::{Buf, Bytes};
use http::Request;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;

/// The deadline of [`BodyLimitsLayer::new`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// One budget of request-body bytes shared by every body that counts
/// against it (clones share it): the bytes of the bodies still being read.
///
/// A body's bytes count from the frame that brings them until the body
/// ends or is dropped. Size it so that the process can hold it (plus a
/// margin for the allocator) beside the store's budget; bodies that do not
/// fit get the retryable failure at once instead of memory.
///
/// ```
/// use tower_idempotency::limit::BodyBudget;
///
/// let budget = BodyBudget::new(64 << 20);
/// assert_eq!(budget.max_bytes(), 64 << 20);
/// assert_eq!(budget.used(), 0);
/// ```
#[derive(Clone)]
pub struct BodyBudget(Arc<Shared>);

struct Shared {
    max_bytes: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> Self {
        Self(Arc::new(Shared {
            max_bytes: bytes,
            used: AtomicUsize::new(0),
        }))
    }

    /// The budget in bytes: the most that the bodies still being read may
    /// hold together.
    pub fn max_bytes(&self) -> usize {
        self.0.max_bytes
    }

    /// The bytes held now.
    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit.
    fn take(&self, n: usize) -> bool {
        let max = self.0.max_bytes;
        self.0
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |used| {
                used.checked_add(n).filter(|total| *total <= max)
            })
            .is_ok()
    }

    /// Whether `n` more bytes would fit now (without taking them).
    fn fits(&self, n: usize) -> bool {
        self.used()
            .checked_add(n)
            .is_some_and(|total| total <= self.0.max_bytes)
    }

    fn give(&self, n: usize) {
        if n > 0 {
            self.0.used.fetch_sub(n, Ordering::AcqRel);
        }
    }
}

impl fmt::Debug for BodyBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyBudget")
            .field("max_bytes", &self.max_bytes())
            .field("used", &self.used())
            .finish()
    }
}

/// Why a [`LimitedBody`] failed; also put in the extensions of the answer
/// the buffering layers give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyLimitError {
    /// The body was not whole within the deadline.
    Timeout(Duration),
    /// Its next frame did not fit in the [`BodyBudget`].
    OverBudget,
}

impl BodyLimitError {
    /// The limit error inside a body error, if it is one.
    pub fn find(error: &(dyn std::error::Error + 'static)) -> Option<Self> {
        let mut at = Some(error);
        while let Some(e) = at {
            if let Some(found) = e.downcast_ref::<Self>() {
                return Some(*found);
            }
            at = e.source();
        }
        None
    }

    /// The answer to a request whose body hit this limit: 408 for the
    /// deadline, 503 with `Retry-After: 1` for the budget (counted as
    /// [`Outcome::Shed`](crate::Outcome::Shed)); both retryable, both
    /// carrying this error in their extensions (so that a server closes the
    /// connection, whose body was not read to the end) and the
    /// [`Outcome`](crate::Outcome). The layers answer so; a program that
    /// reads bodies before them answers the same.
    pub fn response<B: From<bytes::Bytes>>(self) -> http::Response<B> {
        crate::body::body_limit_response(self)
    }
}

impl fmt::Display for BodyLimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout(d) => write!(f, "the request body was not received within {d:?}"),
            Self::OverBudget => f.write_str("the budget of buffered request bodies is full"),
        }
    }
}

impl std::error::Error for BodyLimitError {}

/// A deadline and an optional budget for request bodies: the layer of
/// [`BodyLimits`], which wraps every request's body in a [`LimitedBody`];
/// [`wrap`](Self::wrap) wraps one body.
///
/// These bound how long a body may take and how many bytes all bodies being
/// read may hold together; the largest single body is each buffering
/// layer's own setting (`max_body_bytes`).
#[derive(Debug, Clone)]
pub struct BodyLimitsLayer {
    timeout: Option<Duration>,
    budget: Option<BodyBudget>,
}

impl Default for BodyLimitsLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl BodyLimitsLayer {
    /// A deadline of [`DEFAULT_BODY_TIMEOUT`] and no budget.
    pub const fn new() -> Self {
        Self {
            timeout: Some(DEFAULT_BODY_TIMEOUT),
            budget: None,
        }
    }

    /// The longest a body may take to arrive whole, from the first time it
    /// is read and has nothing ready (a body that is whole at once, as a
    /// small notification usually is, sets no timer). Defaults to 10
    /// seconds.
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// No deadline.
    pub const fn no_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }

    /// The budget every wrapped body counts against. Defaults to none.
    pub fn budget(mut self, budget: BodyBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// `body` with these limits.
    pub fn wrap<B>(&self, body: B) -> LimitedBody<B> {
        LimitedBody {
            body,
            deadline: None,
            timeout: self.timeout,
            held: Held {
                budget: self.budget.clone(),
                n: 0,
            },
            failed: false,
        }
    }
}

impl<S> Layer<S> for BodyLimitsLayer {
    type Service = BodyLimits<S>;

    fn layer(&self, inner: S) -> BodyLimits<S> {
        BodyLimits {
            inner,
            limits: self.clone(),
        }
    }
}

/// Wraps each request's body in a [`LimitedBody`]; see [`BodyLimitsLayer`].
#[derive(Debug, Clone)]
pub struct BodyLimits<S> {
    inner: S,
    limits: BodyLimitsLayer,
}

impl<S> BodyLimits<S> {
    /// `inner` with `limits` on its request bodies.
    pub fn new(inner: S, limits: BodyLimitsLayer) -> Self {
        Self { inner, limits }
    }

    /// A layer with `limits`; the same as `limits` itself.
    pub fn layer(limits: BodyLimitsLayer) -> BodyLimitsLayer {
        limits
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for BodyLimits<S>
where
    S: Service<Request<LimitedBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> S::Future {
        let limits = &self.limits;
        self.inner.call(req.map(|body| limits.wrap(body)))
    }
}

/// The bytes a body holds in its budget, given back when it ends or drops.
struct Held {
    budget: Option<BodyBudget>,
    n: usize,
}

impl Held {
    fn release(&mut self) {
        if let Some(budget) = &self.budget {
            budget.give(std::mem::take(&mut self.n));
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release();
    }
}

pin_project! {
    /// A request body with a deadline and a budget; from [`BodyLimitsLayer::wrap`].
    /// Its errors are boxed; a limit's is a [`BodyLimitError`].
    pub struct LimitedBody<B> {
        #[pin]
        body: B,
        // Set at the first read that finds nothing ready.
        #[pin]
        deadline: Option<Sleep>,
        timeout: Option<Duration>,
        held: Held,
        failed: bool,
    }
}

impl<B> fmt::Debug for LimitedBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitedBody")
            .field("timeout", &self.timeout)
            .field("held", &self.held.n)
            .finish_non_exhaustive()
    }
}

impl<B> Body for LimitedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.failed {
            return Poll::Ready(None);
        }
        match this.body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let last = this.body.is_end_stream();
                // A body whole in one frame (a notification) is held by no
                // one once read: it is checked against the budget, but not
                // written into it (a write per request on a counter every
                // serving thread shares).
                let whole = last && this.held.n == 0;
                if let (Some(data), Some(budget)) = (frame.data_ref(), &this.held.budget) {
                    let n = data.remaining();
                    let fits = if whole {
                        budget.fits(n)
                    } else {
                        budget.take(n)
                    };
                    if !fits {
                        *this.failed = true;
                        this.held.release();
                        return Poll::Ready(Some(Err(BodyLimitError::OverBudget.into())));
                    }
                    if !whole {
                        this.held.n += n;
                    }
                }
                if last {
                    this.held.release();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.held.release();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.held.release();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => {
                let Some(timeout) = *this.timeout else {
                    return Poll::Pending;
                };
                if this.deadline.is_none() {
                    this.deadline.set(Some(tokio::time::sleep(timeout)));
                }
                if let Some(deadline) = this.deadline.as_pin_mut()
                    && deadline.poll(cx).is_ready()
                {
                    *this.failed = true;
                    this.held.release();
                    let e = BodyLimitError::Timeout(timeout);
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
