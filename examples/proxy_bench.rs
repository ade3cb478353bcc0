//! Load generator and trivial upstream for comparing the gateway
//! (`examples/gateway/`) with another reverse proxy (nginx `proxy_pass`)
//! in front of the same upstream. `benches/gateway_vs_nginx.sh` drives it.
//!
//! ```text
//! proxy_bench upstream [--listen 127.0.0.1:0]
//! proxy_bench load --target URL --upstream ADDR [--mode first|repeat] [--requests N]
//!     [--connections C] [--keys K] [--threads T] [--json]
//! ```
//!
//! # `upstream`
//!
//! An HTTP/1.1 server (one thread, keep-alive) that answers every request
//! at once with 200 `{"code":"SUCCESS","message":"成功"}` (WeChat Pay v3's
//! success reply) and counts it; `GET /__hits` answers the count instead (and
//! is not counted). When it accepts connections it prints exactly one line,
//! `upstream on IP:PORT`, to stdout. It runs until killed.
//!
//! # `load`
//!
//! Sends `--requests` WeChat Pay v3 payment notifications (`POST /notify`,
//! JSON with `id`, `event_type` `TRANSACTION.SUCCESS`, `resource.original_type`
//! `transaction`, header `Wechatpay-Signature`) to `--target` over
//! `--connections` keep-alive HTTP/1.1 connections, each with one request in
//! flight at a time (closed loop). With `--mode first` every request carries
//! a notification id never sent before (ids start with a per-run prefix, so
//! consecutive runs against one gateway stay first deliveries); with
//! `--mode repeat` the ids cycle through `--keys` fixed ids (`repeat-0`, ...).
//!
//! It reads the upstream's `/__hits` before and after, and prints one line:
//! throughput, p50/p99/max latency, how many requests reached the upstream,
//! and how many answers were not 200 with the success body (`errors`; a
//! request whose connection fails counts as one, and the next request opens
//! a new connection, as it does when the server closes one). It exits with
//! status 1 if there was any error. `--json` prints the same as a JSON
//! object. `--threads` is the load generator's own runtime threads (default
//! 1, so that it takes at most one core away from the system under test).
//!
//! A bad flag prints a message on stderr and exits with status 2.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;

const USAGE: &str = "usage:
  proxy_bench upstream [--listen 127.0.0.1:0]
  proxy_bench load --target URL --upstream ADDR [--mode first|repeat] [--requests N]
      [--connections C] [--keys K] [--threads T] [--json]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("upstream") => match parse_upstream(&args[1..]) {
            Ok(listen) => run_upstream(listen),
            Err(e) => usage_error(&e),
        },
        Some("load") => match parse_load(&args[1..]) {
            Ok(cfg) => run_load(cfg),
            Err(e) => usage_error(&e),
        },
        _ => usage_error("expected `upstream` or `load`"),
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("proxy_bench: {msg}\n{USAGE}");
    ExitCode::from(2)
}

/// Splits `--flag value` and `--flag=value` into (flag, value) pairs;
/// `--json` is the only flag without a value.
fn pairs(args: &[String]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if !a.starts_with("--") {
            return Err(format!("unexpected argument `{a}`"));
        }
        if a == "--json" {
            out.push((a.clone(), String::new()));
        } else if let Some((k, v)) = a.split_once('=') {
            out.push((k.to_owned(), v.to_owned()));
        } else {
            let v = it.next().ok_or_else(|| format!("`{a}` needs a value"))?;
            out.push((a.clone(), v.clone()));
        }
    }
    Ok(out)
}

fn parse_upstream(args: &[String]) -> Result<SocketAddr, String> {
    let mut listen: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    for (k, v) in pairs(args)? {
        match k.as_str() {
            "--listen" => listen = v.parse().map_err(|e| format!("--listen {v}: {e}"))?,
            _ => return Err(format!("unknown flag `{k}` for `upstream`")),
        }
    }
    Ok(listen)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    First,
    Repeat,
}

struct LoadConfig {
    target: SocketAddr,
    host: String,
    upstream: SocketAddr,
    mode: Mode,
    requests: usize,
    connections: usize,
    keys: usize,
    threads: usize,
    json: bool,
}

