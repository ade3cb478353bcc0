//! The settings the gateway runs with: the config file (TOML), overridden
//! by flags and environment variables.
//!
//! ```toml
//! listen = "0.0.0.0:8443"
//! upstream = "http://127.0.0.1:9000"
//! store = "redis://10.0.0.5:6379"
//! [[route]]
//! prefix = "/notify/wechat"
//! preset = "wechatpay-v3"
//! window = "25h"   # optional per route: window, lease, wait, max_run, max_body, principal_header, principal_cookie, max_memory
//! max_in_flight = 20   # optional: the route's calls in flight to the upstream, or "auto" (auto_limit); queue_wait too
//! mode = "ack-then-deliver"   # or "synchronous" (the default)
//! deliver_concurrency = 20     # its deliveries' pace: deliver_rate, retry_schedule, breaker_failures, breaker_cooldown too
//! verify = { platform_keys = { "SERIAL" = "wechatpay_platform.pem" }, api_v3_key_file = "apiv3.key" }
//! ```
//!
//! A route's `verify` table (the channel's keys; files relative to the
//! config file) is read and checked here, so a bad key exits 2.
//!
//! Every top-level key is a flag's name with `_` for `-`. A route's own
//! values win over the global ones; flags win over the file's global
//! values, and `--route` flags replace the file's routes.

mod admin;
pub(crate) mod journal;
mod serve;
mod store;
mod upstream;

pub(crate) use admin::AdminSettings;
pub(crate) use serve::ServeSettings;
pub(crate) use store::StoreSettings;
pub(crate) use upstream::UpstreamSettings;

use crate::commands::client::AdminAt;
use crate::settings::cli::Args;
use crate::settings::parse::{self, StoreSpec};
use crate::settings::routes::{FileRoute, Global, RouteSettings};
use crate::settings::spanned::{readable, At, Field, SizeValue};
use crate::start::ack::{self, QueueSettings};
use idempotency_gateway::proxy::{RouteTable, Target};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;
use toml::Spanned;

/// How messages name the files of a TLS pair and of trusted CAs.
pub(crate) const CERT: &str = "certificate chain";
pub(crate) const KEY: &str = "private key";
pub(crate) const CA: &str = "CA certificate file";

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    listen: Field,
    upstream: Field,
    store: Field,
    backstop: Field,
    window: Field,
    lease: Field,
    wait: Field,
    max_body: Option<Spanned<SizeValue>>,
    on_store_error: Field,
    principal_header: Field,
    principal_cookie: Field,
    /// The admin listener (`metrics_listen` its older name).
    #[serde(alias = "metrics_listen")]
    admin_listen: Field,
    upstream_timeout: Field,
    max_memory: Option<Spanned<SizeValue>>,
    max_run: Field,
    local_max_memory: Option<Spanned<SizeValue>>,
    drain_timeout: Field,
    tls_cert: Option<Spanned<PathBuf>>,
    tls_key: Option<Spanned<PathBuf>>,
    upstream_ca: Option<Spanned<PathBuf>>,
    upstream_keepalive: Option<bool>,
    accept_traceparent: Option<bool>,
    max_connections: Option<Spanned<u64>>,
    workers: Option<Spanned<u64>>,
    header_timeout: Field,
    body_timeout: Field,
    max_buffered: Option<Spanned<SizeValue>>,
    h2_max_streams: Option<Spanned<u64>>,
    max_upstream_calls: Option<Spanned<u64>>,
    queue_wait: Field,
    ratio_window: Field,
    journal: Option<bool>,
    journal_retention: Field,
    journal_max_size: Option<Spanned<SizeValue>>,
    journal_body: Option<bool>,
    journal_body_max: Option<Spanned<SizeValue>>,
    admin_token_file: Option<Spanned<PathBuf>>,
    admin_tls_cert: Option<Spanned<PathBuf>>,
    admin_tls_key: Option<Spanned<PathBuf>>,
    queue: Field,
    data_dir: Option<PathBuf>,
    data_dir_reserve: Option<Spanned<SizeValue>>,
    max_attempts: Option<Spanned<u64>>,
    queue_replicas: Option<Spanned<u64>>,
    queue_secret_file: Option<Spanned<PathBuf>>,
    queue_accept_unsigned: Option<bool>,
    queue_unauthenticated: Option<bool>,
    retry_backoff: Field,
    log_format: Field,
    otlp_endpoint: Field,
    trace_sample_ratio: Option<Spanned<f64>>,
    #[serde(default)]
    route: Vec<Spanned<FileRoute>>,
    /// Presets built from parts, by name (`presets.rs`).
    #[serde(default)]
    preset: Vec<Spanned<crate::settings::presets::FilePreset>>,
    /// Named upstreams (`upstreams.rs`).
    #[serde(default)]
    upstreams: Vec<Spanned<crate::settings::upstreams::FileUpstream>>,
    /// Orders of objects by name (`orders.rs`).
    #[serde(default)]
    order: Vec<Spanned<crate::settings::orders::FileOrder>>,
}

