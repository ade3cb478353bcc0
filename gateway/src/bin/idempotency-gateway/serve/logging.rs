//! Logs to stderr through a non-blocking, lossy writer: a log collector
//! that stops reading never stops requests; lines it cannot take are
//! dropped and counted (`gateway_log_lines_dropped_total`).
//!
//! `--log-format text` (the default) or `json`: one JSON object per line,
//! the fields of the spans it is in flattened into it beside its own (every
//! line of a request carries the `request` span's `request_id`, `route` and
//! `trace_id`). With an OTLP endpoint (see `otel`), the spans are also
//! exported, whatever `RUST_LOG` lets through to the log.

use crate::serve::otel::{Export, Traces};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::filter::{FilterExt as _, LevelFilter, Targets};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::{Filter, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _, Registry};

/// Lines kept in memory while stderr is slow, before new ones are dropped.
const BUFFERED_LINES: usize = 16_384;

/// `--log-format`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `--log-format` and `log_format`: `text` or `json`.
pub(crate) fn format(s: &str) -> Result<LogFormat, String> {
    match s {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err(format!("`{s}` is not `text` or `json`")),
    }
}

/// What logging keeps until exit: the guard flushes the log, the export
/// (when on) the spans still queued.
pub(crate) struct Logging {
    pub(crate) _guard: WorkerGuard,
    pub(crate) dropped: ErrorCounter,
    pub(crate) export: Option<Export>,
}

/// The log's filter: `env` (`RUST_LOG`), less the library's spans (one per
/// step of every request), which are for the trace export, not the log:
/// kept out of it, a request whose spans nobody exports pays nothing for
/// them (a span no layer wants is never built).
///
/// Its most verbose level is `env`'s, so that `LevelFilter::current()`
/// tells what the log can take (without the hint, a filter function
/// leaves it at `TRACE` whatever `RUST_LOG` says): at `warn`, the `info!`
/// calls of every request stop at the level check, and the responses carry
/// none of the extensions kept only for the spans.
fn log_filter(env: EnvFilter) -> impl Filter<Registry> + Send + Sync + 'static {
    env.and(
        tracing_subscriber::filter::filter_fn(|m| {
            !m.is_span() || !m.target().starts_with("tower_idempotency")
        })
        // It only takes away: it lets through nothing `env` does not.
        .with_max_level_hint(LevelFilter::TRACE),
    )
}

/// Installs the subscriber, in the runtime the OTLP export runs on (its
/// context entered). `Err`: the exporter cannot start.
pub(crate) fn init(format: LogFormat, traces: Option<&Traces>) -> Result<Logging, String> {
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(BUFFERED_LINES)
        .thread_name("gateway-log")
        .finish(std::io::stderr());
    let dropped = writer.error_counter();
    let filter =
        log_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")));
    let log = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(writer)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .fmt_fields(JsonFields::new())
            .event_format(JsonLine)
            .with_writer(writer)
            .with_filter(filter)
            .boxed(),
    };
    let (export, spans) = match traces {
        Some(traces) => {
            let (export, tracer) = crate::serve::otel::start(traces)?;
            // The gateway's and the library's spans, whatever the log's
            // level; their events are log lines, not span events.
            let spans = Targets::new()
                .with_target("idempotency_gateway", LevelFilter::INFO)
                .with_target("tower_idempotency", LevelFilter::INFO);
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::filter_fn(move |m| {
                    m.is_span() && spans.would_enable(m.target(), m.level())
                }));
            (Some(export), Some(layer))
        }
        None => (None, None),
    };
    // Without an exporter there is no second layer at all: a `None` layer
    // would answer "always" for every callsite, and every span the log does
    // not want would still be built in the registry.
    match spans {
        Some(spans) => tracing_subscriber::registry().with(log).with(spans).init(),
        None => tracing_subscriber::registry().with(log).init(),
    }
    Ok(Logging {
        _guard: guard,
        dropped,
        export,
    })
}

/// One JSON object per line: `timestamp`, `level`, `target`, the fields of
/// the spans the event is in (outermost first, an inner one's field wins),
/// then the event's own (`message` among them), and `span`: the innermost
/// span's name.
struct JsonLine;

impl<S, N> FormatEvent<S, N> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = serde_json::Map::new();
        let mut innermost = None;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                innermost = Some(span.name());
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                if let Ok(serde_json::Value::Object(fields)) =
                    serde_json::from_str::<serde_json::Value>(fields)
                {
                    line.extend(fields);
                }
            }
        }
        event.record(&mut Fields(&mut line));
        let meta = event.metadata();
        let now = humantime::format_rfc3339_micros(std::time::SystemTime::now());
        line.insert("timestamp".into(), now.to_string().into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        if let Some(name) = innermost {
            line.insert("span".into(), name.into());
        }
        let text = serde_json::Value::Object(line).to_string();
        writeln!(writer, "{text}")
    }
}

/// An event's fields into a JSON object.
struct Fields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_filter_keeps_rust_log_s_level() {
        for (env, level) in [
            ("warn", LevelFilter::WARN),
            ("info", LevelFilter::INFO),
            ("warn,idempotency_gateway=debug", LevelFilter::DEBUG),
        ] {
            let filter = log_filter(EnvFilter::new(env));
            assert_eq!(filter.max_level_hint(), Some(level), "RUST_LOG={env}");
        }
    }
}