fn parse_load(args: &[String]) -> Result<LoadConfig, String> {
    let mut target = None;
    let mut upstream = None;
    let mut mode = Mode::First;
    let mut requests = 100_000usize;
    let mut connections = 64usize;
    let mut keys = 8usize;
    let mut threads = 1usize;
    let mut json = false;
    let num = |k: &str, v: &str| -> Result<usize, String> {
        match v.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{k} {v}: expected a whole number above 0")),
        }
    };
    for (k, v) in pairs(args)? {
        match k.as_str() {
            "--target" => target = Some(v),
            "--upstream" => {
                let a = v
                    .strip_prefix("http://")
                    .unwrap_or(&v)
                    .trim_end_matches('/');
                upstream = Some(
                    a.parse::<SocketAddr>()
                        .map_err(|e| format!("--upstream {v}: {e}"))?,
                );
            }
            "--mode" => {
                mode = match v.as_str() {
                    "first" => Mode::First,
                    "repeat" => Mode::Repeat,
                    _ => return Err(format!("--mode {v}: expected `first` or `repeat`")),
                }
            }
            "--requests" => requests = num(&k, &v)?,
            "--connections" => connections = num(&k, &v)?,
            "--keys" => keys = num(&k, &v)?,
            "--threads" => threads = num(&k, &v)?,
            "--json" => json = true,
            _ => return Err(format!("unknown flag `{k}` for `load`")),
        }
    }
    let target = target.ok_or("--target is required")?;
    let upstream = upstream.ok_or("--upstream is required")?;
    // http://IP:PORT[/...]: a literal address keeps DNS out of the loop.
    let hostport = target
        .strip_prefix("http://")
        .ok_or_else(|| format!("--target {target}: expected http://IP:PORT"))?
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let target_addr = hostport
        .parse::<SocketAddr>()
        .map_err(|e| format!("--target {target}: {e} (use a literal IP:PORT)"))?;
    Ok(LoadConfig {
        target: target_addr,
        host: hostport,
        upstream,
        mode,
        requests,
        connections,
        keys,
        threads,
        json,
    })
}

// ---------------------------------------------------------------- upstream

fn run_upstream(listen: SocketAddr) -> ExitCode {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        let listener = match TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("proxy_bench: cannot listen on {listen}: {e}");
                return ExitCode::from(1);
            }
        };
        let addr = listener.local_addr().expect("bound address");
        println!("upstream on {addr}");
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        let hits = Arc::new(AtomicU64::new(0));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let hits = hits.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let hits = hits.clone();
                    async move { Ok::<_, Infallible>(upstream_answer(req, &hits).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

async fn upstream_answer(req: Request<Incoming>, hits: &AtomicU64) -> Response<Full<Bytes>> {
    if req.method() == hyper::Method::GET && req.uri().path() == "/__hits" {
        let n = hits.load(Ordering::SeqCst);
        return Response::new(Full::new(Bytes::from(n.to_string())));
    }
    // Read the whole body, as a real handler would.
    let _ = req.into_body().collect().await;
    hits.fetch_add(1, Ordering::Relaxed);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(SUCCESS.as_bytes())))
        .expect("static response")
}

// -------------------------------------------------------------------- load

fn run_load(cfg: LoadConfig) -> ExitCode {
    let rt = if cfg.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads)
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    rt.block_on(load(cfg))
}

async fn upstream_hits(addr: SocketAddr) -> Result<u64, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("upstream {addr}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get("/__hits")
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .expect("static request");
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    std::str::from_utf8(&body)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| "upstream /__hits: not a number".to_owned())
}

