//! Traces exported over OTLP: off unless an endpoint is set (`--otlp-endpoint`,
//! `otlp_endpoint`, or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`).
//!
//! The spans go through the SDK's batch span processor: finished spans wait
//! in a bounded queue and a thread of its own exports them, so a collector
//! that is down or slow never slows or fails a request. A span that finds
//! the queue full, or whose batch the collector did not take, is dropped and
//! counted in `gateway_trace_spans_dropped_total` (label `reason`:
//! `queue_full`, `export_failed`): the SDK only logs its drops, so the
//! gateway counts them around its processor and exporter.
//!
//! OTLP/HTTP goes through the gateway's own hyper client (rustls with ring,
//! the Mozilla roots), on the main runtime; gRPC through tonic.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The service name unless `OTEL_SERVICE_NAME` says otherwise.
const SERVICE_NAME: &str = "idempotency-gateway";
/// The SDK's default queue of finished spans (`OTEL_BSP_MAX_QUEUE_SIZE`).
const QUEUE: usize = 2048;
/// How long one export may take unless `OTEL_EXPORTER_OTLP_TIMEOUT` says
/// otherwise (the OTLP default).
const TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes of a collector's answer read.
const MAX_ANSWER: usize = 64 << 10;

/// How the gateway exports its traces, when it does.
#[derive(Debug, Clone)]
pub(crate) struct Traces {
    /// The URL spans are sent to (`…/v1/traces` over HTTP).
    pub(crate) endpoint: String,
    pub(crate) protocol: Protocol,
    pub(crate) sampler: Sampling,
    /// `OTEL_SERVICE_NAME`.
    pub(crate) service: String,
    queue: usize,
    timeout: Duration,
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    HttpProtobuf,
    Grpc,
}

/// Which new traces are kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Sampling {
    /// `always_on`, `always_off` or `traceidratio` (a ratio): the trace's
    /// own decision.
    Root(f64),
    /// The same unless the span has a parent (a client's `traceparent`),
    /// whose decision it follows (`parentbased_*`).
    ParentBased(f64),
}

impl Sampling {
    fn sampler(self) -> Sampler {
        let root = |ratio: f64| {
            if ratio >= 1.0 {
                Sampler::AlwaysOn
            } else if ratio <= 0.0 {
                Sampler::AlwaysOff
            } else {
                Sampler::TraceIdRatioBased(ratio)
            }
        };
        match self {
            Sampling::Root(r) => root(r),
            Sampling::ParentBased(r) => Sampler::ParentBased(Box::new(root(r))),
        }
    }

    /// For the start line.
    pub(crate) fn describe(self) -> String {
        match self {
            Sampling::Root(r) => format!("{r}"),
            Sampling::ParentBased(r) => format!("{r} (parent-based)"),
        }
    }
}

/// What the flags and the config file say; the `OTEL_*` variables fill in
/// the rest.
#[derive(Debug, Default)]
pub(crate) struct Given {
    pub(crate) endpoint: Option<String>,
    pub(crate) ratio: Option<f64>,
}

/// The export settings, when an endpoint is set; `warnings` gets what is
/// ignored. `Err` is the message for exit status 2.
pub(crate) fn settings(given: Given, warnings: &mut Vec<String>) -> Result<Option<Traces>, String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let protocol = match env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .as_deref()
        .map(str::trim)
    {
        None | Some("http/protobuf") => Protocol::HttpProtobuf,
        Some("grpc") => Protocol::Grpc,
        Some(other) => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL: `{other}` is not `http/protobuf` or `grpc`"
            ))
        }
    };
    // A signal's own endpoint is used as written; the general one gets the
    // signal's path over HTTP (the OTLP exporter specification).
    let endpoint = match (given.endpoint, env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
        (Some(base), _) => full(&base, protocol).map_err(|e| format!("`--otlp-endpoint`: {e}"))?,
        (None, Some(url)) => {
            check_url(&url).map_err(|e| format!("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {e}"))?;
            url
        }
        (None, None) => match env("OTEL_EXPORTER_OTLP_ENDPOINT") {
            Some(base) => {
                full(&base, protocol).map_err(|e| format!("OTEL_EXPORTER_OTLP_ENDPOINT: {e}"))?
            }
            None => {
                if given.ratio.is_some() {
                    warnings.push(
                        "--trace-sample-ratio without an OTLP endpoint (--otlp-endpoint or \
                         OTEL_EXPORTER_OTLP_ENDPOINT): no trace is exported"
                            .into(),
                    );
                }
                return Ok(None);
            }
        },
    };
    let sampler = match given.ratio {
        Some(ratio) => Sampling::ParentBased(ratio),
        None => from_env(
            env("OTEL_TRACES_SAMPLER"),
            env("OTEL_TRACES_SAMPLER_ARG"),
            warnings,
        )?,
    };
    let number = |name: &str| -> Result<Option<u64>, String> {
        env(name)
            .map(|v| {
                (v.trim().parse::<u64>().ok().filter(|n| *n > 0))
                    .ok_or_else(|| format!("{name}: `{v}` is not a positive whole number"))
            })
            .transpose()
    };
    let queue = number("OTEL_BSP_MAX_QUEUE_SIZE")?.map_or(QUEUE, |n| n as usize);
    let timeout = number("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")?
        .or(number("OTEL_EXPORTER_OTLP_TIMEOUT")?)
        .map_or(TIMEOUT, Duration::from_millis);
    Ok(Some(Traces {
        endpoint,
        protocol,
        sampler,
        service: env("OTEL_SERVICE_NAME").unwrap_or_else(|| SERVICE_NAME.to_owned()),
        queue,
        timeout,
    }))
}

