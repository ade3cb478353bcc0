//! A standalone idempotency gateway: a reverse proxy that puts the whole
//! stack (normalize → key → dedup) in front of any HTTP upstream, so that an
//! existing payment-callback handler or order API runs once per notification
//! without a line of its code changing.
//!
//! ```text
//! cargo run --release --example gateway -- --listen 0.0.0.0:8080 --upstream http://127.0.0.1:9000
//! cargo run --release --example gateway -- --listen 0.0.0.0:8080 --upstream http://127.0.0.1:9000 \
//!     --store redis://10.0.0.5:6379 --route /notify/wechat=wechatpay-v3 --route /notify/alipay=alipay \
//!     --route /api=idempotency-key --principal-header x-tenant-id --metrics-listen 127.0.0.1:9100
//! ```
//!
//! (Examples are built with every crate feature: the `redis` store and the
//! library's metrics and warnings are always there.)
//!
//! When it accepts connections it prints exactly one line, `listening on
//! IP:PORT`, to stdout; everything else (logs) goes to stderr.
//!
//! # Command line
//!
//! | flag | meaning | default |
//! |---|---|---|
//! | `--listen ADDR` | where to accept connections (`127.0.0.1:0` picks a free port) | required |
//! | `--upstream URL` | `http://HOST:PORT[/BASE]` of the service behind the gateway | required |
//! | `--store STORE` | `memory`, `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT...]` | `memory` |
//! | `--route PREFIX=PRESET` | repeatable; `PRESET` is a DESIGN §6 preset name (`wechatpay-v3`, `wechatpay-v2`, `alipay`, `stripe`, `paypal`, `adyen`, `standard-webhooks`, `idempotency-key`, `client-token`) or `auto` | `/=auto` |
//! | `--window DUR` | how long a success is replayed | the preset's: 25h channels, 24h `idempotency-key` |
//! | `--lease DUR` | the claim's lease, renewed every `lease/3` | `30s` |
//! | `--wait DUR` | how long a duplicate waits for the first copy | `4s` |
//! | `--max-body SIZE` | request body limit (413 past it) | `64KiB` channels, `1MiB` `idempotency-key` |
//! | `--on-store-error closed\|open` | store outage: retryable failure, or pass through unguarded | `closed` |
//! | `--principal-header NAME` | scope every key to this header (a tenant id set by an auth proxy) | none; `idempotency-key` hashes `Authorization` |
//! | `--metrics-listen ADDR` | Prometheus text at `http://ADDR/metrics` | off |
//! | `--upstream-timeout DUR` | per-request deadline for the upstream's whole answer | `30s` |
//!
//! `DUR` is a whole number with `ms`, `s`, `m`, `h` or `d` (`500ms`, `30s`,
//! `25h`); `SIZE` is bytes, or a whole number with `B`, `KiB`, `MiB` or `GiB`.
//! Flags take their value as the next argument or after `=`. A bad flag prints
//! a message on stderr and exits with status 2; a failure at start (the port
//! is taken, Redis cannot be reached) exits with status 1.
//!
//! # Routes
//!
//! Each request goes to the route with the **longest** matching prefix. A
//! prefix matches its own path and every path below it: `/notify` matches
//! `/notify` and `/notify/wechat`, not `/notifyx`; `/` matches everything. A
//! request that matches no route is forwarded untouched. The key's scope is
//! `idem:PRESET:PATH:PRINCIPAL`, so two paths never share a record.
//!
//! A `client-token` route also issues the one-time tokens its submits carry
//! in `Idempotency-Token`: `GET` or `POST PREFIX/idempotency-token` answers
//! `{"token":"…","expires_in":300}` from the gateway itself, scoped like the
//! route's keys (a hash of `Authorization`, or `--principal-header`).
//!
//! `auto` detects the sender of each request, in this order:
//!
//! | the request has | preset |
//! |---|---|
//! | header `Wechatpay-Signature` | `wechatpay-v3` |
//! | an XML body with `<transaction_id>` | `wechatpay-v2` |
//! | a form body with a `notify_id` field | `alipay` |
//! | header `Stripe-Signature` | `stripe` |
//! | header `PAYPAL-TRANSMISSION-ID` | `paypal` |
//! | a JSON object body with `notificationItems` | `adyen` |
//! | header `webhook-id` | `standard-webhooks` |
//! | header `Idempotency-Key` | `idempotency-key` |
//! | anything else | forwarded untouched, every time |
//!
//! To detect, `auto` buffers the body up to the largest body limit (413 past
//! it); the preset's own, smaller limit then applies. Every preset has one
//! prebuilt stack and all of them share one store.
//!
//! # Forwarding
//!
//! One pooled HTTP/1.1 client. The upstream gets the request's own bytes, its
//! path (under the upstream's base path) and query, `x-forwarded-for` with the
//! client's address appended, `Host` set to the upstream, and no hop-by-hop
//! headers (`Connection` and the headers it names, `Keep-Alive`, `Proxy-*`,
//! `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`; also `Expect`, since the
//! body is already read). An upstream that refuses or resets the connection
//! gets 502; one that does not answer in full within `--upstream-timeout` gets
//! 504. The normalize layer turns both into the channel's retryable failure
//! reply, and the dedup layer never caches them: the channel's next retry is
//! forwarded again.
//!
//! A request that is not guarded (a safe method such as GET, a path under no
//! route, or a request `auto` does not recognize) is forwarded every time. On
//! a route with a preset, a POST, PUT, PATCH or DELETE without the preset's
//! key gets 400 in the channel's failure form (DESIGN §3).
//!
//! **What no gateway can close**: an upstream that acted but answered too late
//! (past `--upstream-timeout`), or a gateway killed after forwarding, looks
//! like a failure: the claim is released (or its lease runs out) and the next
//! retry is forwarded again. Keep a unique index in the upstream's database
//! (for example on the channel's transaction id) as the backstop, and keep
//! `--upstream-timeout` above the upstream's slowest honest answer. The
//! channel's own timeout (5 s for WeChat Pay) need not bound it: copies that
//! arrive meanwhile wait for the first (`--wait`) or get a retryable answer.
//!
//! # Shutdown
//!
//! On SIGTERM or SIGINT the gateway stops accepting connections, lets the
//! requests in flight finish (and their records complete, including calls
//! whose caller hung up) and exits with status 0. A second signal exits at
//! once with status 1.
//!
//! # Metrics and logs
//!
//! With `--metrics-listen`, `GET /metrics` answers Prometheus text:
//!
//! - `idempotency_requests_total{preset,outcome}`: every outcome (`executed`,
//!   `replayed`, `waited`, `in_flight_rejected`, `mismatch`, `key_missing`,
//!   `rejected_bad_input`, `store_error`, `lease_lost`, ...), from the library
//!   (crate feature `metrics`);
//! - `idempotency_store_seconds{op}`: store latency histogram (same feature);
//! - `idempotency_duplicate_ratio{preset}`: duplicates (replayed, waited,
//!   in flight, mismatched) over guarded requests since the gateway started,
//!   computed by the gateway itself;
//! - `gateway_upstream_errors_total{kind}`: `connect`, `timeout`, `other`.
//!
//! For alerts use a windowed ratio, e.g. these rules:
//!
//! ```yaml
//! groups:
//!   - name: idempotency
//!     rules:
//!       - record: preset:idempotency_duplicate_ratio:rate5m
//!         expr: |
//!           sum by (preset) (rate(idempotency_requests_total{outcome=~"replayed|waited|in_flight_rejected|mismatch"}[5m]))
//!             /
//!           sum by (preset) (rate(idempotency_requests_total[5m]))
//!       - alert: IdempotencyDuplicateRatioHigh
//!         expr: preset:idempotency_duplicate_ratio:rate5m > 0.05
//!         for: 10m
//!         labels:
//!           severity: warning
//!         annotations:
//!           summary: "More than 5 % of {{ $labels.preset }} requests are duplicates"
//!           description: >-
//!             The sender retries a lot: the upstream answers slowly or with
//!             failures, or a client double-submits. Check upstream latency,
//!             gateway_upstream_errors_total and outcome="mismatch" (tampering).
//! ```
//!
//! Logs go to stderr through `tracing`, filtered by `RUST_LOG` (default
//! `info`; `RUST_LOG=gateway=debug,tower_idempotency=debug` for more). One
//! access line per request (target `gateway::access`) carries the preset,
//! outcome, status and time; keys are never logged.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tower::{Service, ServiceExt};
use tower_idempotency::channel::PRESET_NAMES;
use tower_idempotency::key::HeaderPrincipal;
use tower_idempotency::store::{
    Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoreError,
};
use tower_idempotency::token::IssueToken;
use tower_idempotency::{
    Fingerprint, Idempotency, IdempotencyLayer, OnStoreError, Outcome, Preset, ResponseBody,
};
use tracing::{debug, info, warn};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = match Config::parse(&args) {
        Ok(Some(config)) => config,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("gateway: {msg}\n(gateway --help lists the flags)");
            return ExitCode::from(2);
        }
    };
    init_tracing();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(run(config));
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("gateway: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

const USAGE: &str = "\
usage: gateway --listen ADDR --upstream URL [options]

  --listen ADDR             where to accept connections (127.0.0.1:0 picks a port)
  --upstream URL            http://HOST:PORT[/BASE] of the service behind the gateway
  --store STORE             memory (default) | redis://HOST:PORT
                            | redis+cluster://HOST:PORT[,HOST:PORT...]
  --route PREFIX=PRESET     repeatable; longest prefix wins; default /=auto
                            PRESET: auto, wechatpay-v3, wechatpay-v2, alipay, stripe,
                            paypal, adyen, standard-webhooks, idempotency-key,
                            client-token (GET PREFIX/idempotency-token issues tokens)
  --window DUR              how long a success is replayed (default: the preset's)
  --lease DUR               claim lease, renewed every lease/3 (default 30s)
  --wait DUR                how long a duplicate waits for the first (default 4s)
  --max-body SIZE           request body limit (default 64KiB, 1MiB for idempotency-key)
  --on-store-error POLICY   closed (default) | open
  --principal-header NAME   scope keys to this header's value (e.g. a tenant id)
  --metrics-listen ADDR     serve Prometheus text at http://ADDR/metrics
  --upstream-timeout DUR    deadline for the upstream's whole answer (default 30s)
  -h, --help                this text

  DUR: 500ms, 30s, 5m, 25h, 2d    SIZE: 65536, 64KiB, 1MiB
";

/// Where records live.
#[derive(Debug, Clone, PartialEq)]
enum StoreSpec {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
}

/// What a route does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    /// One preset, by its index in `PRESET_NAMES`.
    Preset(usize),
    /// Detect the preset per request.
    Auto,
}

/// The upstream: where requests go.
#[derive(Debug, Clone)]
struct Upstream {
    authority: String,
    /// Base path without a trailing `/` (empty for none).
    base: String,
    host: HeaderValue,
}

#[derive(Debug)]
struct Config {
    listen: SocketAddr,
    upstream: Upstream,
    store: StoreSpec,
    /// Prefix (without a trailing `/`, `""` for the root) and target, longest first.
    routes: Vec<(String, Target)>,
    window: Option<Duration>,
    lease: Option<Duration>,
    wait: Option<Duration>,
    max_body: Option<usize>,
    on_store_error: OnStoreError,
    principal_header: Option<HeaderName>,
    metrics_listen: Option<SocketAddr>,
    upstream_timeout: Duration,
}

impl Config {
    /// `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<Self>, String> {
        let mut listen = None;
        let mut upstream = None;
        let mut store = StoreSpec::Memory;
        let mut routes: Vec<(String, Target)> = Vec::new();
        let mut window = None;
        let mut lease = None;
        let mut wait = None;
        let mut max_body = None;
        let mut on_store_error = OnStoreError::FailClosed;
        let mut principal_header = None;
        let mut metrics_listen = None;
        let mut upstream_timeout = Duration::from_secs(30);

        let mut it = args.iter();
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                return Ok(None);
            }
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_owned())),
                _ => (arg.as_str(), None),
            };
            if !flag.starts_with("--") {
                return Err(format!("unexpected argument `{arg}`"));
            }
            let known = [
                "--listen",
                "--upstream",
                "--store",
                "--route",
                "--window",
                "--lease",
                "--wait",
                "--max-body",
                "--on-store-error",
                "--principal-header",
                "--metrics-listen",
                "--upstream-timeout",
            ];
            if !known.contains(&flag) {
                return Err(format!("unknown flag `{flag}`"));
            }
            let value = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("`{flag}` needs a value"))?,
            };
            let bad = |why: &str| format!("bad value `{value}` for `{flag}`: {why}");
            match flag {
                "--listen" => listen = Some(parse_addr(&value).map_err(|e| bad(&e))?),
                "--metrics-listen" => {
                    metrics_listen = Some(parse_addr(&value).map_err(|e| bad(&e))?)
                }
                "--upstream" => upstream = Some(parse_upstream(&value).map_err(|e| bad(&e))?),
                "--store" => store = parse_store(&value).map_err(|e| bad(&e))?,
                "--route" => {
                    let (prefix, target) = parse_route(&value).map_err(|e| bad(&e))?;
                    if routes.iter().any(|(p, _)| *p == prefix) {
                        return Err(bad("this prefix is routed twice"));
                    }
                    routes.push((prefix, target));
                }
                "--window" => window = Some(positive(parse_duration(&value)).map_err(|e| bad(&e))?),
                "--lease" => lease = Some(positive(parse_duration(&value)).map_err(|e| bad(&e))?),
                "--wait" => wait = Some(parse_duration(&value).map_err(|e| bad(&e))?),
                "--upstream-timeout" => {
                    upstream_timeout = positive(parse_duration(&value)).map_err(|e| bad(&e))?
                }
                "--max-body" => {
                    let size = parse_size(&value).map_err(|e| bad(&e))?;
                    if size == 0 {
                        return Err(bad("must be more than 0"));
                    }
                    max_body = Some(size);
                }
                "--on-store-error" => {
                    on_store_error = match value.as_str() {
                        "closed" => OnStoreError::FailClosed,
                        "open" => OnStoreError::FailOpen,
                        _ => return Err(bad("expected `closed` or `open`")),
                    }
                }
                "--principal-header" => {
                    principal_header = Some(
                        HeaderName::from_bytes(value.as_bytes())
                            .map_err(|_| bad("not a header name"))?,
                    )
                }
                _ => unreachable!("checked against the known flags"),
            }
        }
        let listen = listen.ok_or("`--listen ADDR` is required")?;
        let upstream = upstream.ok_or("`--upstream URL` is required")?;
        if routes.is_empty() {
            routes.push((String::new(), Target::Auto));
        }
        routes.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        Ok(Some(Self {
            listen,
            upstream,
            store,
            routes,
            window,
            lease,
            wait,
            max_body,
            on_store_error,
            principal_header,
            metrics_listen,
            upstream_timeout,
        }))
    }

    /// The route for `path`: the longest prefix that matches it, and the
    /// rest of the path after that prefix.
    fn route<'p>(routes: &[(String, Target)], path: &'p str) -> Option<(Target, &'p str)> {
        routes.iter().find_map(|(prefix, target)| {
            path.strip_prefix(prefix.as_str())
                .filter(|rest| rest.is_empty() || rest.starts_with('/'))
                .map(|rest| (*target, rest))
        })
    }
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| "expected IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080".to_owned())
}

