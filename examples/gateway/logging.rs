//! Logs to stderr through a non-blocking, lossy writer: a log collector
//! that stops reading never stops requests; lines it cannot take are
//! dropped and counted (`gateway_log_lines_dropped_total`).

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;

/// Lines kept in memory while stderr is slow, before new ones are dropped.
const BUFFERED_LINES: usize = 16_384;

/// Installs the subscriber; keep the guard until exit (it flushes).
pub fn init() -> (WorkerGuard, ErrorCounter) {
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(BUFFERED_LINES)
        .thread_name("gateway-log")
        .finish(std::io::stderr());
    let dropped = writer.error_counter();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(writer)
        .init();
    (guard, dropped)
}
