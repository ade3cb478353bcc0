//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP
//! headers, for the crate's spans exported through OpenTelemetry.
//!
//! With the feature `otel`, the crate's `tracing` spans (`idempotency` per
//! request, `verify`, `claim`, `upstream`, `replay` under it, `deliver` per
//! queued delivery; target `tower_idempotency`, level INFO) carry an
//! OpenTelemetry context once a
//! [`tracing-opentelemetry`](https://docs.rs/tracing-opentelemetry) layer
//! is installed, and:
//!
//! - a proxy in front of the layers (the `idempotency-gateway` crate's
//!   `Forward`) sends the context of the span it runs in to the upstream on
//!   every call ([`pass_on`]), queued deliveries included, so the
//!   upstream's own trace joins the gateway's;
//! - an acknowledge-then-deliver route stores its ingest's `traceparent`
//!   with the queued notification, and the delivery's `deliver` span links
//!   to it: one notification is one trace across instances, whichever
//!   instance delivers it;
//! - a client's own `traceparent` and `tracestate` are dropped (payment
//!   channels send none, and a sender should not choose the gateway's trace
//!   ids) unless the proxy is told to follow them (`accept` of
//!   [`pass_on`]), and even then one that is not a single well-formed W3C `traceparent`
//!   (see [`extract`]) is dropped with its `tracestate`: the request starts
//!   a trace of its own.
//!
//! The spans record `preset`, `key_hash` (the first 16 hex digits of the
//! SHA-256 of the stored key) and `outcome`: never the key nor a body. A
//! span nobody listens to costs a check of a cached flag: no field is
//! computed and nothing is allocated.
//!
//! Headers are read and written through the global propagator
//! ([`opentelemetry::global::set_text_map_propagator`]); install the W3C
//! one (`opentelemetry_sdk::propagation::TraceContextPropagator`) with your
//! exporter.
//!
//! ```
//! use opentelemetry::trace::TraceContextExt;
//! use opentelemetry_sdk::propagation::TraceContextPropagator;
//!
//! opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
//! let mut headers = http::HeaderMap::new();
//! headers.insert(
//!     "traceparent",
//!     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap(),
//! );
//! let cx = tower_idempotency::trace::extract(&headers);
//! let trace_id = cx.span().span_context().trace_id();
//! assert_eq!(trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
//!
//! // Outside any span there is no context to send: nothing is written.
//! let mut out = http::HeaderMap::new();
//! tower_idempotency::trace::inject(&mut out);
//! assert!(out.get("traceparent").is_none());
//! ```

use http::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header of the trace and the parent span.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The W3C header of the vendors' trace state.
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Writes the context of the current `tracing` span (its OpenTelemetry
/// context: `traceparent`, and `tracestate` when it has one) into
/// `headers`, through the global propagator, in place of any `traceparent`
/// and `tracestate` already there. Outside any span with an OpenTelemetry
/// context (no span, or no `tracing-opentelemetry` layer), nothing is
/// written.
pub fn inject(headers: &mut HeaderMap) {
    let mut cx = tracing::Span::current().context();
    if !cx.has_active_span() {
        // A context attached by other instrumentation.
        cx = Context::current();
        if !cx.has_active_span() {
            return;
        }
    }
    // The propagator writes no empty `tracestate`: one already there
    // belongs to another trace.
    headers.remove(TRACESTATE);
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&cx, &mut HeaderInjector(headers));
    });
}

/// The context `headers` carry (`traceparent`, `tracestate`), read
/// through the global propagator: give it to
/// [`OpenTelemetrySpanExt::set_parent`] to continue a caller's trace. An
/// empty context when they carry none, or a `traceparent` that is not one
/// W3C Trace Context `traceparent` header exactly: two of them, a field
/// that is not lowercase hex of its length (2, 32, 16, 2 digits), version
/// `ff`, an all-zero id, or more after the flags in version `00`.
pub fn extract(headers: &HeaderMap) -> Context {
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(headers))
    })
}

/// Readies a request's headers for an upstream, as a proxy passes a
/// request on: a client's `traceparent` and `tracestate` are removed unless
/// they are `accept`ed (the client is trusted to continue its own trace)
/// and the `traceparent` is well-formed ([`extract`]'s rules), then the
/// current span's context is written in their place ([`inject`]).
pub fn pass_on(headers: &mut HeaderMap, accept: bool) {
    if !accept || !one_well_formed(headers) {
        headers.remove(TRACEPARENT);
        headers.remove(TRACESTATE);
    }
    inject(headers);
}

/// Whether `headers` hold exactly one `traceparent` and it is well-formed
/// W3C Trace Context: `VERSION-TRACEID-PARENTID-FLAGS`, lowercase hex of 2,
/// 32, 16 and 2 digits, a version other than `ff`, ids not all zero; a
/// version above `00` may add fields after the flags (a `-` first).
fn one_well_formed(headers: &HeaderMap) -> bool {
    let mut all = headers.get_all(TRACEPARENT).iter();
    let (Some(value), None) = (all.next(), all.next()) else {
        return false;
    };
    let value = value.as_bytes();
    let hex = |s: &[u8]| s.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let not_zero = |s: &[u8]| s.iter().any(|&b| b != b'0');
    let Some((head, rest)) = value.split_at_checked(55) else {
        return false;
    };
    let (version, trace_id, parent_id, flags) =
        (&head[..2], &head[3..35], &head[36..52], &head[53..]);
    let dashes = head[2] == b'-' && head[35] == b'-' && head[52] == b'-';
    let more_ok = match version {
        b"00" => rest.is_empty(),
        _ => rest.first().is_none_or(|&b| b == b'-'),
    };
    dashes
        && more_ok
        && version != b"ff"
        && hex(version)
        && hex(trace_id)
        && hex(parent_id)
        && hex(flags)
        && not_zero(trace_id)
        && not_zero(parent_id)
}

/// Writes a propagator's fields into a [`HeaderMap`].
struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // An empty `tracestate` is the same as none (W3C): not sent.
        if value.is_empty() {
            return;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) else {
            return;
        };
        self.0.insert(name, value);
    }
}

/// Reads a propagator's fields from a [`HeaderMap`].
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // The propagator reads `tracestate` only after a `traceparent` it
        // took: a malformed one is none.
        if key.eq_ignore_ascii_case(TRACEPARENT.as_str()) && !one_well_formed(self.0) {
            return None;
        }
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}