fn parse_upstream(s: &str) -> Result<Upstream, String> {
    let uri: Uri = s
        .parse()
        .map_err(|_| "expected http://HOST:PORT[/BASE]".to_owned())?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err("https upstreams are not supported (no TLS here)".into()),
        _ => return Err("expected http://HOST:PORT[/BASE]".into()),
    }
    let authority = uri
        .authority()
        .ok_or("expected http://HOST:PORT[/BASE]")?
        .clone();
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".into());
    }
    if uri.query().is_some() {
        return Err("the upstream URL cannot have a query".into());
    }
    let base = uri.path().trim_end_matches('/').to_owned();
    let host = HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?;
    Ok(Upstream {
        authority: authority.to_string(),
        base,
        host,
    })
}

fn parse_store(s: &str) -> Result<StoreSpec, String> {
    fn host_port(s: &str) -> Result<(), String> {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("`{s}`: expected HOST:PORT"))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(format!("`{s}`: expected HOST:PORT"));
        }
        Ok(())
    }
    if s == "memory" {
        return Ok(StoreSpec::Memory);
    }
    if cfg!(not(feature = "redis")) && s.starts_with("redis") {
        return Err(
            "this gateway was built without the `redis` feature (build it with --all-features)"
                .into(),
        );
    }
    if let Some(nodes) = s.strip_prefix("redis+cluster://") {
        let nodes: Vec<String> = nodes
            .trim_end_matches('/')
            .split(',')
            .map(|n| n.trim().to_owned())
            .collect();
        for node in &nodes {
            host_port(node)?;
        }
        return Ok(StoreSpec::Cluster(
            nodes.iter().map(|n| format!("redis://{n}/")).collect(),
        ));
    }
    if let Some(rest) = s.strip_prefix("redis://") {
        let hp = rest.split('/').next().unwrap_or_default();
        host_port(hp.rsplit('@').next().unwrap_or(hp))?;
        return Ok(StoreSpec::Redis(s.to_owned()));
    }
    Err("expected memory, redis://HOST:PORT or redis+cluster://HOST:PORT[,HOST:PORT...]".into())
}

