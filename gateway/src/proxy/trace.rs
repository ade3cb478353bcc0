//! The trace context a client sends, read at the gateway's entrance.

use http::HeaderMap;
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use tower_idempotency::trace::extract;
use tracing_opentelemetry::OpenTelemetrySpanExt;

const TRACEPARENT: &str = "traceparent";

/// The context of a client's `traceparent`, to run its request in when no
/// span with a context is current (a server's own request span takes the
/// client's context itself); `None` without a valid one.
pub(crate) fn client_context(headers: &HeaderMap) -> Option<Context> {
    if !headers.contains_key(TRACEPARENT) {
        return None;
    }
    let cx = extract(headers);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Whether a span with an OpenTelemetry context is current.
pub(crate) fn in_span() -> bool {
    Context::current().has_active_span() || tracing::Span::current().context().has_active_span()
}
