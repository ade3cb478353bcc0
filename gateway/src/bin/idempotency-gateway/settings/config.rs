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

use crate::commands::client::AdminAt;
use crate::settings::cli::Args;
use crate::settings::parse::{self, StoreSpec};
use crate::settings::routes::{FileRoute, Global};
use crate::settings::spanned::{readable, At, Field, SizeValue};

/// How messages name the files of a TLS pair and of trusted CAs.
pub(crate) const CERT: &str = "certificate chain";
pub(crate) const KEY: &str = "private key";
pub(crate) const CA: &str = "CA certificate file";
use crate::start::ack::{self, QueueSettings};
use idempotency_gateway::proxy::{RouteOptions, RouteTable, Target, Upstream};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use toml::Spanned;
use tower_idempotency_queue::Pace;

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
}

/// Everything the gateway runs with.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) listen: SocketAddr,
    pub(crate) upstream: Upstream,
    pub(crate) store: StoreSpec,
    /// The SQL database behind the Redis store (`--backstop`).
    pub(crate) backstop: Option<String>,
    /// Prefix, target and the route's options (global values applied).
    pub(crate) routes: Vec<(String, Target, RouteOptions)>,
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// `--data-dir` (or its default): the paused routes are kept there with
    /// the memory store.
    pub(crate) data_dir: PathBuf,
    /// The metrics listener's certificate and key: it speaks HTTPS.
    pub(crate) admin_tls: Option<(PathBuf, PathBuf)>,
    pub(crate) upstream_timeout: Duration,
    pub(crate) max_memory: usize,
    /// The memory store's budget of each route's records (`max_memory`
    /// split, see `store::split`).
    pub(crate) budgets: Vec<crate::start::store::RouteBudget>,
    /// The Redis store's local tier budget.
    pub(crate) local_max_memory: usize,
    /// The longest drain on SIGTERM or SIGINT.
    pub(crate) drain_timeout: Duration,
    pub(crate) tls: Option<(PathBuf, PathBuf)>,
    pub(crate) upstream_ca: Option<PathBuf>,
    /// Whether connections to the upstream are kept (`--upstream-keepalive`).
    pub(crate) upstream_keepalive: bool,
    /// Whether a client's `traceparent` is followed (`--accept-traceparent`).
    pub(crate) accept_traceparent: bool,
    pub(crate) max_connections: usize,
    /// Serving threads.
    pub(crate) workers: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) body_timeout: Duration,
    /// The budget of request bodies being read.
    pub(crate) max_buffered: usize,
    pub(crate) h2_max_streams: u32,
    pub(crate) max_upstream_calls: usize,
    /// How long a guarded request waits for an upstream slot before it is shed.
    pub(crate) queue_wait: Duration,
    /// How far back the duplicate-ratio gauge looks.
    pub(crate) ratio_window: Duration,
    /// The journal's file, retention and size, when it is on.
    pub(crate) journal: Option<journal::JournalSettings>,
    /// With `journal_body`: the most body bytes a journal record keeps.
    pub(crate) journal_body: Option<usize>,
    /// The admin API's bearer token, when it is on.
    pub(crate) admin_token: Option<String>,
    /// The queue of the ack-then-deliver routes.
    pub(crate) queue: QueueSettings,
    /// How each route paces its queued deliveries, by prefix.
    pub(crate) paces: Vec<(String, Pace)>,
    /// Warnings to log once logging is on.
    pub(crate) warnings: Vec<String>,
    /// The named upstreams (`[[upstreams]]`).
    pub(crate) upstreams: Vec<crate::settings::upstreams::Named>,
    /// The routes with a named upstream: prefix, upstream name.
    pub(crate) route_upstreams: Vec<(String, String)>,
    /// The destinations of each route that delivers to several, by prefix.
    pub(crate) route_destinations: Vec<(String, Vec<crate::settings::routes::RouteDestination>)>,
    pub(crate) log_format: crate::serve::logging::LogFormat,
    /// Where and how traces are exported, when they are.
    pub(crate) traces: Option<crate::serve::otel::Traces>,
}

/// The memory store's budget when `--max-memory` is not given.
pub(crate) const DEFAULT_MAX_MEMORY: usize = 256 << 20;

/// The budget of request bodies being read when `--max-buffered` is not given.
pub(crate) const DEFAULT_MAX_BUFFERED: usize = 64 << 20;

