//! The span of one queued delivery (feature `tracing`): `deliver`, a root
//! of its own (the worker's), with target `tower_idempotency` and level
//! INFO like the layers' spans, so that one filter takes them all. With
//! `otel` it links to the span that queued the message (the `traceparent`
//! stored with it at ingest).

use crate::Message;

/// The span of one delivery of `message`. Its `route` is the path the
/// message was queued under; its `key_hash` that of the stored key (a copy
/// queued beside the key has the key's, see [`original_key`](crate::original_key)).
#[cfg(feature = "tracing")]
pub(crate) fn deliver(message: &Message, attempt: u32) -> tracing::Span {
    let key = crate::original_key(&message.key);
    let span = tracing::info_span!(
        target: "tower_idempotency",
        parent: None,
        "deliver",
        route = message.uri.path(),
        key_hash = %tower_idempotency::key::KeyHash(key),
        attempt,
    );
    #[cfg(feature = "otel")]
    if !span.is_disabled() {
        link_to_ingest(&span, &message.headers);
    }
    span
}

/// Without `tracing`: no span.
#[cfg(not(feature = "tracing"))]
pub(crate) fn deliver(_message: &Message, _attempt: u32) -> NoSpan {
    NoSpan
}

/// No span (without `tracing`): nothing to enter.
#[cfg(not(feature = "tracing"))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NoSpan;

#[cfg(not(feature = "tracing"))]
impl NoSpan {
    /// Nothing to enter.
    pub(crate) fn enter(&self) -> Self {
        Self
    }
}

/// `fut` inside `span`: the span is entered at every poll.
#[cfg(feature = "tracing")]
pub(crate) fn instrument<F: std::future::Future>(
    fut: F,
    span: tracing::Span,
) -> tracing::instrument::Instrumented<F> {
    tracing::Instrument::instrument(fut, span)
}

/// Without `tracing`: `fut` itself.
#[cfg(not(feature = "tracing"))]
pub(crate) fn instrument<F: std::future::Future>(fut: F, _span: NoSpan) -> F {
    fut
}

/// Links `span` (a delivery's) to the span context stored in a queued
/// message's headers, if there is one.
#[cfg(feature = "otel")]
fn link_to_ingest(span: &tracing::Span, headers: &http::HeaderMap) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !headers.contains_key("traceparent") {
        return;
    }
    let cx = tower_idempotency::trace::extract(headers);
    let ingest = cx.span().span_context().clone();
    if ingest.is_valid() {
        span.add_link(ingest);
    }
}