/// Everything the gateway runs with, by concern.
#[derive(Debug)]
pub(crate) struct Settings {
    /// Where and how clients are served.
    pub(crate) serve: ServeSettings,
    /// The upstream and the calls to it.
    pub(crate) upstream: UpstreamSettings,
    /// Where records live.
    pub(crate) store: StoreSettings,
    /// Each route, in the order they were given.
    pub(crate) routes: Vec<RouteSettings>,
    /// The queue of the ack-then-deliver routes.
    pub(crate) queue: QueueSettings,
    /// `--data-dir` (or its default): the paused routes are kept there with
    /// the memory store.
    pub(crate) data_dir: PathBuf,
    /// The admin listener: metrics, health, the admin API.
    pub(crate) admin: AdminSettings,
    /// The journal's file, retention and size, when it is on.
    pub(crate) journal: Option<journal::JournalSettings>,
    /// With `journal_body`: the most body bytes a journal record keeps.
    pub(crate) journal_body: Option<usize>,
    /// How far back the duplicate-ratio gauge looks.
    pub(crate) ratio_window: Duration,
    pub(crate) log_format: crate::serve::logging::LogFormat,
    /// Where and how traces are exported, when they are.
    pub(crate) traces: Option<crate::serve::otel::Traces>,
    /// Warnings to log once logging is on.
    pub(crate) warnings: Vec<String>,
}

/// The settings from `args` and the file it names; `Err` is the message for
/// exit status 2.
pub(crate) fn settings(args: Args) -> Result<Settings, String> {
    let base = args
        .config
        .as_deref()
        .map_or(std::path::Path::new("."), crate::settings::verify::base)
        .to_owned();
    let (file, text, path) = load(&args)?;
    let at = At {
        path: &path,
        text: &text,
    };
    let queue = queue_settings(&args, &file, &at)?;
    queue.check_secret()?;
    let journal = journal::settings(&args, &file, &at)?;
    let journal_body = journal::body(&args, &file, &at, journal.is_some())?;
    let admin = admin::settings(&args, &file, &at)?;
    let listen = at.pick(args.listen, &file.listen, "listen", parse::addr)?;
    let upstream = at.pick(
        args.upstream.clone(),
        &file.upstream,
        "upstream",
        parse::upstream,
    )?;
    let store = store::settings(&args, &file, &at)?;
    let mut warnings = Vec::new();
    let named = crate::settings::upstreams::from_file(&file.upstreams, &at, &base)?;
    let routes = routes(&args, &file, &at, &base, &named, &store, &mut warnings)?;
    let tls = serve::tls(&args, &file, &at)?;
    let log_format = at
        .pick(
            args.log_format,
            &file.log_format,
            "log_format",
            crate::serve::logging::format,
        )?
        .unwrap_or_default();
    let given = crate::serve::otel::Given {
        endpoint: (args.otlp_endpoint.clone())
            .or(file.otlp_endpoint.as_ref().map(|v| v.get_ref().clone())),
        ratio: at.pick(
            args.trace_sample_ratio,
            &file.trace_sample_ratio,
            "trace_sample_ratio",
            crate::serve::otel::ratio,
        )?,
    };
    let traces = crate::serve::otel::settings(given, &mut warnings)?;
    let listen = listen.ok_or("`--listen ADDR` is required")?;
    let upstream = upstream.ok_or("`--upstream URL` is required")?;
    Ok(Settings {
        serve: serve::settings(&args, &file, &at, listen, tls)?,
        upstream: upstream::settings(&args, &file, &at, upstream, named)?,
        store,
        routes,
        queue,
        data_dir: (args.data_dir.clone().or(file.data_dir.clone()))
            .unwrap_or_else(|| PathBuf::from(crate::start::ack::DEFAULT_DATA_DIR)),
        admin,
        journal,
        journal_body,
        ratio_window: at
            .pick(
                args.ratio_window,
                &file.ratio_window,
                "ratio_window",
                parse::positive_duration,
            )?
            .unwrap_or(crate::serve::access::DEFAULT_WINDOW),
        log_format,
        traces,
        warnings,
    })
}