/// The Redis store's local tier budget when `--local-max-memory` is not given.
pub(crate) const DEFAULT_LOCAL_MAX_MEMORY: usize = 64 << 20;

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
    let admin_token = at.file(
        args.admin_token_file.as_deref(),
        &file.admin_token_file,
        "admin_token_file",
        crate::admin::listener::read_token,
    )?;
    let admin_at = admin::settings(&args, &file, &at)?;
    admin::check(&admin_at, admin_token.is_some())?;
    let listen = args
        .listen
        .or(at.value(&file.listen, "listen", parse::addr)?);
    let upstream = args
        .upstream
        .or(at.value(&file.upstream, "upstream", parse::upstream)?);
    let store = args.store.or(at.value(&file.store, "store", parse::store)?);
    let backstop = args
        .backstop
        .or(at.value(&file.backstop, "backstop", parse::backstop)?);
    let global = Global {
        window: args
            .window
            .or(at.value(&file.window, "window", parse::positive_duration)?),
        lease: args.lease.or(at.value(&file.lease, "lease", parse::lease)?),
        wait: args.wait.or(at.value(&file.wait, "wait", parse::duration)?),
        max_run: args
            .max_run
            .or(at.value(&file.max_run, "max_run", parse::positive_duration)?),
        max_body: args.max_body.or(at.size(&file.max_body, "max_body")?),
        principal_header: args.principal_header.or(at.value(
            &file.principal_header,
            "principal_header",
            parse::header_name,
        )?),
        principal_cookie: args.principal_cookie.or(at.value(
            &file.principal_cookie,
            "principal_cookie",
            parse::cookie_name,
        )?),
        on_store_error: args
            .on_store_error
            .or(at.value(&file.on_store_error, "on_store_error", parse::policy)?)
            .unwrap_or_default(),
    };
    let mut routes = Vec::new();
    let mut own_memory = Vec::new();
    let mut seen = RouteTable::new();
    let mut warnings = Vec::new();
    let mut paces = Vec::new();
    let upstreams = crate::settings::upstreams::from_file(&file.upstreams, &at, &base)?;
    let mut route_upstreams = Vec::new();
    let mut route_destinations = Vec::new();
    if !args.route.is_empty() {
        if let Some(w) = crate::settings::routes::dropped(&file.route, &at)? {
            warnings.push(w);
        }
        for r in &args.route {
            seen.insert(&r.prefix, ())
                .map_err(|e| format!("bad value `{}` for `--route`: {e}", r.prefix))?;
            routes.push((
                r.prefix.clone(),
                r.target.clone(),
                global.options(&Global::NONE),
            ));
        }
    } else {
        let presets = crate::settings::presets::from_file(&file.preset, &at)?;
        let parsed =
            crate::settings::routes::from_file(&file.route, &global, &at, &base, &presets)?;
        let known: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
        for (prefix, name, span) in &parsed.upstreams {
            if !known.contains(&name.as_str()) {
                return Err(at.err(
                    span.clone(),
                    format!(
                        "route `{prefix}`: unknown upstream `{name}`; the file's [[upstreams]] are: {}",
                        if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                    ),
                ));
            }
            route_upstreams.push((prefix.clone(), name.clone()));
        }
        for (prefix, list) in &parsed.destinations {
            for d in list {
                if !known.contains(&d.upstream.as_str()) {
                    return Err(at.err(
                        d.span.clone(),
                        format!(
                            "route `{prefix}`: `deliver` names unknown upstream `{}`; the file's [[upstreams]] are: {}",
                            d.upstream,
                            if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                        ),
                    ));
                }
            }
        }
        route_destinations = parsed.destinations;
        warnings.extend(parsed.warnings);
        routes = parsed.routes;
        own_memory = parsed.own_memory;
        paces = parsed.paces;
    }
    if routes.is_empty() {
        routes.push(("/".to_owned(), Target::Auto, global.options(&Global::NONE)));
    }
    ack::flag_routes(&args.ack_then_deliver, &mut routes)?;
    let (tls_cert, tls_key) = (
        at.file(
            args.tls_cert.as_deref(),
            &file.tls_cert,
            "tls_cert",
            readable(CERT),
        )?,
        at.file(
            args.tls_key.as_deref(),
            &file.tls_key,
            "tls_key",
            readable(KEY),
        )?,
    );
    let tls = match (tls_cert, tls_key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("`--tls-cert` and `--tls-key` go together".into()),
    };
    let max_memory = args
        .max_memory
        .or(at.size(&file.max_memory, "max_memory")?)
        .unwrap_or(DEFAULT_MAX_MEMORY);
    let store = store.unwrap_or(StoreSpec::Memory);
    if backstop.is_some() && !matches!(store, StoreSpec::Redis(_) | StoreSpec::Cluster(_)) {
        return Err(
            "`--backstop` goes behind a Redis store: give `--store redis://HOST:PORT` \
                    or `--store redis+cluster://…` with it"
                .into(),
        );
    }
    let budgets = match store {
        StoreSpec::Memory => crate::start::store::split(max_memory, &routes, &own_memory)?,
        _ => Vec::new(),
    };
    let log_format = args
        .log_format
        .or(at.value(
            &file.log_format,
            "log_format",
            crate::serve::logging::format,
        )?)
        .unwrap_or_default();
    let given = crate::serve::otel::Given {
        endpoint: args
            .otlp_endpoint
            .or(file.otlp_endpoint.map(Spanned::into_inner)),
        ratio: args.trace_sample_ratio.or(at.checked(
            &file.trace_sample_ratio,
            "trace_sample_ratio",
            |r| crate::serve::otel::ratio(&r.to_string()),
        )?),
    };
    let traces = crate::serve::otel::settings(given, &mut warnings)?;
    Ok(Settings {
        listen: listen.ok_or("`--listen ADDR` is required")?,
        upstream: upstream.ok_or("`--upstream URL` is required")?,
        store,
        backstop,
        routes,
        metrics_listen: admin_at.listen,
        data_dir: (args.data_dir.clone().or(file.data_dir.clone()))
            .unwrap_or_else(|| PathBuf::from(crate::start::ack::DEFAULT_DATA_DIR)),
        admin_tls: admin_at.tls,
        upstream_timeout: args
            .upstream_timeout
            .or(at.value(
                &file.upstream_timeout,
                "upstream_timeout",
                parse::positive_duration,
            )?)
            .unwrap_or(Duration::from_secs(30)),
        max_memory,
        budgets,
        local_max_memory: args
            .local_max_memory
            .or(at.size_by(&file.local_max_memory, "local_max_memory", parse::size)?)
            .unwrap_or(DEFAULT_LOCAL_MAX_MEMORY),
        drain_timeout: args
            .drain_timeout
            .or(at.value(&file.drain_timeout, "drain_timeout", parse::duration)?)
            .unwrap_or(Duration::from_secs(30)),
        tls,
        upstream_ca: at.file(
            args.upstream_ca.as_deref(),
            &file.upstream_ca,
            "upstream_ca",
            readable(CA),
        )?,
        upstream_keepalive: args
            .upstream_keepalive
            .or(file.upstream_keepalive)
            .unwrap_or(true),
        accept_traceparent: args.accept_traceparent || file.accept_traceparent.unwrap_or(false),
        max_connections: args
            .max_connections
            .or(at.number(&file.max_connections, "max_connections", parse::count)?)
            .unwrap_or(10_000),
        workers: args
            .workers
            .or(at.number(&file.workers, "workers", parse::workers)?)
            .unwrap_or_else(parse::default_workers),
        header_timeout: args
            .header_timeout
            .or(at.value(
                &file.header_timeout,
                "header_timeout",
                parse::positive_duration,
            )?)
            .unwrap_or(Duration::from_secs(10)),
        body_timeout: args
            .body_timeout
            .or(at.value(&file.body_timeout, "body_timeout", parse::positive_duration)?)
            .unwrap_or(tower_idempotency::limit::DEFAULT_BODY_TIMEOUT),
        max_buffered: args
            .max_buffered
            .or(at.size(&file.max_buffered, "max_buffered")?)
            .unwrap_or(DEFAULT_MAX_BUFFERED),
        h2_max_streams: args
            .h2_max_streams
            .or(at.checked(&file.h2_max_streams, "h2_max_streams", |n| {
                parse::streams(&n.to_string())
            })?)
            .unwrap_or(64),
        max_upstream_calls: args
            .max_upstream_calls
            .or(at.number(&file.max_upstream_calls, "max_upstream_calls", parse::count)?)
            .unwrap_or(idempotency_gateway::proxy::DEFAULT_MAX_UPSTREAM_CALLS),
        queue_wait: args
            .queue_wait
            .or(at.value(&file.queue_wait, "queue_wait", parse::duration)?)
            .unwrap_or(idempotency_gateway::shed::DEFAULT_QUEUE_WAIT),
        ratio_window: args
            .ratio_window
            .or(at.value(&file.ratio_window, "ratio_window", parse::positive_duration)?)
            .unwrap_or(crate::serve::access::DEFAULT_WINDOW),
        journal,
        journal_body,
        admin_token,
        queue,
        paces,
        warnings,
        upstreams,
        route_upstreams,
        route_destinations,
        log_format,
        traces,
    })
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
        args.retry_backoff.or(at.value(
            &file.retry_backoff,
            "retry_backoff",
            parse::positive_duration,
        )?),
    );
    let reserve = args.data_dir_reserve.or(at.size_by(
        &file.data_dir_reserve,
        "data_dir_reserve",
        parse::size,
    )?);
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
