//! A standalone idempotency gateway: a reverse proxy that puts the whole
//! stack (normalize → key → dedup) in front of any HTTP(S) upstream, so that
//! an existing payment-callback handler or order API runs once per
//! notification without a line of its code changing.
//!
//! A thin program over the library's `proxy` module, read top-down: [`main`]
//! parses the flags, runs a subcommand ([`commands`]) or reads the
//! configuration ([`settings`]), opens the parts ([`start`]: the store, the
//! queue, the journal, the routes' gateways) and serves until a signal
//! ([`run`], on the listeners of [`serve`]); [`admin`] is the admin
//! listener: metrics, health, the admin API and the console. Each folder's
//! own doc says what it holds.
//!
//! ```text
//! cargo run --release -p idempotency-gateway -- --listen 0.0.0.0:8080 --upstream http://127.0.0.1:9000
//! cargo run --release -p idempotency-gateway -- --config /etc/idempotency-gateway.toml
//! cargo install --locked --path gateway         # from a clone (not on crates.io yet)
//! ```
//!
//! When it accepts connections it prints exactly one line, `listening on
//! IP:PORT`, to stdout; everything else (logs) goes to stderr. A bad flag or
//! config file exits with status 2; a failure at start (the port is taken,
//! Redis cannot be reached) with status 1; SIGTERM or SIGINT drains the
//! requests in flight and exits 0 (a second signal exits 1 at once).
//! `idempotency-gateway --help` lists the flags; the README is the first
//! screen, `docs/` has the whole story (`docs/reference.md`: every flag).

// Nothing here is a library: every item is the program's own.
#![warn(unreachable_pub)]

mod admin;
mod commands;
mod private;
mod redact;
mod serve;
mod settings;
mod start;

/// mimalloc: glibc's malloc spends a fifth of a guarded request's CPU
/// walking its bins once the store holds many records (measured with `perf`;
/// BENCHMARKS.md has the numbers).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc asks for transparent huge pages on its segments, and resident
/// memory then grows in 2 MiB steps that no budget counts; they are turned
/// off for the process, as glibc's malloc leaves them.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes no pointers; it only sets a flag.
    #[allow(unsafe_code)]
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

use idempotency_gateway::proxy::{Gateway, Target};
use serve::{accept, access, logging, otel, tls, workers};
use settings::cli;
use settings::config::{self, Settings};
use start::parts;
use start::store::{self, GatewayStore};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tower_idempotency::TaskTracker;
use tracing::{info, warn};
use tracing_appender::non_blocking::ErrorCounter;

fn main() -> ExitCode {
    no_huge_pages();
    let args = match cli::Args::from_env() {
        Ok(cli::Parsed::Run(args)) => args,
        Ok(cli::Parsed::Printed) => return ExitCode::SUCCESS,
        Err(msg) => return usage_error(&msg),
    };
    if let Some(cmd) = &args.command {
        return commands::run(cmd, &args);
    }
    let check = args.check_config;
    let settings = match config::settings(*args) {
        Ok(settings) => settings,
        Err(msg) => return usage_error(&msg),
    };
    if check {
        return check_config(&settings);
    }
    serve(settings)
}

/// `--check-config`: the settings parsed; the files they name are read.
fn check_config(settings: &Settings) -> ExitCode {
    for warning in &settings.warnings {
        eprintln!("idempotency-gateway: warning: {warning}");
    }
    match check_files(settings) {
        Ok(()) => {
            eprintln!("idempotency-gateway: the configuration is valid");
            ExitCode::SUCCESS
        }
        Err(msg) => usage_error(&msg),
    }
}