/// The values every route takes unless its own (or its preset's) say
/// otherwise.
fn global(args: &Args, file: &File, at: &At<'_>) -> Result<Global, String> {
    Ok(Global {
        window: at.pick(
            args.window,
            &file.window,
            "window",
            parse::positive_duration,
        )?,
        lease: at.pick(args.lease, &file.lease, "lease", parse::lease)?,
        wait: at.pick(args.wait, &file.wait, "wait", parse::duration)?,
        max_run: at.pick(
            args.max_run,
            &file.max_run,
            "max_run",
            parse::positive_duration,
        )?,
        max_body: at.pick(args.max_body, &file.max_body, "max_body", parse::body_size)?,
        principal_header: at.pick(
            args.principal_header.clone(),
            &file.principal_header,
            "principal_header",
            parse::header_name,
        )?,
        principal_cookie: at.pick(
            args.principal_cookie.clone(),
            &file.principal_cookie,
            "principal_cookie",
            parse::cookie_name,
        )?,
        on_store_error: at
            .pick(
                args.on_store_error,
                &file.on_store_error,
                "on_store_error",
                parse::policy,
            )?
            .unwrap_or_default(),
    })
}

/// The routes: the `--route` flags, else the file's `[[route]]` tables,
/// else `/=auto`; `--ack-then-deliver` applied, and each route's share of
/// a memory store.
fn routes(
    args: &Args,
    file: &File,
    at: &At<'_>,
    base: &std::path::Path,
    named: &[crate::settings::upstreams::Named],
    store: &StoreSettings,
    warnings: &mut Vec<String>,
) -> Result<Vec<RouteSettings>, String> {
    let global = global(args, file, at)?;
    let mut routes = Vec::new();
    let mut own_memory = Vec::new();
    if !args.route.is_empty() {
        if let Some(w) = crate::settings::routes::dropped(&file.route, at)? {
            warnings.push(w);
        }
        let mut seen = RouteTable::new();
        for r in &args.route {
            seen.insert(&r.prefix, ())
                .map_err(|e| format!("bad value `{}` for `--route`: {e}", r.prefix))?;
            routes.push(RouteSettings::new(
                r.prefix.clone(),
                r.target.clone(),
                global.options(&Global::NONE),
            ));
        }
    } else {
        let presets = crate::settings::presets::from_file(&file.preset, at)?;
        let orders = crate::settings::orders::from_file(&file.order, at)?;
        let parsed = crate::settings::routes::from_file(
            &file.route,
            &global,
            at,
            base,
            &presets,
            named,
            &orders,
        )?;
        warnings.extend(parsed.warnings);
        routes = parsed.routes;
        own_memory = parsed.own_memory;
    }
    if routes.is_empty() {
        routes.push(RouteSettings::new(
            "/".to_owned(),
            Target::Auto,
            global.options(&Global::NONE),
        ));
    }
    ack::flag_routes(&args.ack_then_deliver, &mut routes)?;
    if store.spec == StoreSpec::Memory {
        let budgets = crate::start::store::split(store.max_memory, &routes, &own_memory)?;
        for (route, budget) in routes.iter_mut().zip(budgets) {
            route.budget = Some(budget);
        }
    }
    Ok(routes)
}