fn parse_route(s: &str) -> Result<(String, Target), String> {
    let (prefix, preset) = s
        .split_once('=')
        .ok_or("expected PREFIX=PRESET, e.g. /notify/wechat=wechatpay-v3")?;
    if !prefix.starts_with('/') {
        return Err("the prefix must start with `/`".into());
    }
    let target = if preset == "auto" {
        Target::Auto
    } else {
        let index = PRESET_NAMES
            .iter()
            .position(|n| *n == preset)
            .filter(|_| Preset::from_name(preset).is_some())
            .ok_or_else(|| {
                format!("unknown preset `{preset}`; expected auto or one of {PRESET_NAMES:?}")
            })?;
        Target::Preset(index)
    };
    Ok((prefix.trim_end_matches('/').to_owned(), target))
}

/// `500ms`, `30s`, `5m`, `25h`, `2d`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| "expected a whole number and a unit: 500ms, 30s, 5m, 25h, 2d".to_owned())?;
    let secs = |k: u64| n.checked_mul(k).map(Duration::from_secs);
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => secs(1),
        "m" => secs(60),
        "h" => secs(3600),
        "d" => secs(86_400),
        _ => return Err("expected a unit: ms, s, m, h or d (500ms, 30s, 25h)".into()),
    }
    .ok_or_else(|| "too long".to_owned())
}