/// Serves until a signal: the logs and the trace export, then [`run`] on
/// the main runtime (signals, the store's connections, the queue's worker,
/// metrics, the OTLP export and the drain; requests are served on the
/// `workers` threads).
fn serve(settings: Settings) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idempotency-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    otel::accept_traceparent(settings.upstream.accept_traceparent);
    let logging = {
        let _in = rt.enter();
        logging::init(settings.log_format, settings.traces.as_ref())
    };
    let mut logging = match logging {
        Ok(logging) => logging,
        Err(msg) => {
            eprintln!("idempotency-gateway: {msg}");
            return ExitCode::FAILURE;
        }
    };
    let export = logging.export.take();
    let result = rt.block_on(async {
        let result = run(settings, logging.dropped.clone()).await;
        if let Some(export) = export {
            // What is still queued goes out before exit, if the collector takes it.
            export.shutdown(Duration::from_secs(5)).await;
        }
        result
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("idempotency-gateway: {}", redact::redact_text(&msg));
            ExitCode::FAILURE
        }
    }
}

fn usage_error(msg: &str) -> ExitCode {
    // A store or queue URL in the message keeps its password out.
    let msg = redact::redact_text(msg);
    eprintln!("idempotency-gateway: {msg}\n(idempotency-gateway --help lists the flags)");
    ExitCode::from(2)
}

/// What `--check-config` checks beyond parsing: the files it names.
fn check_files(settings: &Settings) -> Result<(), String> {
    for (cert, key) in settings.serve.tls.iter().chain(&settings.admin.tls) {
        tls::Tls::load(cert, key)?;
    }
    for u in &settings.upstream.named {
        u.forward(settings.upstream.timeout, true, false, None)
            .map_err(|e| format!("upstream `{}`: {e}", u.name))?;
    }
    parts::forward(settings, None).map(drop)
}

/// Once at start, per channel route that does not verify the sender.
fn warn_unverified(settings: &Settings) {
    for route in &settings.routes {
        let (prefix, options) = (&route.prefix, &route.options);
        match &route.target {
            Target::Auto => warn!(
                route = %prefix,
                preset = "auto",
                "channel route without verification: notifications nobody signed reach the \
                 upstream; an `auto` route cannot verify, give each channel a route with its \
                 preset and a `verify` table"
            ),
            Target::Preset(p) if !p.is_client_api() && !options.verifies() => warn!(
                route = %prefix,
                preset = p.name(),
                "channel route without verification: notifications nobody signed reach the \
                 upstream; give the route a `verify` table in the config file"
            ),
            Target::Preset(_) => {}
        }
    }
}

/// Opens the parts, starts the serving threads and the queue's worker,
/// and serves until SIGTERM or SIGINT; then drains (see [`drain`]).
async fn run(settings: Settings, dropped: ErrorCounter) -> Result<(), String> {
    let mut signals = accept::Signals::new().map_err(|e| format!("cannot handle signals: {e}"))?;
    for warning in &settings.warnings {
        warn!("{warning}");
    }
    let (tls, admin_tls) = certificates(&settings)?;
    let mut parts = parts::Parts::open(&settings, dropped, admin_tls).await?;
    // The queue's deliveries run here, through a gateway (and upstream
    // connections) of their own.
    let control = parts.gateway(&settings)?;
    let bound = workers::bind(settings.serve.listen, settings.serve.workers)?;
    let local = bound.local;
    let journal = match &settings.journal {
        Some(js) => {
            let backstop = settings.store.backstop.as_deref();
            Some(parts::open_journal(&settings.store.spec, backstop, js).await?)
        }
        None => None,
    };
    if let (Some(admin), Some(journal)) = (&parts.admin, &journal) {
        admin.set_journal(journal.clone());
    }
    let (stop_worker, worker_stopped) = tokio::sync::oneshot::channel();
    let worker = parts.spawn_worker(&settings, &control, journal.clone(), worker_stopped);
    let journaling = (journal.clone()).map(|j| access::Journaling::new(j, settings.journal_body));
    let ratios = access::Ratios::new(settings.ratio_window, journaling, parts.metrics.is_some());
    let limits = accept::Limits {
        permits: Arc::new(Semaphore::new(settings.serve.max_connections)),
        header_timeout: settings.serve.header_timeout,
        tls: tls.clone(),
        ratios: ratios.install()?,
        h2_max_streams: settings.serve.h2_max_streams,
    };
    let mut workers = workers::Workers::start(bound, || parts.gateway(&settings), &limits)?;
    warn_unverified(&settings);
    announce(&settings, &parts, &control, local, tls.is_some())?;
    let signal = signals.recv().await;
    let connections = workers.stop().await;
    info!(
        signal,
        connections, "shutting down: no new connections; finishing the requests in flight"
    );
    drain(&settings, &mut signals, &mut workers, &parts.tasks).await?;
    workers.exit().await;
    let _ = stop_worker.send(());
    if let Some(worker) = worker {
        // A delivery cut here is delivered again after its lease, and the
        // dedup layer keeps it from running twice.
        if tokio::time::timeout(settings.upstream.timeout, worker)
            .await
            .is_err()
        {
            warn!("deliveries still running; they resume at the next start");
        }
    }
    if let Some(task) = parts.metrics {
        task.abort();
    }
    // What the last requests added to the journal is written before exit.
    if let Some(journal) = journal {
        let _ = tokio::time::timeout(Duration::from_secs(5), journal.flush()).await;
    }
    Ok(())
}

