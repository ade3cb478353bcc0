//! The command line: clap, every flag also from an `IDEMPOTENCY_GATEWAY_*`
//! environment variable; values parsed by the same functions as the config
//! file's.

use crate::settings::parse;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::Parser;
use http::HeaderName;
use idempotency_gateway::proxy::Upstream;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `ArgsOutcome` of [`Args::from_env`].
pub(crate) enum Parsed {
    /// Run with these flags.
    Run(Box<Args>),
    /// `--help` or `--version` was printed: exit 0.
    Printed,
}

/// A standalone idempotency gateway: a reverse proxy that runs each
/// payment notification or client submission once.
#[derive(Parser, Debug, Default)]
#[command(
    name = "idempotency-gateway",
    version,
    color = clap::ColorChoice::Never,
    override_usage = "idempotency-gateway --listen ADDR --upstream URL [--route PREFIX=PRESET]... [options]\n       \
                      idempotency-gateway --config FILE [options]\n       \
                      idempotency-gateway dlq list|replay ID|replay --all [--queue QUEUE|--data-dir DIR]\n       \
                      idempotency-gateway send URL --preset NAME [--secret FILE] [--copies N] [--field NAME=VALUE]...\n       \
                      idempotency-gateway test-keys DIR",
    after_help = "DUR: 500ms, 30s, 5m, 25h, 2d (at most a year)    SIZE: 65536, 64KiB, 1MiB\n\
                  Every flag can also be set with IDEMPOTENCY_GATEWAY_<FLAG> (e.g. \
                  IDEMPOTENCY_GATEWAY_UPSTREAM, IDEMPOTENCY_GATEWAY_ROUTE=/a=stripe,/b=alipay)."
)]
pub(crate) struct Args {
    /// TOML config file; flags override its values
    #[arg(long, value_name = "FILE", env = "IDEMPOTENCY_GATEWAY_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Validate the flags and the config file, then exit (0, or 2 with the reason)
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_CHECK_CONFIG")]
    pub(crate) check_config: bool,
    /// Where to accept connections (127.0.0.1:0 picks a port)
    #[arg(long, value_name = "ADDR", env = "IDEMPOTENCY_GATEWAY_LISTEN", value_parser = parse::addr)]
    pub(crate) listen: Option<SocketAddr>,
    /// http[s]://HOST:PORT[/BASE] of the service behind the gateway
    #[arg(long, value_name = "URL", env = "IDEMPOTENCY_GATEWAY_UPSTREAM", value_parser = parse::upstream)]
    pub(crate) upstream: Option<Upstream>,
    /// memory (default) | redis://HOST:PORT | redis+cluster://HOST:PORT[,HOST:PORT...] |
    /// postgres://… | mysql://… | sqlite:PATH
    #[arg(long, value_name = "STORE", env = "IDEMPOTENCY_GATEWAY_STORE", value_parser = parse::store)]
    pub(crate) store: Option<parse::StoreSpec>,
    /// postgres://… | mysql://… | sqlite:PATH behind a Redis --store: completed records
    /// are written through to it and a Redis miss (or data loss) is answered from it (default: none)
    #[arg(long, value_name = "URL", env = "IDEMPOTENCY_GATEWAY_BACKSTOP", value_parser = parse::backstop)]
    pub(crate) backstop: Option<String>,
    /// Repeatable; longest prefix wins; default /=auto. PRESET: auto, wechatpay-v3,
    /// wechatpay-v2, alipay, stripe, paypal, adyen, standard-webhooks, idempotency-key,
    /// client-token (GET PREFIX/idempotency-token issues tokens)
    #[arg(long, value_name = "PREFIX=PRESET", env = "IDEMPOTENCY_GATEWAY_ROUTE",
          value_delimiter = ',', value_parser = parse::route)]
    pub(crate) route: Vec<parse::RouteArg>,
    /// How long a success is replayed (default: the preset's)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_WINDOW", value_parser = parse::positive_duration)]
    pub(crate) window: Option<Duration>,
    /// Claim lease, renewed every lease/3; at least 100ms (default 30s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_LEASE", value_parser = parse::lease)]
    pub(crate) lease: Option<Duration>,
    /// How long a duplicate waits for the first (default 4s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_WAIT", value_parser = parse::duration)]
    pub(crate) wait: Option<Duration>,
    /// Request body limit (default 64KiB, 1MiB for idempotency-key)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_MAX_BODY", value_parser = parse::body_size)]
    pub(crate) max_body: Option<usize>,
    /// closed (default) | open
    #[arg(long, value_name = "POLICY", env = "IDEMPOTENCY_GATEWAY_ON_STORE_ERROR", value_parser = parse::policy)]
    pub(crate) on_store_error: Option<tower_idempotency::OnStoreError>,
    /// Scope client-API keys to this header's value (e.g. a tenant id)
    #[arg(long, value_name = "NAME", env = "IDEMPOTENCY_GATEWAY_PRINCIPAL_HEADER", value_parser = parse::header_name)]
    pub(crate) principal_header: Option<HeaderName>,
    /// Scope client-API keys to a hash of this cookie (a session id), else of Authorization
    #[arg(long, value_name = "NAME", env = "IDEMPOTENCY_GATEWAY_PRINCIPAL_COOKIE", value_parser = crate::settings::parse::cookie_name)]
    pub(crate) principal_cookie: Option<tower_idempotency::key::CookiePrincipal>,
    /// Serve /metrics, /healthz and /readyz (and the admin API and the console) at
    /// http://ADDR, with --header-timeout (at most 5s) and at most 1024 connections; the
    /// admin API off loopback needs --admin-tls-cert. --metrics-listen is its older name
    #[arg(
        long = "admin-listen",
        visible_alias = "metrics-listen",
        value_name = "ADDR",
        env = "IDEMPOTENCY_GATEWAY_ADMIN_LISTEN",
        value_parser = parse::addr
    )]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// PEM certificate chain: serve --admin-listen over HTTPS (reloaded on SIGHUP); the
    /// admin commands trust it to reach the admin API
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "IDEMPOTENCY_GATEWAY_ADMIN_TLS_CERT"
    )]
    pub(crate) admin_tls_cert: Option<PathBuf>,
    /// PEM private key of --admin-tls-cert
    #[arg(long, value_name = "FILE", env = "IDEMPOTENCY_GATEWAY_ADMIN_TLS_KEY")]
    pub(crate) admin_tls_key: Option<PathBuf>,
    /// Deadline for the upstream's answer (default 30s). On guarded routes it is the reply
    /// deadline: the caller gets the channel's failure reply, the upstream call goes on
    /// (up to --max-run) and its success is replayed to the next retry
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_UPSTREAM_TIMEOUT", value_parser = parse::positive_duration)]
    pub(crate) upstream_timeout: Option<Duration>,
    /// Memory store budget (default 256MiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_MAX_MEMORY", value_parser = parse::body_size)]
    pub(crate) max_memory: Option<usize>,
    /// Run limit of a guarded upstream call: past it the call is cancelled and the key
    /// freed for the next retry (default 5m)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_MAX_RUN", value_parser = parse::positive_duration)]
    pub(crate) max_run: Option<Duration>,
    /// Budget of the Redis store's local tier of completed records; 0 turns it off (default 64MiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_LOCAL_MAX_MEMORY", value_parser = parse::size)]
    pub(crate) local_max_memory: Option<usize>,
    /// On SIGTERM/SIGINT, the longest wait for the requests in flight and the upstream
    /// calls still running in the background (default 30s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_DRAIN_TIMEOUT", value_parser = parse::duration)]
    pub(crate) drain_timeout: Option<Duration>,
    /// PEM certificate chain: serve HTTPS (reloaded on SIGHUP)
    #[arg(
        long,
        value_name = "FILE",
        env = "IDEMPOTENCY_GATEWAY_TLS_CERT",
        requires = "tls_key"
    )]
    pub(crate) tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(
        long,
        value_name = "FILE",
        env = "IDEMPOTENCY_GATEWAY_TLS_KEY",
        requires = "tls_cert"
    )]
    pub(crate) tls_key: Option<PathBuf>,
    /// PEM CA certificates trusted for an https:// upstream, besides the Mozilla roots
    #[arg(long, value_name = "FILE", env = "IDEMPOTENCY_GATEWAY_UPSTREAM_CA")]
    pub(crate) upstream_ca: Option<PathBuf>,
    /// Keep connections to the upstream for the next call (default true); false opens one
    /// per call, for an upstream that may answer before reading a request's body and not
    /// drain it
    #[arg(long, value_name = "BOOL", env = "IDEMPOTENCY_GATEWAY_UPSTREAM_KEEPALIVE", action = clap::ArgAction::Set)]
    pub(crate) upstream_keepalive: Option<bool>,
    /// Follow a client's own W3C `traceparent` / `tracestate`: its request joins the
    /// client's trace. Off by default: payment channels send none, a client's are dropped
    /// and every request starts a trace of its own
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_ACCEPT_TRACEPARENT")]
    pub(crate) accept_traceparent: bool,
    /// Most client connections open at once; more wait to be accepted (default 10000)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_MAX_CONNECTIONS", value_parser = parse::count)]
    pub(crate) max_connections: Option<usize>,
    /// Serving threads, each with its own runtime, listener (SO_REUSEPORT) and upstream
    /// connections (default: one per core)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_WORKERS", value_parser = parse::workers)]
    pub(crate) workers: Option<usize>,
    /// Time a client has to send a request's headers; also bounds the TLS handshake and idle keep-alive connections (default 10s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_HEADER_TIMEOUT", value_parser = parse::positive_duration)]
    pub(crate) header_timeout: Option<Duration>,
    /// Time a client has to send a body that a guarded or auto route buffers, once its
    /// headers are in: past it 408 (or the channel's failure reply) and the connection closes (per stream over HTTP/2);
    /// streamed bodies have --upstream-timeout (default 10s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_BODY_TIMEOUT", value_parser = parse::positive_duration)]
    pub(crate) body_timeout: Option<Duration>,
    /// Budget of the request bodies being buffered, all connections together: a body that
    /// would take it past this gets the retryable failure at once (default 64MiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_MAX_BUFFERED", value_parser = parse::body_size)]
    pub(crate) max_buffered: Option<usize>,
    /// Most concurrent HTTP/2 streams per client connection (default 64)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_H2_MAX_STREAMS", value_parser = parse::streams)]
    pub(crate) h2_max_streams: Option<u32>,
    /// Most calls in flight to the upstream, those finishing in the background included;
    /// past it a request waits --queue-wait for a slot, then gets the retryable failure (default 1024)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_MAX_UPSTREAM_CALLS", value_parser = parse::count)]
    pub(crate) max_upstream_calls: Option<usize>,
    /// Longest wait for a free upstream slot (--max-upstream-calls, a route's max_in_flight)
    /// before a request is shed with the retryable failure; 0s sheds at once (default 50ms)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_QUEUE_WAIT", value_parser = parse::duration)]
    pub(crate) queue_wait: Option<Duration>,
    /// Keep a journal of notifications (one record per key) in --data-dir/journal.redb, or in
    /// the database of a Redis or SQL --store
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_JOURNAL")]
    pub(crate) journal: bool,
    /// Journal records not seen for this long are removed (default 7d)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_JOURNAL_RETENTION", value_parser = parse::positive_duration)]
    pub(crate) journal_retention: Option<Duration>,
    /// The most bytes the journal's records take in --data-dir/journal.redb: past it the
    /// records last seen longest ago are removed first (default 1GiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_JOURNAL_MAX_SIZE", value_parser = parse::body_size)]
    pub(crate) journal_max_size: Option<usize>,
    /// Keep each notification's raw body in its journal record (off by default: bodies
    /// hold personal data), at most --journal-body-max bytes of it
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_JOURNAL_BODY")]
    pub(crate) journal_body: bool,
    /// The most body bytes a journal record keeps; a longer body is truncated and marked
    /// `body_truncated` (default 64KiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_JOURNAL_BODY_MAX", value_parser = parse::body_size)]
    pub(crate) journal_body_max: Option<usize>,
    /// File holding the bearer token of the admin API on --admin-listen (off without it);
    /// also the token the admin commands send (inspect, forget, journal, reconcile, dlq, pause, resume)
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "IDEMPOTENCY_GATEWAY_ADMIN_TOKEN_FILE"
    )]
    pub(crate) admin_token_file: Option<PathBuf>,
    /// How far back the `idempotency_duplicate_ratio` gauge looks (default 5m)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_RATIO_WINDOW", value_parser = parse::positive_duration)]
    pub(crate) ratio_window: Option<Duration>,
    /// Repeatable: the route with this prefix answers once the notification is
    /// durably queued, and delivers it later (the route must name a channel preset)
    #[arg(long, value_name = "PREFIX", env = "IDEMPOTENCY_GATEWAY_ACK_THEN_DELIVER",
          value_delimiter = ',', value_parser = parse::prefix)]
    pub(crate) ack_then_deliver: Vec<String>,
    /// DIR | redis://HOST:PORT | amqp://USER:PASS@HOST:PORT/VHOST (or amqps://) | nats://HOST:PORT (JetStream): the queue of ack-then-deliver routes (default: the embedded queue in --data-dir)
    #[arg(long, global = true, value_name = "QUEUE", env = "IDEMPOTENCY_GATEWAY_QUEUE", value_parser = crate::start::ack::queue_spec)]
    pub(crate) queue: Option<crate::start::ack::QueueSpec>,
    /// Directory of the embedded queue (default ./gateway-data)
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        env = "IDEMPOTENCY_GATEWAY_DATA_DIR"
    )]
    pub(crate) data_dir: Option<PathBuf>,
    /// Free space kept on the disk of --data-dir: while less is free, new notifications
    /// get the channel's failure reply (the channel retries them) so that the queued ones
    /// can still be delivered; 0 turns it off (default 64MiB)
    #[arg(long, value_name = "SIZE", env = "IDEMPOTENCY_GATEWAY_DATA_DIR_RESERVE", value_parser = parse::size)]
    pub(crate) data_dir_reserve: Option<usize>,
    /// Failed deliveries of a queued notification before it is dead-lettered (default 25)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_MAX_ATTEMPTS", value_parser = crate::start::ack::attempts)]
    pub(crate) max_attempts: Option<u32>,
    /// Replicas that must hold a queued notification before it is acknowledged (Redis `WAIT`; Redis Streams queue only; default 0)
    #[arg(long, value_name = "N", env = "IDEMPOTENCY_GATEWAY_QUEUE_REPLICAS")]
    pub(crate) queue_replicas: Option<u32>,
    /// File holding the secret (at least 32 bytes) the gateways of a shared queue (Redis
    /// Streams, RabbitMQ, NATS) all read: every queued entry carries a MAC under it, and
    /// an entry whose MAC does not hold is dead-lettered as `unauthenticated`, never
    /// delivered. The embedded queue makes its own, --data-dir/queue.key
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "IDEMPOTENCY_GATEWAY_QUEUE_SECRET_FILE"
    )]
    pub(crate) queue_secret_file: Option<PathBuf>,
    /// Deliver queued entries that carry no MAC (queued by an earlier version) while an
    /// upgrade drains them; off by default (they are dead-lettered as `unauthenticated`)
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_QUEUE_ACCEPT_UNSIGNED")]
    pub(crate) queue_accept_unsigned: bool,
    /// Run a shared queue without --queue-secret-file: every writer of the queue is
    /// trusted (an entry anyone writes there is delivered to the ack-then-deliver routes)
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_QUEUE_UNAUTHENTICATED")]
    pub(crate) queue_unauthenticated: bool,
    /// Wait after the first failed delivery, doubled after each, up to 15m (default 1s)
    #[arg(long, value_name = "DUR", env = "IDEMPOTENCY_GATEWAY_RETRY_BACKOFF", value_parser = parse::positive_duration)]
    pub(crate) retry_backoff: Option<Duration>,
    /// Log lines as `text` (default) or `json`: one JSON object per line, a request's
    /// `request_id` and `trace_id` in each of its lines
    #[arg(long, value_name = "FORMAT", env = "IDEMPOTENCY_GATEWAY_LOG_FORMAT", value_parser = crate::serve::logging::format)]
    pub(crate) log_format: Option<crate::serve::logging::LogFormat>,
    /// Export traces over OTLP to this collector (http://HOST:4318 with
    /// OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, the default; http://HOST:4317 with grpc);
    /// overrides OTEL_EXPORTER_OTLP_ENDPOINT (default: no export)
    #[arg(long, value_name = "URL", env = "IDEMPOTENCY_GATEWAY_OTLP_ENDPOINT")]
    pub(crate) otlp_endpoint: Option<String>,
    /// Share of new traces exported, 0 to 1 (parent-based, as parentbased_traceidratio);
    /// overrides OTEL_TRACES_SAMPLER (default: every trace)
    #[arg(long, value_name = "RATIO", env = "IDEMPOTENCY_GATEWAY_TRACE_SAMPLE_RATIO", value_parser = crate::serve::otel::ratio)]
    pub(crate) trace_sample_ratio: Option<f64>,
    #[command(subcommand)]
    pub(crate) command: Option<crate::commands::dlq::Command>,
}

