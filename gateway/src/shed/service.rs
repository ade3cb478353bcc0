//! [`InFlightLimitLayer`] and [`InFlightLimit`]: at most N calls in flight,
//! a short wait for a slot, then the retryable failure as a response.

use super::adaptive::AimdLimit;
use super::slots::{failed, shed_response, Gauge, Slot, Slots, DEFAULT_QUEUE_WAIT};
use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::time::Sleep;
use tokio_util::sync::PollSemaphore;
use tower_layer::Layer;
use tower_service::Service;

const SHED: &str = "too many calls in progress to the upstream; retry later\n";

/// Caps the calls in flight to the inner service; builds [`InFlightLimit`].
///
/// A call holds its slot from the moment it is sent to the inner service
/// until the inner service's response body has ended (or is dropped). A
/// call that finds every slot taken waits at most the queue wait for one;
/// past it, the inner service is not called and the answer is `503 Service
/// Unavailable` with `Retry-After: 1`, marked
/// [`Outcome::Shed`](tower_idempotency::Outcome::Shed). Inside an
/// [`IdempotencyLayer`](tower_idempotency::IdempotencyLayer) that answer releases the
/// claim, is counted as `idempotency_requests_total{outcome="shed"}`, and
/// reaches the sender as its channel's retryable failure reply; the
/// channel comes back on its schedule.
///
/// Clones share the slots, as do layers given clones of one [`Slots`].
#[derive(Clone)]
pub struct InFlightLimitLayer {
    slots: Slots,
    queue_wait: Duration,
    gauge: Gauge,
}

impl fmt::Debug for InFlightLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightLimitLayer")
            .field("slots", &self.slots)
            .field("queue_wait", &self.queue_wait)
            .finish_non_exhaustive()
    }
}

impl InFlightLimitLayer {
    /// At most `max` calls in flight (at least one), slots of its own.
    pub fn new(max: usize) -> Self {
        Self::shared(Slots::new(max))
    }

    /// At most as many calls in flight as `limit` gives, adapting to the
    /// inner service's answers: its 5xx and 429 answers, its errors and
    /// its slow answers shrink the limit, its fast successes grow it (see
    /// [`AimdLimit`]). Slots of its own.
    pub fn adaptive(limit: AimdLimit) -> Self {
        Self::shared(Slots::adaptive(limit))
    }

    /// Calls in flight counted against `slots`, shared with every other
    /// holder of a clone.
    pub fn shared(slots: Slots) -> Self {
        Self {
            slots,
            queue_wait: DEFAULT_QUEUE_WAIT,
            gauge: Gauge::default(),
        }
    }

    /// The longest a call waits for a slot before it is shed. Zero sheds at
    /// once. Defaults to 50 milliseconds.
    pub fn queue_wait(mut self, wait: Duration) -> Self {
        self.queue_wait = wait;
        self
    }

    /// With the `metrics` feature, follows the calls in flight in the gauge
    /// `idempotency_upstream_in_flight{route}` with this `route` label
    /// (install the recorder first), and the limit in
    /// `idempotency_upstream_limit{route}` (an adaptive limit's log lines
    /// name the route too). Defaults to no gauge.
    pub fn route(mut self, route: &str) -> Self {
        self.gauge = Gauge::route(route);
        self.slots.name(route);
        self
    }

    /// The slots.
    pub fn slots(&self) -> &Slots {
        &self.slots
    }
}

impl<S> Layer<S> for InFlightLimitLayer {
    type Service = InFlightLimit<S>;

    fn layer(&self, inner: S) -> InFlightLimit<S> {
        InFlightLimit {
            inner,
            limit: self.clone(),
        }
    }
}

/// At most N calls in flight to `S`; past it, a short wait, then the
/// retryable failure as a response (see [`InFlightLimitLayer`]).
#[derive(Clone, Debug)]
pub struct InFlightLimit<S> {
    inner: S,
    limit: InFlightLimitLayer,
}

impl<S> InFlightLimit<S> {
    /// `inner` behind `limit`.
    pub fn new(inner: S, limit: InFlightLimitLayer) -> Self {
        Self { inner, limit }
    }

