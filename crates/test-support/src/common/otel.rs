//! The crate's spans as OpenTelemetry exports them: a `tracing` subscriber
//! with the `tracing-opentelemetry` layer over the SDK's in-memory exporter,
//! and the W3C propagator.

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

/// This thread's subscriber while it lives (a current-thread runtime's
/// tasks included), exporting every span that ends.
pub struct Traces {
    exporter: InMemorySpanExporter,
    _provider: SdkTracerProvider,
    _guard: tracing::subscriber::DefaultGuard,
}

impl Traces {
    pub fn start() -> Self {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("tests"));
        // With one subscriber registered, tracing caches a callsite's
        // interest from the thread that hits it first: another test's
        // thread, with no subscriber, would switch it off for every
        // thread. A second one keeps the cache per thread.
        static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
        let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
        tracing::callsite::rebuild_interest_cache();
        Self {
            exporter,
            _provider: provider,
            _guard: guard,
        }
    }

    /// Every span that ended, in the order they ended.
    pub fn spans(&self) -> Vec<SpanData> {
        self.exporter.get_finished_spans().unwrap()
    }

    /// The spans named `name` that ended, in the order they ended.
    pub fn named(&self, name: &str) -> Vec<SpanData> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }

    /// The one span named `name` whose parent is `parent`.
    pub fn child(&self, parent: &SpanData, name: &str) -> SpanData {
        let found: Vec<SpanData> = self
            .named(name)
            .into_iter()
            .filter(|s| s.parent_span_id == parent.span_context.span_id())
            .collect();
        assert_eq!(found.len(), 1, "one `{name}` under `{}`", parent.name);
        let child = found.into_iter().next().unwrap();
        assert_eq!(
            child.span_context.trace_id(),
            parent.span_context.trace_id()
        );
        child
    }
}

/// A span's attribute as a string.
pub fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| match &kv.value {
            Value::String(s) => s.as_str().to_owned(),
            other => other.to_string(),
        })
}

/// Every attribute value of every span, as strings.
pub fn all_values(spans: &[SpanData]) -> Vec<String> {
    spans
        .iter()
        .flat_map(|s| s.attributes.iter().map(|kv| kv.value.to_string()))
        .collect()
}

/// The trace id and parent span id of a `traceparent` header.
pub fn traceparent(value: &http::HeaderValue) -> (TraceId, SpanId) {
    let parts: Vec<&str> = value.to_str().unwrap().split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {value:?}");
    (
        TraceId::from_hex(parts[1]).unwrap(),
        SpanId::from_hex(parts[2]).unwrap(),
    )
}
