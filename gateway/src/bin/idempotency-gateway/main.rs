//! A standalone idempotency gateway: a reverse proxy that puts the whole
//! stack (normalize → key → dedup) in front of any HTTP(S) upstream, so that
//! an existing payment-callback handler or order API runs once per
//! notification without a line of its code changing.
//!
//! A thin program over the library's `proxy` module: `cli` (flags and
//! environment variables), `config` (the TOML file), `store`, `tls`,
//! `serve` (connections), `workers` (serving threads and their drain),
//! `spanned` (a config value's line), `admin` (metrics and health), `logging` (non-blocking logs,
//! text or JSON), `otel` (traces over OTLP), `access` (the access log line), `verify` (a
//! route's signature keys).
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

mod access;
mod ack;
mod admin;
mod admin_api;
mod admin_cli;
mod admin_dead;
mod cli;
mod config;
mod console;
mod dlq;
mod escape;
mod limit;
mod logging;
mod otel;
mod pace;
mod parse;
mod pause_cli;
mod pauses;
mod presets;
mod reconcile;
mod routes;
mod samples;
mod serve;
mod spanned;
mod store;
mod tls;
mod upstreams;
mod verify;
mod workers;

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

use config::Settings;
use idempotency_gateway::journal::{Journal, JournalOptions};
use idempotency_gateway::proxy::{CallLimit, Forward, Gateway, RouteOptions, Target};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use store::GatewayStore;
use tokio::sync::Semaphore;
use tower_idempotency::limit::{BodyBudget, BodyLimitsLayer};
use tower_idempotency::Preset;
use tower_idempotency::TaskTracker;
use tracing::{info, warn};

fn main() -> ExitCode {
    no_huge_pages();
    let args = match cli::Args::from_env() {
        Ok(cli::Parsed::Run(args)) => args,
        Ok(cli::Parsed::Printed) => return ExitCode::SUCCESS,
        Err(msg) => return usage_error(&msg),
    };
    if let Some(cmd) = &args.command {
        if let dlq::Command::Reconcile(a) = cmd {
            return match config::admin_only(&args) {
                Ok((listen, token)) => reconcile::run(a, token.as_ref(), &listen),
                Err(msg) => usage_error(&msg),
            };
        }
        let admin = match cmd {
            dlq::Command::Inspect(a) => Some(admin_cli::Call::Inspect(a)),
            dlq::Command::Forget(a) => Some(admin_cli::Call::Forget(a)),
            dlq::Command::Journal(a) => Some(admin_cli::Call::Journal(a)),
            dlq::Command::Dlq { .. } | dlq::Command::Reconcile(_) => None,
            dlq::Command::Pause(_) | dlq::Command::Resume(_) => None,
        };
        if let dlq::Command::Pause(_) | dlq::Command::Resume(_) = cmd {
            return match config::admin_only(&args) {
                Ok((listen, token)) => match pause_cli::run(cmd, token.as_ref(), &listen) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(msg) => {
                        eprintln!("gateway: {msg}");
                        ExitCode::FAILURE
                    }
                },
                Err(msg) => usage_error(&msg),
            };
        }
        if let Some(call) = admin {
            let (listen, token) = match config::admin_only(&args) {
                Ok(found) => found,
                Err(msg) => return usage_error(&msg),
            };
            return match admin_cli::run(call, token.as_ref(), &listen) {
                Ok(()) => ExitCode::SUCCESS,
                Err(msg) => {
                    eprintln!("gateway: {msg}");
                    ExitCode::FAILURE
                }
            };
        }
        let dlq::Command::Dlq { offline, action } = cmd else {
            return usage_error("not a dlq command");
        };
        if !offline {
            let (listen, token) = match config::admin_only(&args) {
                Ok(found) => found,
                Err(msg) => return usage_error(&msg),
            };
            if let Some(token) = token {
                return match dlq::run_admin(action, &token, &listen) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(msg) => {
                        eprintln!("gateway: {msg}");
                        ExitCode::FAILURE
                    }
                };
            }
            eprintln!(
                "gateway: no admin token (--admin-token-file): working on the queue directly \
                 (--data-dir, --queue); stop a gateway using the embedded queue first"
            );
        } else {
            eprintln!(
                "gateway: --offline: working on the queue directly (--data-dir, --queue); \
                 stop a gateway using the embedded queue first"
            );
        }
        let queue = match config::queue_only(&args) {
            Ok(queue) => queue,
            Err(msg) => return usage_error(&msg),
        };
        return match dlq::run(action, &queue) {
            Ok(()) => ExitCode::SUCCESS,
            Err(msg) => {
                eprintln!("gateway: {}", store::redact_text(&msg));
                ExitCode::FAILURE
            }
        };
    }
    let check = args.check_config;
    let settings = match config::settings(*args) {
        Ok(settings) => settings,
        Err(msg) => return usage_error(&msg),
    };
    if check {
        for warning in &settings.warnings {
            eprintln!("gateway: warning: {warning}");
        }
        return match check_files(&settings) {
            Ok(()) => {
                eprintln!("gateway: the configuration is valid");
                ExitCode::SUCCESS
            }
            Err(msg) => usage_error(&msg),
        };
    }
    // Signals, the store's connections, the queue's worker, metrics, the
    // OTLP export and the drain; requests are served on the `workers` threads.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    otel::accept_traceparent(settings.accept_traceparent);
    let logging = {
        let _in = rt.enter();
        logging::init(settings.log_format, settings.traces.as_ref())
    };
    let mut logging = match logging {
        Ok(logging) => logging,
        Err(msg) => {
            eprintln!("gateway: {msg}");
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
            eprintln!("gateway: {}", store::redact_text(&msg));
            ExitCode::FAILURE
        }
    }
}