/// `--trace-sample-ratio`: a share of new traces, 0 to 1.
pub(crate) fn ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!(
            "`{s}`: expected a ratio from 0 to 1 (0.01 keeps one trace in 100)"
        )),
    }
}

/// `OTEL_TRACES_SAMPLER` and its argument; an unknown sampler is the
/// default one, with a warning (as the specification asks).
fn from_env(
    sampler: Option<String>,
    arg: Option<String>,
    warnings: &mut Vec<String>,
) -> Result<Sampling, String> {
    let ratio = || -> Result<f64, String> {
        arg.as_deref()
            .map_or(Ok(1.0), ratio)
            .map_err(|e| format!("OTEL_TRACES_SAMPLER_ARG: {e}"))
    };
    Ok(match sampler.as_deref().map(str::trim) {
        None | Some("parentbased_always_on") => Sampling::ParentBased(1.0),
        Some("always_on") => Sampling::Root(1.0),
        Some("always_off") => Sampling::Root(0.0),
        Some("traceidratio") => Sampling::Root(ratio()?),
        Some("parentbased_always_off") => Sampling::ParentBased(0.0),
        Some("parentbased_traceidratio") => Sampling::ParentBased(ratio()?),
        Some(other) => {
            warnings.push(format!(
                "OTEL_TRACES_SAMPLER=`{other}` is not supported (always_on, always_off, \
                 traceidratio, parentbased_always_on, parentbased_always_off, \
                 parentbased_traceidratio): sampling every trace (parentbased_always_on)"
            ));
            Sampling::ParentBased(1.0)
        }
    })
}

/// The URL spans go to from a base endpoint.
fn full(base: &str, protocol: Protocol) -> Result<String, String> {
    check_url(base)?;
    Ok(match protocol {
        Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
        Protocol::Grpc => base.to_owned(),
    })
}

fn check_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(_)) => Ok(()),
        _ => Err(format!(
            "`{url}`: expected http://HOST:PORT or https://HOST:PORT"
        )),
    }
}

/// The running export: flush it before exit.
pub(crate) struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// Exports what is still queued (at most `within`), off the runtime's
    /// thread: the HTTP exporter runs on this runtime.
    pub(crate) async fn shutdown(self, within: Duration) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(within));
        let _ = tokio::time::timeout(within + Duration::from_secs(1), done).await;
    }
}

