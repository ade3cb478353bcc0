//! The spans the layers open (feature `tracing`): one `idempotency` span per
//! request through a stack, with `verify`, `claim`, `upstream` and `replay`
//! under it.
//!
//! Every span is made by `tracing`'s macros, so that a span nobody listens
//! to costs one check of its callsite's cached interest and nothing else:
//! no field is computed (the key's hash included) and nothing is
//! allocated. Without the feature the spans are a unit type and vanish.

/// A span of the crate: boxed, and nothing (one null pointer) when nobody
/// listens, so that the futures that hold one stay as small as they were.
#[cfg(feature = "tracing")]
#[derive(Debug, Default)]
pub(crate) struct Span(Option<Box<tracing::Span>>);

#[cfg(feature = "tracing")]
impl Span {
    fn new(span: tracing::Span) -> Self {
        Self((!span.is_disabled()).then(|| Box::new(span)))
    }

    /// Enters the span until the guard drops.
    pub(crate) fn enter(&self) -> Option<tracing::span::Entered<'_>> {
        self.0.as_deref().map(tracing::Span::enter)
    }

    /// Enters the span until the returned guard drops, which closes it.
    pub(crate) fn entered(self) -> Option<tracing::span::EnteredSpan> {
        self.0.map(|span| (*span).entered())
    }
}

/// Without `tracing`: no span at all.
#[cfg(not(feature = "tracing"))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Span;

#[cfg(not(feature = "tracing"))]
impl Span {
    /// Nothing to enter.
    pub(crate) fn enter(&self) -> Span {
        Span
    }

    /// Nothing to enter.
    pub(crate) fn entered(self) -> Span {
        Span
    }
}

/// A span of the crate (target `tower_idempotency`, level INFO).
#[cfg(feature = "tracing")]
macro_rules! span {
    ($($t:tt)*) => {
        Span::new(tracing::info_span!(target: "tower_idempotency", $($t)*))
    };
}

/// Without `tracing`: no span.
#[cfg(not(feature = "tracing"))]
macro_rules! span {
    ($($t:tt)*) => {
        Span
    };
}

/// The span of one request through a stack: its `preset`, `key_hash` and
/// `outcome` are recorded once its answer is known ([`record_answer`]).
pub(crate) fn request() -> Span {
    span!(
        "idempotency",
        preset = tracing::field::Empty,
        key_hash = tracing::field::Empty,
        outcome = tracing::field::Empty,
    )
}

/// The span of the sender's signature check.
pub(crate) fn verify() -> Span {
    span!("verify")
}

/// The span of the store's claim of a key.
pub(crate) fn claim() -> Span {
    span!("claim")
}

/// The span of the call to the inner service (the upstream), from the
/// request to the end of the answer's body.
pub(crate) fn upstream() -> Span {
    span!("upstream")
}

/// The span of a stored answer served again.
pub(crate) fn replay() -> Span {
    span!("replay")
}

/// Records what a request's answer says (its key's preset and hash, its
/// outcome) on its `idempotency` span; nothing when nobody listens.
#[cfg(feature = "tracing")]
pub(crate) fn record_answer<B>(span: &Span, res: &http::Response<B>) {
    let Some(span) = span.0.as_deref() else {
        return;
    };
    if let Some(key) = res.extensions().get::<crate::IdempotencyKey>() {
        span.record("preset", key.preset());
        span.record(
            "key_hash",
            tracing::field::display(crate::key::KeyHash(key.as_str())),
        );
    }
    if let Some(outcome) = res.extensions().get::<crate::Outcome>() {
        span.record("outcome", outcome.as_str());
    }
}

/// Without `tracing`: nothing.
#[cfg(not(feature = "tracing"))]
pub(crate) fn record_answer<B>(_span: &Span, _res: &http::Response<B>) {}

/// `fut` inside `span`: the span is entered at every poll (wherever the
/// future is moved, a spawned task included).
#[cfg(feature = "tracing")]
pub(crate) fn instrument<F: std::future::Future>(fut: F, span: Span) -> InSpan<F> {
    InSpan { fut, span }
}

/// Without `tracing`: `fut` itself.
#[cfg(not(feature = "tracing"))]
pub(crate) fn instrument<F: std::future::Future>(fut: F, _span: Span) -> F {
    fut
}

#[cfg(feature = "tracing")]
pin_project_lite::pin_project! {
    /// A future inside a [`Span`] (tracing's `Instrumented`, one pointer
    /// wide).
    pub(crate) struct InSpan<F> {
        #[pin]
        fut: F,
        span: Span,
    }
}

#[cfg(feature = "tracing")]
impl<F: std::future::Future> std::future::Future for InSpan<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        this.fut.poll(cx)
    }
}