impl Args {
    /// The process's flags; `Err` is the message for a bad flag (exit 2).
    pub(crate) fn from_env() -> Result<Parsed, String> {
        Self::from_argv(std::env::args_os())
    }

    /// These flags (`argv[0]` the program); `Err` is the message for a bad
    /// flag (exit 2).
    pub(crate) fn from_argv<I, T>(argv: I) -> Result<Parsed, String>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        match Args::try_parse_from(argv) {
            Ok(args) => Ok(Parsed::Run(Box::new(args))),
            Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
                print!("{e}");
                Ok(Parsed::Printed)
            }
            Err(e) => Err(message(&e)),
        }
    }
}

/// clap's error in the gateway's words.
fn message(e: &clap::Error) -> String {
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let flag = arg.split(' ').next().unwrap_or_default();
    let rendered = e.render().to_string();
    let first = rendered
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ");
    match e.kind() {
        ErrorKind::UnknownArgument if flag.starts_with('-') => format!("unknown flag `{flag}`"),
        ErrorKind::UnknownArgument => format!("unexpected argument `{arg}`"),
        ErrorKind::InvalidSubcommand => match e.get(ContextKind::InvalidSubcommand) {
            Some(ContextValue::String(s)) => format!("unexpected argument `{s}`"),
            _ => first.to_owned(),
        },
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            "`dlq` needs `list`, `replay ID` or `replay --all`".to_owned()
        }
        ErrorKind::InvalidValue if rendered.contains("a value is required") => {
            format!("`{flag}` needs a value")
        }
        _ => first.to_owned(),
    }
}