    /// A layer of at most `max` calls in flight.
    pub fn layer(max: usize) -> InFlightLimitLayer {
        InFlightLimitLayer::new(max)
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for InFlightLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: Body<Data = Bytes>,
{
    type Response = Response<InFlightBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<ReqBody>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let gauge = self.limit.gauge.clone();
        let state = match self.limit.slots.try_acquire() {
            Some(permit) => {
                let slot = self.limit.slots.hold(permit, &gauge);
                State::Calling {
                    fut: self.inner.call(req),
                    slow: slow_timer(&slot),
                    slot: Some(slot),
                }
            }
            None if self.limit.queue_wait.is_zero() => State::Shed,
            None => {
                // The ready service waits with the request; a clone stays.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                State::Waiting {
                    pool: self.limit.slots.clone(),
                    slots: PollSemaphore::new(self.limit.slots.semaphore()),
                    sleep: Box::pin(tokio::time::sleep(self.limit.queue_wait)),
                    call: Some((inner, req)),
                }
            }
        };
        ResponseFuture { state, gauge }
    }
}

/// An adaptive slot's timer: the call counts as slow when it fires.
fn slow_timer(slot: &Slot) -> Option<Pin<Box<Sleep>>> {
    slot.slow_at()
        .map(|at| Box::pin(tokio::time::sleep_until(at)))
}

pin_project! {
    /// The response future of [`InFlightLimit`].
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req>,
        gauge: Gauge,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req>
    where
        S: Service<Req>,
    {
        // Every slot was taken: waiting for one, or the deadline.
        Waiting {
            pool: Slots,
            slots: PollSemaphore,
            sleep: Pin<Box<Sleep>>,
            call: Option<(S, Req)>,
        },
        // A slot is held: the inner call runs.
        Calling {
            #[pin]
            fut: S::Future,
            slot: Option<Slot>,
            slow: Option<Pin<Box<Sleep>>>,
        },
        // Shed without waiting.
        Shed,
        Done,
    }
}

impl<S: Service<Req>, Req> fmt::Debug for ResponseFuture<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting",
            State::Calling { .. } => "calling",
            State::Shed | State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, Req, B> Future for ResponseFuture<S, Req>
where
    S: Service<Req, Response = Response<B>>,
    B: Body<Data = Bytes>,
{
    type Output = Result<Response<InFlightBody<B>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Waiting {
                    pool,
                    slots,
                    sleep,
                    call,
                } => {
                    let permit = match slots.poll_acquire(cx) {
                        Poll::Ready(Some(permit)) => permit,
                        // The semaphore is never closed.
                        Poll::Ready(None) => {
                            this.state.set(State::Shed);
                            continue;
                        }
                        Poll::Pending => {
                            ready!(sleep.as_mut().poll(cx));
                            this.state.set(State::Shed);
                            continue;
                        }
                    };
                    let (mut inner, req) = call.take().expect("polled after completion");
                    let fut = inner.call(req);
                    let slot = pool.hold(permit, this.gauge);
                    let slow = slow_timer(&slot);
                    let slot = Some(slot);
                    this.state.set(State::Calling { fut, slot, slow });
                }
                StateProj::Calling { fut, slot, slow } => {
                    let res = match fut.poll(cx) {
                        Poll::Ready(res) => res,
                        Poll::Pending => {
                            if let Some(timer) = slow
                                && timer.as_mut().poll(cx).is_ready()
                            {
                                *slow = None;
                                if let Some(slot) = slot {
                                    slot.slow();
                                }
                            }
                            return Poll::Pending;
                        }
                    };
                    let mut slot = slot.take();
                    if let Some(slot) = &mut slot {
                        slot.answered(res.as_ref().map_or(Some(true), |r| failed(r.status())));
                    }
                    let res = res?;
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(|body| InFlightBody {
                        kind: Kind::Inner { body, slot },
                    })));
                }
                StateProj::Shed => {
                    this.state.set(State::Done);
                    tracing::warn!("calls in flight at their cap; request shed");
                    return Poll::Ready(Ok(shed_response(SHED)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

pin_project! {
    /// The response body of [`InFlightLimit`]: the inner service's, holding
    /// its call's slot until it ends, or the shed answer's text.
    pub struct InFlightBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            slot: Option<Slot>,
        },
        Text {
            data: Option<Bytes>,
        },
    }
}

impl<B> From<Bytes> for InFlightBody<B> {
    fn from(data: Bytes) -> Self {
        Self {
            kind: Kind::Text { data: Some(data) },
        }
    }
}

impl<B> fmt::Debug for InFlightBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holds = matches!(&self.kind, Kind::Inner { slot: Some(_), .. });
        f.debug_struct("InFlightBody")
            .field("holds_slot", &holds)
            .finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for InFlightBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { mut body, slot } => {
                let frame = ready!(body.as_mut().poll_frame(cx));
                // The call is over once its body is: its slot goes back.
                if !matches!(frame, Some(Ok(_))) || body.is_end_stream() {
                    slot.take();
                }
                Poll::Ready(frame)
            }
            KindProj::Text { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Text { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Text { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