fn usage_error(msg: &str) -> ExitCode {
    // A store or queue URL in the message keeps its password out.
    let msg = store::redact_text(msg);
    eprintln!("gateway: {msg}\n(idempotency-gateway --help lists the flags)");
    ExitCode::from(2)
}

/// What `--check-config` checks beyond parsing: the files it names.
fn check_files(settings: &Settings) -> Result<(), String> {
    for (cert, key) in settings.tls.iter().chain(&settings.admin_tls) {
        tls::Tls::load(cert, key)?;
    }
    for u in &settings.upstreams {
        u.forward(settings.upstream_timeout, true, false, None)
            .map_err(|e| format!("upstream `{}`: {e}", u.name))?;
    }
    forward(settings, None).map(drop)
}

/// Once at start, per channel route that does not verify the sender.
fn warn_unverified(settings: &Settings) {
    for (prefix, target, options) in &settings.routes {
        match target {
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

/// The presets the routes guard with: every built-in one on an `auto` route.
fn route_presets(routes: &[(String, Target, RouteOptions)]) -> Vec<&str> {
    let mut presets = Vec::new();
    for (_, target, _) in routes {
        match target {
            Target::Preset(p) => presets.push(p.name()),
            Target::Auto => presets.extend_from_slice(Preset::builtin_names()),
        }
    }
    presets.sort_unstable();
    presets.dedup();
    presets
}

/// A forwarder to the upstream; every one shares the cap on upstream calls
/// `calls` (none: a cap of its own, for `--check-config`).
fn forward(settings: &Settings, calls: Option<&CallLimit>) -> Result<Forward, String> {
    let mut builder = Forward::builder(settings.upstream.clone())
        .timeout(settings.upstream_timeout)
        .upstream_keepalive(settings.upstream_keepalive)
        .accept_traceparent(settings.accept_traceparent);
    if let Some(calls) = calls {
        builder = builder.call_limit(calls.clone());
    }
    if let Some(ca) = &settings.upstream_ca {
        let pem = std::fs::read(ca).map_err(|e| format!("cannot read {}: {e}", ca.display()))?;
        builder = builder
            .add_root_certificates_pem(&pem)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    Ok(builder.build())
}

/// The journal: in the SQL store's database when the store is one (or the
/// SQL `--backstop` behind a Redis store), else in `js.path` (the data
/// directory's redb file, created readable by its owner only).
async fn open_journal(
    store: &parse::StoreSpec,
    backstop: Option<&str>,
    js: &config::journal::JournalSettings,
) -> Result<Journal, String> {
    let retention = js.retention;
    let options = JournalOptions::new()
        .retention(retention)
        .max_size(js.max_size);
    let database = match store {
        parse::StoreSpec::Sql(url) => Some(url.as_str()),
        _ => backstop,
    };
    let journal = if let Some(url) = database {
        let opened = Journal::connect(url, options).await;
        let (journal, writer) = opened.map_err(|e| store::redact_text(&e.to_string()))?;
        tokio::spawn(writer);
        info!(
            table = "idempotency_journal",
            ?retention,
            "journal of notifications on, in the SQL database (shared by every instance)"
        );
        journal
    } else if let parse::StoreSpec::Redis(url) = store {
        let opened = Journal::connect_redis(url, options).await;
        let (journal, writer) = opened.map_err(|e| store::redact_text(&e.to_string()))?;
        tokio::spawn(writer);
        info!(
            ?retention,
            "journal of notifications on, in Redis (shared by every instance)"
        );
        journal
    } else {
        let path = &js.path;
        if let Some(dir) = path.parent() {
            ack::create_private_dir(dir)?;
        }
        let (journal, writer) = Journal::open(path, options).map_err(|e| e.to_string())?;
        tokio::spawn(writer);
        info!(path = %path.display(), ?retention, max_size = js.max_size, "journal of notifications on");
        journal
    };
    // At zero from the start, for `increase()` in alert rules.
    metrics::counter!("idempotency_journal_dropped_total").increment(0);
    for reason in ["retention", "size"] {
        metrics::counter!("idempotency_journal_pruned_total", "reason" => reason).increment(0);
    }
    Ok(journal)
}

async fn run(
    settings: Settings,
    dropped: tracing_appender::non_blocking::ErrorCounter,
) -> Result<(), String> {
    let mut signals = serve::Signals::new().map_err(|e| format!("cannot handle signals: {e}"))?;
    for warning in &settings.warnings {
        warn!("{warning}");
    }
    // SIGHUP reloads the certificate, or is logged: it never stops the
    // gateway (`systemctl reload` sends it).
    let tls = match &settings.tls {
        Some((cert, key)) => Some(tls::Tls::load(cert, key)?),
        None => None,
    };
    let admin_tls = match &settings.admin_tls {
        Some((cert, key)) => Some(tls::Tls::load(cert, key)?),
        None => None,
    };
    let reloaded = tls.iter().chain(&admin_tls).cloned().collect();
    tls::reload_on_sighup(reloaded).map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    let budgets = store::Budgets {
        max_memory: settings.max_memory as u64,
        local_max_memory: settings.local_max_memory as u64,
    };
    let store = store::connect(&settings.store, settings.backstop.as_deref(), &budgets).await?;
    let admin = settings.admin_token.clone().map(admin::Admin::new);
    let acked = settings
        .routes
        .iter()
        .any(|(_, _, o)| o.is_ack_then_deliver());
    ack::warn_unverified(&settings.routes);
    let memory = matches!(store, tower_idempotency::store::Either::Left(_));
    ack::warn_memory_store(&settings.queue, memory);
    let queue = settings.queue.open_for(acked, &store).await?;
    if let (Some(admin), Some(queue)) = (&admin, &queue) {
        admin.set_queue(queue.clone());
    }
    // Routes queue, and the worker delivers, sealed entries.
    let sealed = queue.clone().map(|q| settings.queue.seal(q)).transpose()?;
    // The worker's queue, by how it paces: one that must pace with the
    // other gateways on a queue that cannot is refused here.
    let delivering = (sealed.clone())
        .map(|q| {
            let (pacing, shown) = (settings.queue.pacing(), settings.queue.describe());
            ack::WorkerQueue::new(q, pacing, &shown)
        })
        .transpose()?;
    // `/readyz` says when the embedded queue cannot store notifications.
    let embedded = match (&queue, acked) {
        (Some(either::Either::Left(q)), true) => Some(q.clone()),
        _ => None,
    };
    let metrics = match settings.metrics_listen {
        Some(addr) => {
            let presets = route_presets(&settings.routes);
            let acked: Vec<&str> = (settings.routes.iter())
                .filter(|(_, _, o)| o.is_ack_then_deliver())
                .map(|(p, _, _)| p.as_str())
                .collect();
            let series = admin::Series {
                presets: &presets,
                acked: &acked,
            };
            let listening = admin::Listening {
                header_timeout: settings.header_timeout,
                tls: admin_tls,
            };
            let started = admin::start(
                addr,
                store.clone(),
                embedded,
                dropped,
                &series,
                admin.clone(),
                listening,
            );
            Some(started.await?)
        }
        None if admin.is_some() => {
            return Err(
                "--admin-token-file needs --metrics-listen (the admin API's listener)".into(),
            )
        }
        None => None,
    };
    if let Some(traces) = &settings.traces {
        if metrics.is_some() {
            otel::register_metrics();
        }
        info!(
            endpoint = %traces.endpoint,
            protocol = ?traces.protocol,
            service = %traces.service,
            sample_ratio = %traces.sampler.describe(),
            "traces exported over OTLP"
        );
    }
    // The paused routes, read before the first request and every half
    // second after.
    let prefixes = settings.routes.iter().map(|(p, _, _)| p.clone()).collect();
    let keeper = pauses::PauseKeeper::new(&store, memory, settings.data_dir.clone(), prefixes);
    if let Err(e) = keeper.refresh().await {
        warn!(error = %store::redact_text(&e), "cannot read the paused routes yet; none is held until they can be read");
    }
    keeper.spawn_poller();
    if let Some(admin) = &admin {
        let routes = (settings.routes.iter())
            .map(|(p, t, o)| admin_api::RouteInfo {
                prefix: p.clone(),
                preset: match t {
                    Target::Preset(preset) => preset.name().to_owned(),
                    Target::Auto => "auto".to_owned(),
                },
                acked: o.is_ack_then_deliver(),
            })
            .collect();
        admin.set_routes(keeper.clone(), routes, settings.upstream.to_string());
    }
    // One tracker for every gateway: the drain waits for all their work.
    let tasks = TaskTracker::new();
    // One cap for the upstream, across the serving threads and the queue's
    // deliveries (built once the metrics recorder is in, for its gauge).
    let calls = CallLimit::new(settings.max_upstream_calls).queue_wait(settings.queue_wait);
    // Each named upstream has a cap of its own.
    let named_calls: Vec<CallLimit> = (settings.upstreams.iter())
        .map(|u| u.calls(settings.max_upstream_calls, settings.queue_wait))
        .collect();
    upstreams::running(&settings.upstreams, &named_calls);
    // One budget of bodies being read, across the serving threads.
    let bodies = BodyLimitsLayer::new()
        .timeout(settings.body_timeout)
        .budget(BodyBudget::new(settings.max_buffered));
    // Each route's records in a memory store of its own (shared by every
    // serving thread), so that no route pushes another's records out.
    let stores = store::per_route(&settings.store, &settings.budgets).map(Arc::new);
    if let (Some(admin), Some(stores)) = (&admin, &stores) {
        admin.set_stores(stores.clone());
    }
    let gateway = || -> Result<Gateway<GatewayStore>, String> {
        let forward = forward(&settings, Some(&calls))?;
        let mut builder = Gateway::builder(forward, store.clone())
            .task_tracker(tasks.clone())
            .body_limits(bodies.clone());
        if let Some(stores) = &stores {
            let stores = stores.clone();
            builder = builder.stores(move |prefix, preset| stores(prefix, preset));
        }
        // One forwarder (its own pool) per named upstream, per gateway.
        let named = (settings.upstreams.iter().zip(&named_calls))
            .map(|(u, calls)| {
                let f = u.forward(
                    settings.upstream_timeout,
                    settings.upstream_keepalive,
                    settings.accept_traceparent,
                    Some(calls),
                )?;
                Ok((u.name.as_str(), f))
            })
            .collect::<Result<Vec<_>, String>>()?;
        for (prefix, target, options) in &settings.routes {
            let mut options = options.clone();
            let name = (settings.route_upstreams.iter())
                .find(|(p, _)| p == prefix)
                .map(|(_, n)| n.as_str());
            if let Some((_, f)) = name.and_then(|n| named.iter().find(|(m, _)| *m == n)) {
                options = options.upstream(f.clone());
            }
            builder = builder.route_with(prefix, target.clone(), options);
        }
        if let Some(queue) = &sealed {
            builder = builder.queue(queue.clone());
        }
        builder = builder.pauses(keeper.pauses().clone());
        // The journal reads each notification's body for its business ids.
        builder = builder.capture_requests(settings.journal.is_some());
        // The key, the route and the upstream's answer in each response:
        // read by the journal, and by the spans (the request span's
        // route, the library's key hash), which are off below INFO.
        let spans = tracing::level_filters::LevelFilter::current() >= tracing::Level::INFO;
        builder = builder.response_extensions(settings.journal.is_some() || spans);
        builder.build().map_err(|e| e.to_string())
    };
    // The queue's deliveries run here, through a gateway (and upstream
    // connections) of their own.
    let control = gateway()?;
    let bound = workers::bind(settings.listen, settings.workers)?;
    let local = bound.local;
    let journal = match &settings.journal {
        Some(js) => {
            let backstop = settings.backstop.as_deref();
            Some(open_journal(&settings.store, backstop, js).await?)
        }
        None => None,
    };
    if let (Some(handle), Some(journal)) = (&admin, &journal) {
        handle.set_journal(journal.clone());
    }
    let (stop_worker, worker_stopped) = tokio::sync::oneshot::channel();
    let worker = sealed.clone().zip(delivering).map(|(q, delivering)| {
        let journal = journal.clone();
        let lanes = pace::lanes(&settings.routes, &settings.paces);
        pauses::spawn_waker(keeper.pauses().clone(), q);
        let paused = keeper.pauses();
        (settings.queue).spawn_worker(
            delivering,
            &control,
            journal,
            &lanes,
            paused,
            worker_stopped,
        )
    });
    let journal_at_exit = journal.clone();
    let journal = journal.map(|j| access::Journaling::new(j, settings.journal_body));
    // Lives as long as the process; every serving thread reads it per
    // request, so no reference count is bumped (on a cache line the threads
    // would pass back and forth) for each one.
    let ratios: &'static access::Ratios = Box::leak(Box::new(access::Ratios::new(
        settings.ratio_window,
        journal,
        metrics.is_some(),
    )));
    tokio::spawn(ratios.keep_moving());
    let limits = serve::Limits {
        permits: Arc::new(Semaphore::new(settings.max_connections)),
        header_timeout: settings.header_timeout,
        tls: tls.clone(),
        ratios,
        h2_max_streams: settings.h2_max_streams,
    };
    let mut workers = workers::Workers::start(bound, gateway, &limits)?;
    warn_unverified(&settings);
    let routes: Vec<String> = control
        .routes()
        .map(|(p, what)| format!("{p}={what}"))
        .collect();
    info!(
        listen = %local,
        upstream = %settings.upstream,
        store = store::describe(&store),
        backstop = %settings.backstop.as_deref().map_or("none".into(), store::redact),
        routes = %routes.join(" "),
        tls = tls.is_some(),
        workers = settings.workers,
        "gateway started"
    );
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on {local}")
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write to stdout: {e}"))?;
    }
    let signal = signals.recv().await;
    let connections = workers.stop().await;
    info!(
        signal,
        connections, "shutting down: no new connections; finishing the requests in flight"
    );
    let grace = settings.drain_timeout;
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
    workers.exit().await;
    let _ = stop_worker.send(());
    if let Some(worker) = worker {
        // A delivery cut here is delivered again after its lease, and the
        // dedup layer keeps it from running twice.
        if tokio::time::timeout(settings.upstream_timeout, worker)
            .await
            .is_err()
        {
            warn!("deliveries still running; they resume at the next start");
        }
    }
    if let Some(task) = metrics {
        task.abort();
    }
    // What the last requests added to the journal is written before exit.
    if let Some(journal) = journal_at_exit {
        let _ = tokio::time::timeout(Duration::from_secs(5), journal.flush()).await;
    }
    Ok(())
}