fn positive(d: Result<Duration, String>) -> Result<Duration, String> {
    d.and_then(|d| {
        if d.is_zero() {
            Err("must be more than 0".into())
        } else {
            Ok(d)
        }
    })
}

/// `65536`, `512B`, `64KiB`, `1MiB`, `1GiB`.
fn parse_size(s: &str) -> Result<usize, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: usize = digits
        .parse()
        .map_err(|_| "expected bytes or a whole number with B, KiB, MiB or GiB".to_owned())?;
    let k = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err("expected a unit: B, KiB, MiB or GiB (e.g. 64KiB)".into()),
    };
    n.checked_mul(k).ok_or_else(|| "too large".to_owned())
}

// ---------------------------------------------------------------------------
// The store: one of the backends, and a count of who still holds it.
// ---------------------------------------------------------------------------

#[derive(Clone)]
enum Backend {
    Memory(MemoryStore),
    #[cfg(feature = "redis")]
    Redis(tower_idempotency::store::RedisStore),
    #[cfg(feature = "redis")]
    Cluster(tower_idempotency::store::RedisClusterStore),
}

/// The store every stack shares.
///
/// Each guarded request holds a clone until its record is completed or
/// released (also when its caller hung up and the call finishes in a spawned
/// task), so once the connections are closed, the clones still alive are the
/// records still being written: shutdown waits for them.
#[derive(Clone)]
struct GatewayStore {
    backend: Backend,
    live: Arc<()>,
}