fn notification(id: &str) -> Bytes {
    Bytes::from(format!(
        concat!(
            r#"{{"id":"{id}","create_time":"2026-11-30T08:00:00+08:00","#,
            r#""resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","#,
            r#""summary":"支付成功","resource":{{"original_type":"transaction","#,
            r#""algorithm":"AEAD_AES_256_GCM","#,
            r#""ciphertext":"sRvt4YOGXeWyk3qNrYBlQX0YTr1MrJLm1w6R3ExSlXY0mAEOWX2qHSGgmAjtmg8=","#,
            r#""associated_data":"transaction","nonce":"fdasflkja484w"}}}}"#
        ),
        id = id
    ))
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(target: SocketAddr) -> Option<Sender> {
    let stream = TcpStream::connect(target).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(send)
}

struct ConnResult {
    latencies_us: Vec<u32>,
    errors: usize,
}

async fn load(cfg: LoadConfig) -> ExitCode {
    let before = match upstream_hits(cfg.upstream).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("proxy_bench: {e}");
            return ExitCode::from(1);
        }
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let prefix: Arc<str> = format!("first-{nanos:x}-{}-", std::process::id()).into();
    // Repeat mode: the bodies are built once.
    let repeat_bodies: Arc<Vec<Bytes>> = Arc::new(
        (0..cfg.keys)
            .map(|k| notification(&format!("repeat-{k}")))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let host: Arc<str> = cfg.host.clone().into();

    let start = Instant::now();
    let mut tasks = Vec::with_capacity(cfg.connections);
    for _ in 0..cfg.connections {
        let next = next.clone();
        let prefix = prefix.clone();
        let bodies = repeat_bodies.clone();
        let host = host.clone();
        let (target, mode, total) = (cfg.target, cfg.mode, cfg.requests);
        tasks.push(tokio::spawn(async move {
            let mut res = ConnResult {
                latencies_us: Vec::with_capacity(total / 8 + 16),
                errors: 0,
            };
            let mut send = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                // (Re)open the connection when there is none or the server
                // closed it (e.g. a proxy's keep-alive request limit).
                if send.as_ref().is_none_or(|s: &Sender| s.is_closed()) {
                    send = connect(target).await;
                }
                let Some(sender) = send.as_mut() else {
                    res.errors += 1;
                    continue;
                };
                if sender.ready().await.is_err() {
                    send = connect(target).await;
                }
                let Some(sender) = send.as_mut() else {
                    res.errors += 1;
                    continue;
                };
                let body = match mode {
                    Mode::First => notification(&format!("{prefix}{i}")),
                    Mode::Repeat => bodies[i % bodies.len()].clone(),
                };
                let req = Request::post("/notify")
                    .header("host", &*host)
                    .header("content-type", "application/json")
                    .header("wechatpay-signature", "x")
                    .header("wechatpay-timestamp", "1764460800")
                    .header("wechatpay-nonce", "fdasflkja484w")
                    .header(
                        "wechatpay-serial",
                        "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
                    )
                    .body(Full::new(body))
                    .expect("request");
                let t0 = Instant::now();
                let ok = match sender.send_request(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        match resp.into_body().collect().await {
                            Ok(b) => status == StatusCode::OK && b.to_bytes() == SUCCESS.as_bytes(),
                            Err(_) => false,
                        }
                    }
                    Err(_) => {
                        // The connection is gone: count the request as
                        // failed and open a new one for the next.
                        send = None;
                        false
                    }
                };
                let us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
                res.latencies_us.push(us);
                if !ok {
                    res.errors += 1;
                }
            }
            res
        }));
    }
    let mut lat = Vec::with_capacity(cfg.requests);
    let mut errors = 0usize;
    for t in tasks {
        if let Ok(r) = t.await {
            lat.extend_from_slice(&r.latencies_us);
            errors += r.errors;
        }
    }
    let elapsed = start.elapsed();
    let after = match upstream_hits(cfg.upstream).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("proxy_bench: {e}");
            return ExitCode::from(1);
        }
    };
    lat.sort_unstable();
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        let i = ((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1;
        lat[i] as f64 / 1000.0
    };
    let rps = cfg.requests as f64 / elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
    let (p50, p99, max) = (pct(0.50), pct(0.99), pct(1.0));
    let upstream = after.saturating_sub(before);
    let mode = match cfg.mode {
        Mode::First => "first",
        Mode::Repeat => "repeat",
    };
    if cfg.json {
        println!(
            concat!(
                r#"{{"mode":"{}","requests":{},"connections":{},"seconds":{:.3},"#,
                r#""rps":{:.0},"p50_ms":{:.3},"p99_ms":{:.3},"max_ms":{:.3},"#,
                r#""upstream_hits":{},"errors":{}}}"#
            ),
            mode,
            cfg.requests,
            cfg.connections,
            elapsed.as_secs_f64(),
            rps,
            p50,
            p99,
            max,
            upstream,
            errors
        );
    } else {
        println!(
            "mode={mode} requests={} connections={} seconds={:.3} rps={rps:.0} \
             p50_ms={p50:.3} p99_ms={p99:.3} max_ms={max:.3} upstream_hits={upstream} errors={errors}",
            cfg.requests,
            cfg.connections,
            elapsed.as_secs_f64(),
        );
    }
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