/// Starts the export (in the runtime whose context is entered: the HTTP
/// client runs on it); the tracer for the `tracing` layer. Sets the global
/// propagator to W3C trace context.
pub(crate) fn start(traces: &Traces) -> Result<(Export, opentelemetry_sdk::trace::Tracer), String> {
    use opentelemetry::trace::TracerProvider as _;
    let exporter = match traces.protocol {
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Hyper::new(traces.timeout))
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(&traces.endpoint)
            .with_timeout(traces.timeout)
            .build(),
        Protocol::Grpc => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(&traces.endpoint)
                .with_timeout(traces.timeout);
            if traces.endpoint.starts_with("https:") {
                let tls = tonic::transport::ClientTlsConfig::new().with_webpki_roots();
                builder = builder.with_tls_config(tls);
            }
            builder.build()
        }
    }
    .map_err(|e| format!("cannot start the OTLP exporter: {e}"))?;
    let held = Arc::new(AtomicUsize::new(0));
    let exporter = Counted {
        inner: exporter,
        held: held.clone(),
        failing: Arc::default(),
    };
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(traces.queue)
                .build(),
        )
        .build();
    let processor = Bounded {
        inner: batch,
        held,
        cap: traces.queue,
    };
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(traces.sampler.sampler())
        .with_resource(
            Resource::builder()
                .with_service_name(traces.service.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("idempotency-gateway");
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    opentelemetry::global::set_tracer_provider(provider.clone());
    EXPORTING.store(true, Ordering::Relaxed);
    Ok((Export { provider }, tracer))
}

/// Puts the drop counter's series at zero (once the metrics recorder is in).
pub(crate) fn register_metrics() {
    for reason in ["queue_full", "export_failed"] {
        dropped(reason, 0);
    }
}

fn dropped(reason: &'static str, n: usize) {
    metrics::counter!("gateway_trace_spans_dropped_total", "reason" => reason).increment(n as u64);
}

/// Whether spans are exported (the export started).
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether spans are exported: a request's span has a trace id.
pub(crate) fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Whether a client's `traceparent` is followed (`--accept-traceparent`).
static ACCEPTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Follows a client's `traceparent` (`--accept-traceparent`): a request's
/// span takes the client's context as its parent.
pub(crate) fn accept_traceparent(on: bool) {
    ACCEPTING.store(on, Ordering::Relaxed);
}

/// Makes `span` a child of the client's trace when `--accept-traceparent`
/// is on and the request carries one.
pub(crate) fn follow_client(span: &tracing::Span, headers: &http::HeaderMap) {
    if ACCEPTING.load(Ordering::Relaxed) && headers.contains_key("traceparent") {
        let _ = span.set_parent(tower_idempotency::trace::extract(headers));
    }
}

/// The trace id of `span` (its OpenTelemetry context), as 32 hex digits;
/// `None` when the span is not traced.
pub(crate) fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let id = cx.span().span_context().trace_id();
    (id != opentelemetry::trace::TraceId::INVALID).then(|| id.to_string())
}

/// The trace a queued delivery runs in: the current span's (the delivery's)
/// when spans are exported, else the one its ingest stored in the entry's
/// `traceparent` (`00-TRACE_ID-PARENT_ID-FLAGS`).
pub(crate) fn delivery_trace_id(headers: &http::HeaderMap) -> Option<String> {
    if exporting()
        && let Some(id) = trace_id(&tracing::Span::current())
    {
        return Some(id);
    }
    let value = headers.get("traceparent")?.to_str().ok()?;
    let mut parts = value.split('-');
    match (parts.next(), parts.next()) {
        (Some(version), Some(id)) if version.len() == 2 && id.len() == 32 => Some(id.to_owned()),
        _ => None,
    }
}

/// The batch processor behind a count of the spans it holds (queued or in
/// the batch being exported): past `cap` a span is dropped and counted
/// before it reaches the processor, which then never drops one silently.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    held: Arc<AtomicUsize>,
    cap: usize,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.held.fetch_add(1, Ordering::AcqRel) >= self.cap {
            self.held.fetch_sub(1, Ordering::AcqRel);
            dropped("queue_full", 1);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The exporter, counting the spans of a batch the collector did not take
/// as dropped, and releasing them from [`Bounded`]'s count.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    held: Arc<AtomicUsize>,
    /// The last export failed.
    failing: Arc<std::sync::atomic::AtomicBool>,
}

/// Releases `n` held spans when the export ends (or is dropped).
struct Release(Arc<AtomicUsize>, usize);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len();
        let release = Release(self.held.clone(), n);
        let export = self.inner.export(batch);
        let failing = self.failing.clone();
        async move {
            let done = export.await;
            // Logged when exports start failing and when they work again,
            // not once per batch.
            match &done {
                Err(e) => {
                    dropped("export_failed", n);
                    if !failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, spans = n, "the OTLP collector did not take a batch of spans; dropping spans until it does (gateway_trace_spans_dropped_total)");
                    }
                }
                Ok(()) => {
                    if failing.swap(false, Ordering::Relaxed) {
                        tracing::info!("the OTLP collector takes spans again");
                    }
                }
            }
            drop(release);
            done
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The OTLP/HTTP client: hyper on the runtime the export was started in
/// (the batch processor's thread waits for it), each call bounded by the
/// export timeout.
#[derive(Debug, Clone)]
struct Hyper {
    client: HttpsClient,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl Hyper {
    fn new(timeout: Duration) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        http.set_connect_timeout(Some(timeout.min(Duration::from_secs(5))));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            runtime: tokio::runtime::Handle::current(),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Hyper {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        let call = async move {
            let res = client.request(request.map(Full::new)).await?;
            let (parts, body) = res.into_parts();
            let body = Limited::new(body, MAX_ANSWER).collect().await?.to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(parts, body))
        };
        let task = self.runtime.spawn(async move {
            match tokio::time::timeout(timeout, call).await {
                Ok(done) => done,
                Err(_) => Err(format!("no answer within {timeout:?}").into()),
            }
        });
        task.await?
    }
}