macro_rules! on_backend {
    ($self:ident, $s:ident => $e:expr) => {
        match &$self.backend {
            Backend::Memory($s) => $e,
            #[cfg(feature = "redis")]
            Backend::Redis($s) => $e,
            #[cfg(feature = "redis")]
            Backend::Cluster($s) => $e,
        }
    };
}

impl GatewayStore {
    async fn connect(spec: &StoreSpec) -> Result<Self, String> {
        let backend = match spec {
            StoreSpec::Memory => Backend::Memory(MemoryStore::new()),
            #[cfg(feature = "redis")]
            StoreSpec::Redis(url) => Backend::Redis(
                tower_idempotency::store::RedisStore::standalone(url.as_str())
                    .await
                    .map_err(|e| format!("cannot reach Redis at {url}: {e}"))?,
            ),
            #[cfg(feature = "redis")]
            StoreSpec::Cluster(nodes) => Backend::Cluster(
                tower_idempotency::store::RedisStore::cluster(nodes.iter().map(String::as_str))
                    .await
                    .map_err(|e| format!("cannot reach the Redis Cluster at {nodes:?}: {e}"))?,
            ),
            #[cfg(not(feature = "redis"))]
            StoreSpec::Redis(_) | StoreSpec::Cluster(_) => return Err(
                "this gateway was built without the `redis` feature (build with --all-features)"
                    .into(),
            ),
        };
        Ok(Self {
            backend,
            live: Arc::new(()),
        })
    }

    fn describe(&self) -> &'static str {
        match self.backend {
            Backend::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
            #[cfg(feature = "redis")]
            Backend::Cluster(_) => "redis-cluster",
        }
    }

    /// Clones other than this one: requests still writing their records.
    fn busy(&self) -> usize {
        Arc::strong_count(&self.live) - 1
    }
}

impl Store for GatewayStore {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        on_backend!(self, s => s.claim(key, fingerprint, token, lease).await)
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, s => s.complete(key, token, record, window).await)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, s => s.renew(key, token, lease).await)
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        on_backend!(self, s => s.release(key, token).await)
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        on_backend!(self, s => s.put_token(key, ttl).await)
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        on_backend!(self, s => s.take_token(key, owner).await)
    }
}

// ---------------------------------------------------------------------------
// Forwarding
// ---------------------------------------------------------------------------

/// The body of upstream answers and of the gateway's own 502/504.
type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// The client's address, put into the request extensions per connection.
#[derive(Debug, Clone, Copy)]
struct ClientAddr(SocketAddr);

/// The innermost service: sends a buffered request to the upstream.
#[derive(Clone)]
struct Forward {
    client: Client<HttpConnector, Full<Bytes>>,
    upstream: Arc<Upstream>,
    timeout: Duration,
}

impl Forward {
    fn new(upstream: Upstream, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(5))));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self {
            client,
            upstream: Arc::new(upstream),
            timeout,
        }
    }

    async fn forward(self, req: Request<Full<Bytes>>) -> Response<UpstreamBody> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let (mut parts, body) = req.into_parts();
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let uri = match Uri::builder()
            .scheme("http")
            .authority(self.upstream.authority.as_str())
            .path_and_query(format!("{}{path_and_query}", self.upstream.base))
            .build()
        {
            Ok(uri) => uri,
            Err(e) => return own_response(StatusCode::BAD_REQUEST, format!("bad path: {e}\n")),
        };
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::EXPECT);
        parts.headers.remove(header::CONTENT_LENGTH);
        if let Some(ClientAddr(peer)) = parts.extensions.get::<ClientAddr>().copied() {
            append_forwarded_for(&mut parts.headers, peer);
        }
        parts
            .headers
            .insert(header::HOST, self.upstream.host.clone());
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        let req = Request::from_parts(parts, body);
        match tokio::time::timeout_at(deadline, self.client.request(req)).await {
            Ok(Ok(res)) => {
                let (mut parts, body) = res.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // Answer in the client's protocol, not the upstream's (an
                // HTTP/1.0 upstream must not turn the reply into HTTP/1.0).
                parts.version = Version::default();
                let body = Deadline {
                    body,
                    sleep: Box::pin(tokio::time::sleep_until(deadline)),
                };
                Response::from_parts(parts, body.boxed_unsync())
            }
            Ok(Err(e)) => {
                let kind = if e.is_connect() { "connect" } else { "other" };
                metrics::counter!("gateway_upstream_errors_total", "kind" => kind).increment(1);
                let error = error_chain(&e);
                warn!(upstream = %self.upstream.authority, %error, "upstream failed");
                own_response(
                    StatusCode::BAD_GATEWAY,
                    format!("upstream unavailable: {error}\n"),
                )
            }
            Err(_) => {
                metrics::counter!("gateway_upstream_errors_total", "kind" => "timeout")
                    .increment(1);
                warn!(
                    upstream = %self.upstream.authority,
                    timeout = ?self.timeout,
                    "upstream timed out"
                );
                own_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("upstream did not answer within {:?}\n", self.timeout),
                )
            }
        }
    }
}

