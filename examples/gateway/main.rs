//! A standalone idempotency gateway: a reverse proxy that puts the whole
//! stack (normalize → key → dedup) in front of any HTTP(S) upstream, so that
//! an existing payment-callback handler or order API runs once per
//! notification without a line of its code changing.
//!
//! A thin program over the library's `proxy` module: `cli` (flags and
//! environment variables), `config` (the TOML file), `store`, `tls`,
//! `serve` (connections and drain), `admin` (metrics and health),
//! `logging` (non-blocking logs), `access` (the access log line), `verify`
//! (a route's signature keys).
//!
//! ```text
//! cargo run --release --example gateway -- --listen 0.0.0.0:8080 --upstream http://127.0.0.1:9000
//! cargo run --release --example gateway -- --config /etc/idempotency-gateway.toml
//! cargo install --path . --example gateway
//! ```
//!
//! When it accepts connections it prints exactly one line, `listening on
//! IP:PORT`, to stdout; everything else (logs) goes to stderr. A bad flag or
//! config file exits with status 2; a failure at start (the port is taken,
//! Redis cannot be reached) with status 1; SIGTERM or SIGINT drains the
//! requests in flight and exits 0 (a second signal exits 1 at once).
//! `gateway --help` lists the flags; the README has the whole story.

mod access;
mod admin;
mod cli;
mod config;
mod logging;
mod parse;
mod serve;
mod store;
mod tls;
mod verify;

use config::Settings;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;
use store::GatewayStore;
use tower_idempotency::proxy::{Forward, Gateway};
use tracing::{info, warn};

fn main() -> ExitCode {
    let args = match cli::Args::from_env() {
        Ok(cli::Parsed::Run(args)) => args,
        Ok(cli::Parsed::Printed) => return ExitCode::SUCCESS,
        Err(msg) => return usage_error(&msg),
    };
    let check = args.check_config;
    let settings = match config::settings(*args) {
        Ok(settings) => settings,
        Err(msg) => return usage_error(&msg),
    };
    if check {
        return match check_files(&settings) {
            Ok(()) => {
                eprintln!("gateway: the configuration is valid");
                ExitCode::SUCCESS
            }
            Err(msg) => usage_error(&msg),
        };
    }
    let (_log_guard, dropped) = logging::init();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(run(settings, dropped));
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("gateway: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("gateway: {msg}\n(gateway --help lists the flags)");
    ExitCode::from(2)
}

/// What `--check-config` checks beyond parsing: the files it names.
fn check_files(settings: &Settings) -> Result<(), String> {
    if let Some((cert, key)) = &settings.tls {
        tls::Tls::load(cert, key)?;
    }
    forward(settings).map(drop)
}

fn forward(settings: &Settings) -> Result<Forward, String> {
    let mut builder =
        Forward::builder(settings.upstream.clone()).timeout(settings.upstream_timeout);
    if let Some(ca) = &settings.upstream_ca {
        let pem = std::fs::read(ca).map_err(|e| format!("cannot read {}: {e}", ca.display()))?;
        builder = builder
            .add_root_certificates_pem(&pem)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    Ok(builder.build())
}

async fn run(
    settings: Settings,
    dropped: tracing_appender::non_blocking::ErrorCounter,
) -> Result<(), String> {
    let mut signals = serve::Signals::new().map_err(|e| format!("cannot handle signals: {e}"))?;
    let tls = match &settings.tls {
        Some((cert, key)) => {
            let tls = tls::Tls::load(cert, key)?;
            tls.reload_on_sighup()
                .map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
            Some(tls)
        }
        None => None,
    };
    let store = GatewayStore::connect(&settings.store, settings.max_memory).await?;
    let metrics = match settings.metrics_listen {
        Some(addr) => Some(admin::start(addr, store.probe(), dropped).await?),
        None => None,
    };
    let mut builder = Gateway::builder(forward(&settings)?, store.clone());
    for (prefix, target, options) in &settings.routes {
        builder = builder.route_with(prefix, target.clone(), options.clone());
    }
    let gateway = builder.build().map_err(|e| e.to_string())?;
    let (listener, local) = serve::bind(settings.listen).await?;
    let routes: Vec<String> = gateway
        .routes()
        .map(|(p, what)| format!("{p}={what}"))
        .collect();
    info!(
        listen = %local,
        upstream = %settings.upstream,
        store = store.describe(),
        routes = %routes.join(" "),
        tls = tls.is_some(),
        "gateway started"
    );
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on {local}")
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write to stdout: {e}"))?;
    }
    let limits = serve::Limits {
        max_connections: settings.max_connections,
        header_timeout: settings.header_timeout,
    };
    let (graceful, signal) =
        serve::accept_until(listener, gateway, tls, &limits, signals.recv()).await;
    info!(
        signal,
        connections = graceful.count(),
        "shutting down: no new connections; finishing the requests in flight"
    );
    let grace = settings.wait + settings.upstream_timeout + Duration::from_secs(5);
    let deadline = tokio::time::Instant::now() + grace;
    let drained = async {
        graceful.shutdown().await;
        if store.busy() > 0 {
            info!(
                calls = store.busy(),
                "connections closed; waiting for calls whose caller hung up to write their records"
            );
        }
        while store.busy() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::select! {
        () = drained => info!("all requests finished"),
        () = tokio::time::sleep_until(deadline) => {
            warn!(?grace, busy = store.busy(), "requests still running after the grace period; exiting anyway");
        }
        again = signals.recv() => {
            let busy = store.busy();
            return Err(format!("{again} again: exiting without waiting for {busy} requests"));
        }
    }
    if let Some(task) = metrics {
        task.abort();
    }
    Ok(())
}