/// The queue settings alone (for `idempotency-gateway dlq`).
pub(crate) fn queue_only(args: &Args) -> Result<QueueSettings, String> {
    let (file, text, path) = load(args)?;
    queue_settings(
        args,
        &file,
        &At {
            path: &path,
            text: &text,
        },
    )
}

/// What the admin commands (`inspect`, `forget`, `journal`) need of the
/// flags and the config file: the running gateway's `metrics_listen` (and
/// its certificate, to speak HTTPS to it) and `admin_token_file`.
pub(crate) fn admin_only(args: &Args) -> Result<(AdminAt, Option<PathBuf>), String> {
    let (file, text, path) = load(args)?;
    let at = At {
        path: &path,
        text: &text,
    };
    let listen = AdminAt {
        listen: admin::listen(args, &file, &at)?,
        cert: admin::cert(args, &file),
    };
    let token = args
        .admin_token_file
        .clone()
        .or(file.admin_token_file.as_ref().map(|v| v.get_ref().clone()));
    Ok((listen, token))
}

fn queue_settings(args: &Args, file: &File, at: &At<'_>) -> Result<QueueSettings, String> {
    let attempts = match (args.max_attempts, &file.max_attempts) {
        (Some(n), _) => Some(n),
        (None, Some(v)) => Some(
            u32::try_from(*v.get_ref())
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| at.err(v.span(), "`max_attempts`: expected 1 to 4294967295"))?,
        ),
        (None, None) => None,
    };
    let replicas = match (args.queue_replicas, &file.queue_replicas) {
        (Some(n), _) => n,
        (None, Some(v)) => u32::try_from(*v.get_ref())
            .map_err(|_| at.err(v.span(), "`queue_replicas`: expected 0 to 4294967295"))?,
        (None, None) => 0,
    };
    let settings = QueueSettings::new(
        args.queue
            .clone()
            .or(at.value(&file.queue, "queue", ack::queue_spec)?),
        args.data_dir.clone().or(file.data_dir.clone()),
        attempts,
        at.pick(
            args.retry_backoff,
            &file.retry_backoff,
            "retry_backoff",
            parse::positive_duration,
        )?,
    );
    let reserve = at.pick(
        args.data_dir_reserve,
        &file.data_dir_reserve,
        "data_dir_reserve",
        parse::size,
    )?;
    let sealing = (
        at.file(
            args.queue_secret_file.as_deref(),
            &file.queue_secret_file,
            "queue_secret_file",
            |path| {
                crate::private::check_secret_file(path, "queue secret file")?;
                readable("queue secret file")(path)
            },
        )?,
        args.queue_accept_unsigned || file.queue_accept_unsigned.unwrap_or(false),
        args.queue_unauthenticated || file.queue_unauthenticated.unwrap_or(false),
    );
    settings
        .replicas(replicas)
        .map(|s| s.reserve(reserve).sealing(sealing.0, sealing.1, sealing.2))
}

/// The config file `args` names (empty if none), its text and its path.
fn load(args: &Args) -> Result<(File, String, String), String> {
    Ok(match &args.config {
        None => (File::default(), String::new(), String::new()),
        Some(path) => {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the config file {shown}: {e}"))?;
            let at = At {
                path: &shown,
                text: &text,
            };
            let file: File =
                toml::from_str(&text).map_err(|e| at.err(e.span().unwrap_or(0..0), e.message()))?;
            (file, text, shown)
        }
    })
}