impl Service<Request<Full<Bytes>>> for Forward {
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// An error and its sources, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn own_response(status: StatusCode, msg: String) -> Response<UpstreamBody> {
    let mut res = Response::new(
        Full::new(Bytes::from(msg))
            .map_err(|never: Infallible| match never {})
            .boxed_unsync(),
    );
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// Removes `Connection`, the headers it names and the other hop-by-hop headers.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}

/// Appends the client's IP to `x-forwarded-for` (one header, comma-separated).
fn append_forwarded_for(headers: &mut HeaderMap, peer: SocketAddr) {
    let mut list: Vec<String> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    list.push(peer.ip().to_string());
    if let Ok(v) = HeaderValue::from_str(&list.join(", ")) {
        headers.insert("x-forwarded-for", v);
    }
}

/// The upstream's body, failing once the request's deadline has passed.
struct Deadline<B> {
    body: B,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl<B> Body for Deadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err("upstream body timed out".into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

// ---------------------------------------------------------------------------
// The gateway service: routes, detects, dispatches.
// ---------------------------------------------------------------------------

type Stack = Idempotency<Forward, GatewayStore>;
type GatewayResponse = Response<ResponseBody<UpstreamBody>>;

/// Guarded requests and duplicates of one preset, for the ratio gauge.
#[derive(Default)]
struct Ratio {
    guarded: AtomicU64,
    duplicates: AtomicU64,
}

struct Shared {
    routes: Vec<(String, Target)>,
    /// One stack per preset, indexed like `PRESET_NAMES`.
    stacks: Vec<Option<Stack>>,
    ratios: Vec<Ratio>,
    forward: Forward,
    /// The largest body limit of all stacks (what `auto` buffers).
    auto_limit: usize,
    /// The index of `client-token` in `PRESET_NAMES`, and its token issuer.
    client_token: Option<usize>,
    issuer: IssueToken<GatewayStore>,
}

/// Under a `client-token` route, the path that issues tokens.
const TOKEN_PATH: &str = "/idempotency-token";

/// The service each connection gets.
#[derive(Clone)]
struct Gateway {
    shared: Arc<Shared>,
    peer: Option<SocketAddr>,
}

impl Gateway {
    fn new(config: &Config, store: &GatewayStore) -> Self {
        let forward = Forward::new(config.upstream.clone(), config.upstream_timeout);
        let mut auto_limit = 0;
        let stacks = PRESET_NAMES
            .iter()
            .map(|name| {
                let preset = Preset::from_name(name)?;
                let limit = config.max_body.unwrap_or_else(|| preset.max_body());
                auto_limit = auto_limit.max(limit);
                let mut layer = IdempotencyLayer::with_store(preset, store.clone())
                    .max_body(limit)
                    .on_store_error(config.on_store_error);
                if let Some(window) = config.window {
                    layer = layer.window(window);
                }
                if let Some(lease) = config.lease {
                    layer = layer.lease(lease);
                }
                if let Some(wait) = config.wait {
                    layer = layer.wait(wait);
                }
                if let Some(name) = &config.principal_header {
                    layer = layer.principal(HeaderPrincipal(name.clone()));
                }
                Some(tower::Layer::layer(&layer, forward.clone()))
            })
            .collect();
        let mut issuer = IssueToken::new(store.clone());
        if let Some(name) = &config.principal_header {
            issuer = issuer.principal(HeaderPrincipal(name.clone()));
        }
        Self {
            shared: Arc::new(Shared {
                routes: config.routes.clone(),
                stacks,
                ratios: PRESET_NAMES.iter().map(|_| Ratio::default()).collect(),
                forward,
                auto_limit,
                client_token: PRESET_NAMES.iter().position(|n| *n == "client-token"),
                issuer,
            }),
            peer: None,
        }
    }

    fn for_peer(&self, peer: SocketAddr) -> Self {
        Self {
            shared: self.shared.clone(),
            peer: Some(peer),
        }
    }
}

impl Service<Request<Incoming>> for Gateway {
    type Response = GatewayResponse;
    type Error = Infallible;
    type Future = BoxFuture<Result<GatewayResponse, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Every request gets a ready clone of its stack (`oneshot`) below.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Incoming>) -> Self::Future {
        if let Some(peer) = self.peer {
            req.extensions_mut().insert(ClientAddr(peer));
        }
        let shared = self.shared.clone();
        Box::pin(async move { Ok(shared.handle(req).await) })
    }
}

impl Shared {
    async fn handle(&self, req: Request<Incoming>) -> GatewayResponse {
        let started = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let (preset, res) = match Config::route(&self.routes, &path) {
            Some((Target::Preset(i), rest))
                if rest == TOKEN_PATH && Some(i) == self.client_token =>
            {
                (None, self.issue_token(req).await)
            }
            Some((Target::Preset(i), _)) => (Some(i), self.guarded(i, req).await),
            Some((Target::Auto, _)) => match buffer(req, self.auto_limit).await {
                Err(res) => (None, res),
                Ok(req) => match detect(req.headers(), req.body()) {
                    Some(i) if self.stacks[i].is_some() => {
                        (Some(i), self.guarded(i, req.map(Full::new)).await)
                    }
                    _ => (None, self.pass_through(req.map(Full::new)).await),
                },
            },
            None => match buffer(req, self.auto_limit).await {
                Err(res) => (None, res),
                Ok(req) => (None, self.pass_through(req.map(Full::new)).await),
            },
        };
        let outcome = res.extensions().get::<Outcome>().copied();
        if let (Some(i), Some(outcome)) = (preset, outcome) {
            let ratio = &self.ratios[i];
            let guarded = ratio.guarded.fetch_add(1, Ordering::Relaxed) + 1;
            let duplicates = if outcome.is_duplicate() {
                ratio.duplicates.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                ratio.duplicates.load(Ordering::Relaxed)
            };
            metrics::gauge!("idempotency_duplicate_ratio", "preset" => PRESET_NAMES[i])
                .set(duplicates as f64 / guarded as f64);
        }
        info!(
            target: "gateway::access",
            %method,
            path = %path,
            preset = preset.map_or("-", |i| PRESET_NAMES[i]),
            outcome = outcome.map_or("-", Outcome::as_str),
            status = res.status().as_u16(),
            ms = started.elapsed().as_millis() as u64,
        );
        res
    }

