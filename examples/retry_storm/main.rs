//! A WeChat Pay v3 retry storm against a naive "check status, then act"
//! handler, with and without the dedup stack in front of it.
//!
//! ```text
//! cargo run --release --example retry_storm                      # with IdempotencyLayer
//! cargo run --release --example retry_storm -- --baseline none   # the handler alone
//! cargo run --release --example retry_storm -- --baseline axum-idempotent          # the Rust peer
//! cargo run --release --example retry_storm -- --baseline axum-idempotent-nocookie # … as a channel sees it
//! cargo run --release --example retry_storm -- --failure-rate 0.2 --json
//! ```
//!
//! The upstream keeps an in-memory order table (one `UNPAID` order per
//! notification `id`, standing in for the decrypted `out_trade_no`). Its
//! handler reads the order's status, sleeps `--handler-ms` of simulated
//! work, and then, if the status it read was `UNPAID`, runs `doAfterPay`:
//! it counts one execution for the transaction and sets the order `PAID`.
//! The handler is racy on purpose: concurrent copies of one notification all
//! read `UNPAID` and all run `doAfterPay`, which is the bug this crate exists
//! to prevent. With `--failure-rate F` the handler answers 500 before touching
//! the table, with probability `F` (a deterministic xorshift PRNG seeded by the
//! request counter, so runs are repeatable).
//!
//! The upstream is served over a real loopback hyper server (HTTP/1 and
//! HTTP/2 on `127.0.0.1:0`), either as
//! `ServiceBuilder::new().layer(IdempotencyLayer::wechatpay_v3()).service(handler)`
//! (`--baseline dedup`, the default) or as the bare handler (`--baseline
//! none`), which answers WeChat's `{"code":"SUCCESS","message":"成功"}` itself.
//!
//! For comparison, `--baseline axum-idempotent` serves the same handler in
//! an axum `Router` behind the published Rust peer, [axum-idempotent] 0.6:
//! `IdempotentLayer` inside ruts' `SessionLayer` (an in-memory `MokaStore`)
//! inside tower-cookies' `CookieManagerLayer`, as its README prescribes.
//! axum-idempotent keeps its cache in the client's session, and caches nothing
//! for a request without one, so this mode gives it its best case: the storm
//! client sends one session cookie per transaction, shared by every copy and
//! retry of that notification. ruts accepts any well-formed id a client
//! presents, so the client makes one with `ruts::Id::default()` instead of
//! asking the server first. Its default key hashes the body, which WeChat
//! re-encrypts for every copy (a fresh `nonce` and `ciphertext`), so no two
//! copies would ever share a key; the mode therefore keys on method and path
//! only (`ignore_body(true)`, `ignore_all_headers()`), which within one
//! transaction's session names exactly that transaction. Window 25 h, as the
//! channel presets. `--baseline axum-idempotent-nocookie` is the same stack
//! with no cookie, which is what a payment channel sends: it never returns
//! cookies. (axum-idempotent does not coordinate copies in flight: a cached
//! response only helps copies that arrive after the first one completed.)
//!
//! [axum-idempotent]: https://crates.io/crates/axum-idempotent
//!
//! The storm client behaves like the channel: a pooled hyper-util client
//! sends each transaction's notification `--duplicates` times at once, every
//! copy with a fresh `resource.nonce` (real retries are re-encrypted and
//! re-signed). A copy answered with anything but a 2xx whose body is exactly
//! the success JSON (or not answered within WeChat's 5 s) is retried after
//! 20 ms, up to 15 attempts. At most `--concurrency` transactions are in
//! flight at a time.
//!
//! # Flags
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--transactions N` | 2000 | distinct notifications (orders) |
//! | `--duplicates K` | 7 | copies of each notification sent at the same instant |
//! | `--concurrency C` | 64 | transactions in flight at most |
//! | `--handler-ms MS` | 5 | simulated work between reading and writing the status (0: a bare yield) |
//! | `--failure-rate F` | 0 | probability in `[0, 1]` that one handler call answers 500 |
//! | `--baseline B` | dedup | `none` (the handler alone), `dedup` (behind `IdempotencyLayer::wechatpay_v3()`), `axum-idempotent` (behind axum-idempotent 0.6, one session cookie per transaction) or `axum-idempotent-nocookie` (the same, no cookie) |
//! | `--store S` | memory | `memory`, `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT...]` (`dedup` only; the axum-idempotent modes keep their sessions in memory) |
//! | `--scenario burst\|double-submit` | burst | a channel's storm (copies at once, WeChat Pay v3), or a client's double click (copies of one request with `Idempotency-Key` spread over 100 ms, route `/orders`) |
//! | `--instances N` | 1 | independent stacks (each on its own server) sharing the store; copies and retries spread over them |
//! | `--json` | off | also print one JSON object as the last line |
//!
//! # Output
//!
//! A table, and with `--json` a last line with the keys `requests`,
//! `transactions`, `handler_executions`, `duplicate_executions`, `lost`,
//! `throughput_rps`, `p50_ms`, `p99_ms`, `max_ms` and `peak_rss_mb`.
//!
//! - `requests`: HTTP requests sent, retries included.
//! - `handler_executions`: `doAfterPay` runs over all transactions.
//! - `duplicate_executions`: the sum over transactions of `executions - 1`
//!   where a transaction ran more than once. With the dedup stack it must be 0.
//! - `lost`: transactions that no copy ever saw acknowledged with success, or
//!   whose `doAfterPay` never ran. With the dedup stack it must be 0.
//! - latencies are per HTTP request; `peak_rss_mb` is `VmHWM` from
//!   `/proc/self/status` (0 where that file does not exist).
//!
//! Bad flags print a message to stderr and exit with status 2.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::ServiceBuilder;
use tower_idempotency::store::{MemoryStore, RedisStore, Store};
use tower_idempotency::{IdempotencyLayer, Preset};

use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, SessionLayer};
use tower_cookies::CookieManagerLayer;

/// WeChat Pay v3's success reply: the only answer that stops its retries.
const SUCCESS_BODY: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
/// WeChat Pay v3's failure reply.
const FAIL_BODY: &str = r#"{"code":"FAIL","message":"失败"}"#;
/// The route the notifications are posted to.
const NOTIFY_PATH: &str = "/notify/wechatpay/v3";
/// The client API route of `--scenario double-submit`.
const ORDERS_PATH: &str = "/orders";
/// Attempts per delivered copy (WeChat's schedule has 15 retries).
const MAX_ATTEMPTS: u32 = 15;
/// Pause between two attempts of one copy (WeChat's is 15 s and up).
const BACKOFF: Duration = Duration::from_millis(20);
/// How long the channel waits for an answer.
const CHANNEL_TIMEOUT: Duration = Duration::from_secs(5);
/// The channel presets' dedup window, given to axum-idempotent too.
const WINDOW_SECS: u64 = 25 * 3600;
/// The session cookie's name in the axum-idempotent modes.
const SESSION_COOKIE: &str = "session";

const USAGE: &str = "\
usage: retry_storm [--transactions N] [--duplicates K] [--concurrency C]
                   [--handler-ms MS] [--failure-rate F]
                   [--baseline none|dedup|axum-idempotent|axum-idempotent-nocookie]
                   [--store memory|redis://HOST:PORT|redis+cluster://HOST:PORT[,HOST:PORT...]]
                   [--instances N] [--scenario burst|double-submit] [--json]";

// ---------------------------------------------------------------- flags --

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Baseline {
    /// The handler alone.
    None,
    /// The handler behind `IdempotencyLayer::wechatpay_v3()`.
    Dedup,
    /// The handler in an axum `Router` behind axum-idempotent 0.6, the client
    /// sending one session cookie per transaction.
    AxumIdempotent,
    /// The same, the client sending no cookie (as a payment channel does).
    AxumIdempotentNoCookie,
}

impl Baseline {
    fn name(self) -> &'static str {
        match self {
            Baseline::None => "none",
            Baseline::Dedup => "dedup",
            Baseline::AxumIdempotent => "axum-idempotent",
            Baseline::AxumIdempotentNoCookie => "axum-idempotent-nocookie",
        }
    }

    fn is_axum_idempotent(self) -> bool {
        matches!(
            self,
            Baseline::AxumIdempotent | Baseline::AxumIdempotentNoCookie
        )
    }
}

/// What the client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// A channel's notification storm: copies at the same instant, each
    /// re-encrypted (WeChat Pay v3 preset).
    Burst,
    /// A client double-clicking "submit order": copies of one request
    /// spread over 100 ms, same bytes, `Idempotency-Key` header
    /// (idempotency-key preset, route `/orders`).
    DoubleSubmit,
}

/// Where the dedup records live.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StoreArg {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
}

impl StoreArg {
    fn parse(value: &str) -> Result<Self, String> {
        if value == "memory" {
            return Ok(Self::Memory);
        }
        if value.starts_with("redis://") || value.starts_with("rediss://") {
            return Ok(Self::Redis(value.to_owned()));
        }
        if let Some(nodes) = value.strip_prefix("redis+cluster://") {
            let nodes: Vec<String> = nodes
                .split(',')
                .filter(|n| !n.is_empty())
                .map(|n| format!("redis://{n}"))
                .collect();
            if !nodes.is_empty() {
                return Ok(Self::Cluster(nodes));
            }
        }
        Err(format!(
            "--store: `{value}` is not `memory`, `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT...]`"
        ))
    }
}

#[derive(Debug, Clone)]
struct Args {
    transactions: usize,
    duplicates: usize,
    concurrency: usize,
    handler_ms: u64,
    failure_rate: f64,
    baseline: Baseline,
    store: StoreArg,
    instances: usize,
    scenario: Scenario,
    json: bool,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            transactions: 2000,
            duplicates: 7,
            concurrency: 64,
            handler_ms: 5,
            failure_rate: 0.0,
            baseline: Baseline::Dedup,
            store: StoreArg::Memory,
            instances: 1,
            scenario: Scenario::Burst,
            json: false,
        }
    }
}

/// What the command line asked for.
enum Parsed {
    Run(Args),
    Help,
}

fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Parsed, String> {
    let mut args = Args::default();
    while let Some(arg) = argv.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        if flag == "--help" || flag == "-h" {
            return Ok(Parsed::Help);
        }
        if flag == "--json" {
            if inline.is_some() {
                return Err("--json takes no value".into());
            }
            args.json = true;
            continue;
        }
        let known = [
            "--transactions",
            "--duplicates",
            "--concurrency",
            "--handler-ms",
            "--failure-rate",
            "--baseline",
            "--store",
            "--instances",
            "--scenario",
        ];
        if !known.contains(&flag.as_str()) {
            return Err(format!("unknown flag `{flag}`"));
        }
        let value = match inline {
            Some(value) => value,
            None => argv.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        match flag.as_str() {
            "--transactions" => args.transactions = positive(&flag, &value)?,
            "--duplicates" => args.duplicates = positive(&flag, &value)?,
            "--concurrency" => {
                args.concurrency = positive(&flag, &value)?;
                if args.concurrency > Semaphore::MAX_PERMITS {
                    return Err(format!("{flag}: {value} is too large"));
                }
            }
            "--handler-ms" => {
                args.handler_ms = value.parse().map_err(|_| {
                    format!("{flag}: `{value}` is not a whole number of milliseconds")
                })?;
            }
            "--failure-rate" => {
                let rate: f64 = value
                    .parse()
                    .map_err(|_| format!("{flag}: `{value}` is not a number"))?;
                if !(0.0..=1.0).contains(&rate) {
                    return Err(format!("{flag}: {value} is not in [0, 1]"));
                }
                args.failure_rate = rate;
            }
            "--baseline" => {
                args.baseline = match value.as_str() {
                    "none" => Baseline::None,
                    "dedup" => Baseline::Dedup,
                    "axum-idempotent" => Baseline::AxumIdempotent,
                    "axum-idempotent-nocookie" => Baseline::AxumIdempotentNoCookie,
                    _ => {
                        return Err(format!(
                            "{flag}: `{value}` is not `none`, `dedup`, `axum-idempotent` or `axum-idempotent-nocookie`"
                        ))
                    }
                }
            }
            "--store" => args.store = StoreArg::parse(&value)?,
            "--instances" => args.instances = positive(&flag, &value)?,
            "--scenario" => {
                args.scenario = match value.as_str() {
                    "burst" => Scenario::Burst,
                    "double-submit" => Scenario::DoubleSubmit,
                    _ => {
                        return Err(format!(
                            "{flag}: `{value}` is neither `burst` nor `double-submit`"
                        ))
                    }
                }
            }
            _ => unreachable!("checked against `known` above"),
        }
    }
    if args.baseline.is_axum_idempotent() && args.store != StoreArg::Memory {
        return Err(format!(
            "--store: `{}` keeps its sessions in memory; --store applies to `dedup` only",
            args.baseline.name()
        ));
    }
    Ok(Parsed::Run(args))
}

fn positive(flag: &str, value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag}: `{value}` is not a positive whole number")),
    }
}

// ------------------------------------------------------------- upstream --

/// A deterministic PRNG step (xorshift64*), seeded through splitmix64 so
/// that consecutive seeds give unrelated outputs.
fn xorshift(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut x = (z ^ (z >> 31)) | 1;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A uniform number in `[0, 1)` for `seed`.
fn unit(seed: u64) -> f64 {
    (xorshift(seed) >> 11) as f64 / (1u64 << 53) as f64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Unpaid,
    Paid,
}

#[derive(Debug)]
struct Order {
    status: Status,
    /// How many times `doAfterPay` ran for this order.
    executions: u32,
}

/// The shared state of the upstream: the order table and a request counter.
#[derive(Debug)]
struct Upstream {
    orders: Mutex<HashMap<String, Order>>,
    calls: AtomicU64,
    handler_ms: u64,
    failure_rate: f64,
}

impl Upstream {
    fn new(ids: &[String], handler_ms: u64, failure_rate: f64) -> Self {
        let orders = ids
            .iter()
            .map(|id| {
                let order = Order {
                    status: Status::Unpaid,
                    executions: 0,
                };
                (id.clone(), order)
            })
            .collect();
        Self {
            orders: Mutex::new(orders),
            calls: AtomicU64::new(0),
            handler_ms,
            failure_rate,
        }
    }

    fn status(&self, id: &str) -> Option<Status> {
        let orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        orders.get(id).map(|order| order.status)
    }

    /// `doAfterPay`: credit points, send the coupon, ship… here: count it.
    fn do_after_pay(&self, id: &str) {
        let mut orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(order) = orders.get_mut(id) {
            order.executions += 1;
            order.status = Status::Paid;
        }
    }

    fn executions(&self, id: &str) -> u32 {
        let orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        orders.get(id).map_or(0, |order| order.executions)
    }

    /// The naive notification handler: read the status, work, then act if
    /// it was unpaid. Racy on purpose.
    async fn handle(&self, body: Bytes) -> Response<Full<Bytes>> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if self.failure_rate > 0.0 && unit(call) < self.failure_rate {
            return reply(StatusCode::INTERNAL_SERVER_ERROR, FAIL_BODY);
        }
        let notification: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(_) => return reply(StatusCode::BAD_REQUEST, FAIL_BODY),
        };
        let Some(id) = notification.get("id").and_then(|id| id.as_str()) else {
            return reply(StatusCode::BAD_REQUEST, FAIL_BODY);
        };
        let Some(status) = self.status(id) else {
            return reply(StatusCode::NOT_FOUND, FAIL_BODY);
        };
        if self.handler_ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.handler_ms)).await;
        } else {
            // Keep the read-then-write window open even without work.
            tokio::task::yield_now().await;
        }
        if status == Status::Unpaid {
            self.do_after_pay(id);
        }
        reply(StatusCode::OK, SUCCESS_BODY)
    }
}

fn reply(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    res
}

/// The upstream handler as a tower service over any request body (hyper's
/// `Incoming` when alone, the key layer's buffered body behind the stack).
#[derive(Debug, Clone)]
struct Handler(Arc<Upstream>);

impl<B> tower::Service<Request<B>> for Handler
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let upstream = self.0.clone();
        Box::pin(async move {
            let body = match req.into_body().collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, FAIL_BODY)),
            };
            Ok(upstream.handle(body).await)
        })
    }
}

/// Serves `svc` on 127.0.0.1:0 (HTTP/1 and HTTP/2) and returns the address.
async fn serve<S, B>(svc: S) -> std::io::Result<SocketAddr>
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    eprintln!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let svc = hyper_util::service::TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

// --------------------------------------------------------------- client --

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The notification id of transaction `i`, shaped like WeChat's UUIDs.
fn notification_id(run: u64, i: usize) -> String {
    format!(
        "{:08x}-{:04x}-5eec-ab1e-{:012x}",
        run as u32,
        (run >> 32) as u16,
        i
    )
}

/// One delivery of the notification `id`: same business fields, a fresh
/// nonce and ciphertext every time, as WeChat re-encrypts each retry.
/// (`id` is hex and dashes, so it needs no JSON escaping.)
fn notification(id: &str, nonce: u64) -> Bytes {
    let ciphertext = format!("{:016x}{:016x}", xorshift(nonce), xorshift(!nonce));
    let nonce = format!("{:012x}", nonce & 0xFFFF_FFFF_FFFF);
    Bytes::from(format!(
        concat!(
            r#"{{"id":"{id}","create_time":"2021-06-24T16:37:26+08:00","#,
            r#""resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","#,
            r#""summary":"支付成功","resource":{{"original_type":"transaction","#,
            r#""algorithm":"AEAD_AES_256_GCM","ciphertext":"{ciphertext}","#,
            r#""associated_data":"transaction","nonce":"{nonce}"}}}}"#,
        ),
        id = id,
        ciphertext = ciphertext,
        nonce = nonce,
    ))
}

/// What one transaction's storm produced.
#[derive(Debug, Default)]
struct TxReport {
    /// At least one copy was acknowledged with the success reply.
    acked: bool,
    /// Copies that used up every attempt without a success reply.
    gave_up: usize,
    /// Latency of every HTTP request sent for this transaction.
    latencies: Vec<Duration>,
}

/// Sends one copy until it is acknowledged or out of attempts, with
/// `cookie` (if any) on every attempt. Returns whether it was acknowledged
/// and the latency of each attempt.
async fn deliver(
    client: HttpClient,
    uris: Arc<[http::Uri]>,
    first: usize,
    id: Arc<str>,
    seed: u64,
    cookie: Option<http::HeaderValue>,
    scenario: Scenario,
) -> (bool, Vec<Duration>) {
    let mut latencies = Vec::with_capacity(1);
    for attempt in 0..MAX_ATTEMPTS {
        // Each retry may land on another instance, as behind a load balancer.
        let uri = &uris[(first + attempt as usize) % uris.len()];
        let mut req =
            Request::post(uri.clone()).header(http::header::CONTENT_TYPE, "application/json");
        let body = match scenario {
            Scenario::Burst => {
                req = req.header(
                    "wechatpay-serial",
                    "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
                );
                notification(&id, seed.wrapping_add(u64::from(attempt)))
            }
            // A client resends the same bytes under the same key.
            Scenario::DoubleSubmit => {
                req = req
                    .header("idempotency-key", &*id)
                    .header(http::header::AUTHORIZATION, "Bearer shopper");
                Bytes::from(format!(r#"{{"id":"{id}","sku":"tea","qty":1}}"#))
            }
        };
        if let Some(cookie) = &cookie {
            req = req.header(http::header::COOKIE, cookie.clone());
        }
        let req = req.body(Full::new(body));
        let Ok(req) = req else {
            return (false, latencies);
        };
        let start = Instant::now();
        let answer = tokio::time::timeout(CHANNEL_TIMEOUT, async {
            let res = client.request(req).await.ok()?;
            let ok = res.status().is_success();
            let body = res.into_body().collect().await.ok()?.to_bytes();
            Some(ok && body == SUCCESS_BODY.as_bytes())
        })
        .await;
        latencies.push(start.elapsed());
        if let Ok(Some(true)) = answer {
            return (true, latencies);
        }
        tokio::time::sleep(BACKOFF).await;
    }
    (false, latencies)
}

/// Sends `duplicates` copies of transaction `id` at once, all with `cookie`
/// (if any).
async fn storm(
    client: HttpClient,
    uris: Arc<[http::Uri]>,
    id: Arc<str>,
    duplicates: usize,
    seed: u64,
    cookie: Option<http::HeaderValue>,
    scenario: Scenario,
) -> TxReport {
    let mut copies = JoinSet::new();
    for copy in 0..duplicates {
        let seed = xorshift(seed ^ ((copy as u64) << 48));
        // Copies spread over the instances.
        let first = copy + (seed as usize % uris.len());
        let deliver = deliver(
            client.clone(),
            uris.clone(),
            first,
            id.clone(),
            seed,
            cookie.clone(),
            scenario,
        );
        // Double clicks: the copies spread evenly over 100 ms.
        let delay = match scenario {
            Scenario::Burst => Duration::ZERO,
            Scenario::DoubleSubmit => {
                Duration::from_millis(100) * copy as u32 / (duplicates.max(2) - 1) as u32
            }
        };
        copies.spawn(async move {
            tokio::time::sleep(delay).await;
            deliver.await
        });
    }
    let mut report = TxReport::default();
    while let Some(done) = copies.join_next().await {
        match done {
            Ok((acked, latencies)) => {
                report.acked |= acked;
                report.gave_up += usize::from(!acked);
                report.latencies.extend(latencies);
            }
            Err(_) => report.gave_up += 1,
        }
    }
    report
}

// -------------------------------------------------------------- results --

/// The client's view of the storm so far.
#[derive(Debug)]
struct Tally {
    /// Per transaction: whether any copy was acknowledged with success.
    acked: Vec<bool>,
    /// Latency of every HTTP request sent.
    latencies: Vec<Duration>,
    /// Copies that used up every attempt.
    gave_up_copies: usize,
}

impl Tally {
    fn add(&mut self, (i, report): (usize, TxReport)) {
        self.acked[i] = report.acked;
        self.gave_up_copies += report.gave_up;
        self.latencies.extend(report.latencies);
    }
}

#[derive(Debug)]
struct Summary {
    requests: usize,
    transactions: usize,
    handler_executions: u64,
    duplicate_executions: u64,
    lost: usize,
    gave_up_copies: usize,
    elapsed: Duration,
    throughput_rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    peak_rss_mb: f64,
}

fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

/// Peak resident set size (`VmHWM`) in MiB, or 0 where unknown.
fn peak_rss_mb() -> f64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0.0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

fn print_table(args: &Args, s: &Summary) {
    println!(
        "retry storm: baseline={} transactions={} duplicates={} concurrency={} handler_ms={} failure_rate={}",
        args.baseline.name(),
        args.transactions,
        args.duplicates,
        args.concurrency,
        args.handler_ms,
        args.failure_rate
    );
    let rows: [(&str, String); 12] = [
        ("requests", s.requests.to_string()),
        ("transactions", s.transactions.to_string()),
        ("handler_executions", s.handler_executions.to_string()),
        ("duplicate_executions", s.duplicate_executions.to_string()),
        ("lost", s.lost.to_string()),
        ("copies_given_up", s.gave_up_copies.to_string()),
        ("elapsed_s", format!("{:.3}", s.elapsed.as_secs_f64())),
        ("throughput_rps", format!("{:.1}", s.throughput_rps)),
        ("p50_ms", format!("{:.3}", s.p50_ms)),
        ("p99_ms", format!("{:.3}", s.p99_ms)),
        ("max_ms", format!("{:.3}", s.max_ms)),
        ("peak_rss_mb", format!("{:.1}", s.peak_rss_mb)),
    ];
    println!("  {:<22} {:>14}", "metric", "value");
    println!("  {:-<22} {:->14}", "", "");
    for (name, value) in rows {
        println!("  {name:<22} {value:>14}");
    }
}

// ----------------------------------------------------------------- main --

/// `instances` dedup stacks (each its own layer and server) over one store:
/// for the memory store, the one store all instances of a process share.
async fn serve_stacks<St: Store>(
    store: St,
    handler: &Handler,
    instances: usize,
    scenario: Scenario,
) -> std::io::Result<Vec<SocketAddr>> {
    let preset = match scenario {
        Scenario::Burst => Preset::wechatpay_v3(),
        Scenario::DoubleSubmit => Preset::idempotency_key(),
    };
    let mut addrs = Vec::with_capacity(instances);
    for _ in 0..instances {
        let stack = ServiceBuilder::new()
            .layer(IdempotencyLayer::with_store(preset.clone(), store.clone()))
            .service(handler.clone());
        addrs.push(serve(stack).await?);
    }
    Ok(addrs)
}

/// `instances` servers of the handler in an axum `Router` behind
/// axum-idempotent 0.6, in the layer order its README prescribes
/// (`CookieManagerLayer`, `SessionLayer`, `IdempotentLayer`), all sharing one
/// in-memory session store (as the dedup stacks share one `MemoryStore`).
///
/// Its best case for a WeChat storm: the key is the method and path only, so
/// that within one transaction's session every copy shares it (hashing the
/// body, its default, would give every re-encrypted copy its own key).
async fn serve_axum_idempotent(
    handler: &Handler,
    instances: usize,
) -> std::io::Result<Vec<SocketAddr>> {
    let store = Arc::new(MokaStore::builder().max_capacity(1 << 24).build());
    let options = IdempotentOptions::default()
        .ignore_body(true)
        .ignore_all_headers()
        .expire_after(WINDOW_SECS as i64);
    let cookie_options = CookieOptions::build()
        .name(SESSION_COOKIE)
        .path("/")
        .max_age(WINDOW_SECS);
    let mut addrs = Vec::with_capacity(instances);
    for _ in 0..instances {
        let app = axum::Router::new()
            .route(NOTIFY_PATH, axum::routing::post_service(handler.clone()))
            .route(ORDERS_PATH, axum::routing::post_service(handler.clone()))
            .layer(IdempotentLayer::<MokaStore>::new(options.clone()))
            .layer(SessionLayer::new(store.clone()).with_cookie_options(cookie_options.clone()))
            .layer(CookieManagerLayer::new());
        addrs.push(serve(app).await?);
    }
    Ok(addrs)
}

async fn run(args: &Args) -> Result<Summary, Box<dyn std::error::Error>> {
    let run_seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x5eed, |d| d.as_nanos() as u64);
    let ids: Vec<String> = (0..args.transactions)
        .map(|i| notification_id(run_seed, i))
        .collect();
    let upstream = Arc::new(Upstream::new(&ids, args.handler_ms, args.failure_rate));
    let handler = Handler(upstream.clone());

    let addrs = match (args.baseline, &args.store) {
        (Baseline::None, _) => {
            let mut addrs = Vec::with_capacity(args.instances);
            for _ in 0..args.instances {
                addrs.push(serve(handler.clone()).await?);
            }
            addrs
        }
        (Baseline::AxumIdempotent | Baseline::AxumIdempotentNoCookie, _) => {
            serve_axum_idempotent(&handler, args.instances).await?
        }
        (Baseline::Dedup, StoreArg::Memory) => {
            serve_stacks(MemoryStore::new(), &handler, args.instances, args.scenario).await?
        }
        // Each instance gets its own connection, local tier and pollers, as
        // separate processes would.
        (Baseline::Dedup, StoreArg::Redis(url)) => {
            let mut addrs = Vec::with_capacity(args.instances);
            for _ in 0..args.instances {
                let store = RedisStore::standalone(url.as_str()).await?;
                addrs.extend(serve_stacks(store, &handler, 1, args.scenario).await?);
            }
            addrs
        }
        (Baseline::Dedup, StoreArg::Cluster(nodes)) => {
            let mut addrs = Vec::with_capacity(args.instances);
            for _ in 0..args.instances {
                let store = RedisStore::cluster(nodes.clone()).await?;
                addrs.extend(serve_stacks(store, &handler, 1, args.scenario).await?);
            }
            addrs
        }
    };
    let path = match args.scenario {
        Scenario::Burst => NOTIFY_PATH,
        Scenario::DoubleSubmit => ORDERS_PATH,
    };
    let uris: Arc<[http::Uri]> = addrs
        .iter()
        .map(|addr| format!("http://{addr}{path}").parse())
        .collect::<Result<Vec<_>, _>>()?
        .into();

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);

    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut transactions = JoinSet::new();
    let mut tally = Tally {
        acked: vec![false; ids.len()],
        latencies: Vec::with_capacity(ids.len().saturating_mul(args.duplicates).min(1 << 20)),
        gave_up_copies: 0,
    };
    let start = Instant::now();
    for (i, id) in ids.iter().enumerate() {
        let permit = permits.clone().acquire_owned().await?;
        // axum-idempotent's best case: a fresh, well-formed session id per
        // transaction, which ruts accepts as a (new) session.
        let cookie = match args.baseline {
            Baseline::AxumIdempotent => Some(http::HeaderValue::from_str(&format!(
                "{SESSION_COOKIE}={}",
                ruts::Id::default()
            ))?),
            _ => None,
        };
        let fut = storm(
            client.clone(),
            uris.clone(),
            Arc::from(id.as_str()),
            args.duplicates,
            run_seed ^ (i as u64).wrapping_mul(0x9E37_79B9),
            cookie,
            args.scenario,
        );
        transactions.spawn(async move {
            let report = fut.await;
            drop(permit);
            (i, report)
        });
        // Collect finished transactions as we go, so their results do not
        // pile up in the join set.
        while let Some(done) = transactions.try_join_next() {
            tally.add(done?);
        }
    }
    while let Some(done) = transactions.join_next().await {
        tally.add(done?);
    }
    let Tally {
        acked,
        mut latencies,
        gave_up_copies,
    } = tally;
    let elapsed = start.elapsed();

    let mut handler_executions = 0u64;
    let mut duplicate_executions = 0u64;
    let mut lost = 0usize;
    for (id, acked) in ids.iter().zip(&acked) {
        let executions = upstream.executions(id);
        handler_executions += u64::from(executions);
        duplicate_executions += u64::from(executions.saturating_sub(1));
        if !acked || executions == 0 {
            lost += 1;
        }
    }

    latencies.sort_unstable();
    let requests = latencies.len();
    Ok(Summary {
        requests,
        transactions: ids.len(),
        handler_executions,
        duplicate_executions,
        lost,
        gave_up_copies,
        elapsed,
        throughput_rps: requests as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
        p50_ms: percentile_ms(&latencies, 0.50),
        p99_ms: percentile_ms(&latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        peak_rss_mb: peak_rss_mb(),
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Parsed::Run(args)) => args,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("retry_storm: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let summary = match run(&args).await {
        Ok(summary) => summary,
        Err(e) => {
            eprintln!("retry_storm: {e}");
            return ExitCode::FAILURE;
        }
    };
    print_table(&args, &summary);
    if args.json {
        let line = serde_json::json!({
            "requests": summary.requests,
            "transactions": summary.transactions,
            "handler_executions": summary.handler_executions,
            "duplicate_executions": summary.duplicate_executions,
            "lost": summary.lost,
            "throughput_rps": round3(summary.throughput_rps),
            "p50_ms": round3(summary.p50_ms),
            "p99_ms": round3(summary.p99_ms),
            "max_ms": round3(summary.max_ms),
            "peak_rss_mb": round3(summary.peak_rss_mb),
        });
        println!("{line}");
    }
    ExitCode::SUCCESS
}