/// The certificates of the listener and of the admin listener. SIGHUP
/// reloads them, or is logged: it never stops the gateway (`systemctl
/// reload` sends it).
fn certificates(settings: &Settings) -> Result<(Option<tls::Tls>, Option<tls::Tls>), String> {
    let load = |pair: &Option<(PathBuf, PathBuf)>| match pair {
        Some((cert, key)) => tls::Tls::load(cert, key).map(Some),
        None => Ok(None),
    };
    let (tls, admin_tls) = (load(&settings.serve.tls)?, load(&settings.admin.tls)?);
    let reloaded = tls.iter().chain(&admin_tls).cloned().collect();
    tls::reload_on_sighup(reloaded).map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    Ok((tls, admin_tls))
}

/// The start line in the logs, and `listening on IP:PORT` on stdout.
fn announce(
    settings: &Settings,
    parts: &parts::Parts,
    control: &Gateway<GatewayStore>,
    local: std::net::SocketAddr,
    tls: bool,
) -> Result<(), String> {
    let routes: Vec<String> = control
        .routes()
        .map(|(p, what)| format!("{p}={what}"))
        .collect();
    info!(
        listen = %local,
        upstream = %settings.upstream.url,
        store = store::describe(&parts.store),
        backstop = %settings.store.backstop.as_deref().map_or("none".into(), redact::redact),
        routes = %routes.join(" "),
        tls,
        workers = settings.serve.workers,
        "gateway started"
    );
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {local}")
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write to stdout: {e}"))
}

/// Waits for the requests in flight and the work they left (upstream calls
/// and records finishing in the background), at most `--drain-timeout`; a
/// second signal exits at once.
async fn drain(
    settings: &Settings,
    signals: &mut accept::Signals,
    workers: &mut workers::Workers,
    tasks: &TaskTracker,
) -> Result<(), String> {
    let grace = settings.serve.drain_timeout;
    let drained = async {
        workers.drained().await;
        // No request is in flight: nothing spawns on the tracker any more
        // but the work it runs.
        tasks.close();
        if !tasks.is_empty() {
            info!(
                tasks = tasks.len(),
                "connections closed; waiting for the upstream calls and records still in progress"
            );
        }
        tasks.wait().await;
    };
    tokio::select! {
        () = drained => info!("all requests finished"),
        () = tokio::time::sleep(grace) => {
            warn!(?grace, tasks = tasks.len(), "work still running after --drain-timeout; exiting anyway");
        }
        again = signals.recv() => {
            let busy = tasks.len();
            return Err(format!("{again} again: exiting without waiting for {busy} tasks"));
        }
    }
    Ok(())
}