    async fn guarded<B>(&self, i: usize, req: Request<B>) -> GatewayResponse
    where
        B: Body + Send + 'static,
        B::Data: Send,
        Stack: Service<Request<B>, Response = GatewayResponse, Error = Infallible>,
        <Stack as Service<Request<B>>>::Future: Send,
    {
        let stack = self.stacks[i].clone().expect("routes name built presets");
        match stack.oneshot(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        }
    }

    /// A one-time token for a `client-token` route (`GET|POST PREFIX/idempotency-token`).
    async fn issue_token(&self, req: Request<Incoming>) -> GatewayResponse {
        if !matches!(*req.method(), Method::GET | Method::POST) {
            return plain(StatusCode::METHOD_NOT_ALLOWED, "use GET or POST\n");
        }
        let res = match self.issuer.clone().oneshot(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        };
        res.map(|body| {
            ResponseBody::stream(
                body.map_err(|never: Infallible| match never {})
                    .boxed_unsync(),
            )
        })
    }

    async fn pass_through(&self, req: Request<Full<Bytes>>) -> GatewayResponse {
        let res = self.forward.clone().forward(req).await;
        res.map(ResponseBody::stream)
    }
}

/// Reads the body whole, up to `limit` bytes (413 past it).
async fn buffer(req: Request<Incoming>, limit: usize) -> Result<Request<Bytes>, GatewayResponse> {
    let (parts, body) = req.into_parts();
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(Request::from_parts(parts, collected.to_bytes())),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large\n",
        )),
        Err(e) => {
            debug!(error = %e, "could not read a request body");
            Err(plain(
                StatusCode::BAD_REQUEST,
                "could not read the request body\n",
            ))
        }
    }
}

fn plain(status: StatusCode, msg: &'static str) -> GatewayResponse {
    let mut res = Response::new(ResponseBody::from(Bytes::from_static(msg.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// Which preset a request belongs to (the `auto` table in the module docs),
/// as an index into `PRESET_NAMES`.
fn detect(headers: &HeaderMap, body: &[u8]) -> Option<usize> {
    let index = |name: &str| PRESET_NAMES.iter().position(|n| *n == name);
    let trimmed = trim_start(body);
    if headers.contains_key("wechatpay-signature") {
        return index("wechatpay-v3");
    }
    if trimmed.first() == Some(&b'<') && contains(trimmed, b"<transaction_id>") {
        return index("wechatpay-v2");
    }
    if !matches!(trimmed.first(), Some(b'<' | b'{' | b'['))
        && form_urlencoded::parse(body).any(|(k, _)| k == "notify_id")
    {
        return index("alipay");
    }
    if headers.contains_key("stripe-signature") {
        return index("stripe");
    }
    if headers.contains_key("paypal-transmission-id") {
        return index("paypal");
    }
    if trimmed.first() == Some(&b'{')
        && serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
            .is_ok_and(|obj| obj.contains_key("notificationItems"))
    {
        return index("adyen");
    }
    if headers.contains_key("webhook-id") {
        return index("standard-webhooks");
    }
    if headers.contains_key("idempotency-key") {
        return index("idempotency-key");
    }
    None
}

fn trim_start(body: &[u8]) -> &[u8] {
    let body = body.strip_prefix("\u{feff}".as_bytes()).unwrap_or(body);
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(body.len());
    &body[start..]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

// ---------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------

/// SIGTERM and SIGINT (Ctrl-C elsewhere), registered before the gateway
/// announces itself so that no signal finds the default handler.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

async fn run(config: Config) -> Result<(), String> {
    let mut signals = Signals::new().map_err(|e| format!("cannot handle signals: {e}"))?;
    let metrics = match config.metrics_listen {
        Some(addr) => Some(start_metrics(addr).await?),
        None => None,
    };
    let store = GatewayStore::connect(&config.store).await?;
    let gateway = Gateway::new(&config, &store);
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let routes: Vec<String> = config
        .routes
        .iter()
        .map(|(prefix, target)| {
            let prefix = if prefix.is_empty() { "/" } else { prefix };
            match target {
                Target::Auto => format!("{prefix}=auto"),
                Target::Preset(i) => format!("{prefix}={}", PRESET_NAMES[*i]),
            }
        })
        .collect();
    info!(
        listen = %local,
        upstream = %config.upstream.authority,
        store = store.describe(),
        routes = %routes.join(" "),
        "gateway started"
    );
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on {local}")
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write to stdout: {e}"))?;
    }

    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let signal = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: back off a little.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let svc = TowerToHyperService::new(gateway.for_peer(peer));
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            signal = signals.recv() => break signal,
        }
    };
    drop(listener);
    info!(
        signal,
        connections = graceful.count(),
        "shutting down: no new connections; finishing the requests in flight"
    );

    // Requests in flight can wait for a duplicate's first copy, then for the
    // upstream: give them that long, and a little more.
    let grace = config.wait.unwrap_or(Duration::from_secs(4))
        + config.upstream_timeout
        + Duration::from_secs(5);
    let deadline = tokio::time::Instant::now() + grace;
    let drained = async {
        graceful.shutdown().await;
        drop(gateway);
        if store.busy() > 0 {
            info!(
                calls = store.busy(),
                "connections closed; waiting for calls whose caller hung up to write their records"
            );
        }
        // Calls whose caller hung up finish in spawned tasks; each holds a
        // store clone until its record is written.
        while store.busy() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::select! {
        () = drained => info!("all requests finished"),
        () = tokio::time::sleep_until(deadline) => {
            warn!(
                ?grace,
                busy = store.busy(),
                "requests still running after the grace period; exiting anyway"
            );
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

/// Installs the Prometheus recorder and serves `/metrics` on `addr`.
async fn start_metrics(addr: SocketAddr) -> Result<tokio::task::JoinHandle<()>, String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_seconds".into()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ],
        )
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    metrics::describe_counter!(
        "idempotency_requests_total",
        "Requests at the idempotency layers, by preset and outcome"
    );
    metrics::describe_histogram!(
        "idempotency_store_seconds",
        metrics::Unit::Seconds,
        "Latency of store calls"
    );
    metrics::describe_gauge!(
        "idempotency_duplicate_ratio",
        "Duplicates over guarded requests since the gateway started, by preset"
    );
    metrics::describe_counter!(
        "gateway_upstream_errors_total",
        "Upstream failures: connect, timeout, other"
    );
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the metrics address: {e}"))?;
    info!("metrics on http://{local}/metrics");
    let task = tokio::spawn(async move {
        let upkeep = handle.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                upkeep.run_upkeep();
            }
        });
        let builder = auto::Builder::new(TokioExecutor::new());
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let handle = handle.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let res = if req.method() == Method::GET && req.uri().path() == "/metrics" {
                    let mut res = Response::new(Full::new(Bytes::from(handle.render())));
                    res.headers_mut().insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; version=0.0.4"),
                    );
                    res
                } else {
                    let mut res = Response::new(Full::new(Bytes::from_static(b"not found\n")));
                    *res.status_mut() = StatusCode::NOT_FOUND;
                    res
                };
                std::future::ready(Ok::<_, Infallible>(res))
            });
            let conn = builder
                .serve_connection(TokioIo::new(stream), svc)
                .into_owned();
            tokio::spawn(async move {
                let _ = conn.await;
            });
        }
    });
    Ok(task)
}
