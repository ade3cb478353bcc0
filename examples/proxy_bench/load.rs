//! The `load` subcommand: closed loop (each connection sends its next
//! request when the previous one returned) or open loop (`--rate`: requests
//! sent on a fixed schedule whether or not earlier ones returned, latency
//! measured from each request's scheduled send time, as wrk2 does).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::{LoadConfig, Mode, SUCCESS};

pub(crate) fn run_load(cfg: LoadConfig) -> ExitCode {
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

/// What every connection task shares: where to send, and the bodies.
struct Shared {
    target: SocketAddr,
    host: Arc<str>,
    mode: Mode,
    prefix: String,
    repeat_bodies: Vec<Bytes>,
}

/// One connection: (re)opened on demand, one request in flight at a time.
struct Conn {
    send: Option<Sender>,
    latencies_us: Vec<u32>,
    errors: usize,
}

impl Conn {
    fn new(expected: usize) -> Self {
        Conn {
            send: None,
            latencies_us: Vec::with_capacity(expected + 16),
            errors: 0,
        }
    }

    /// Sends request `i` and records its latency from `since` (the send
    /// time in a closed loop, the scheduled time in an open loop).
    async fn request(&mut self, s: &Shared, i: usize, since: Option<Instant>) {
        // (Re)open the connection when there is none or the server closed
        // it (e.g. a proxy's keep-alive request limit).
        if self.send.as_ref().is_none_or(|s: &Sender| s.is_closed()) {
            self.send = connect(s.target).await;
        }
        if let Some(sender) = self.send.as_mut() {
            if sender.ready().await.is_err() {
                self.send = connect(s.target).await;
            }
        }
        let Some(sender) = self.send.as_mut() else {
            self.errors += 1;
            return;
        };
        let body = match s.mode {
            Mode::First => notification(&format!("{}{i}", s.prefix)),
            Mode::Repeat => s.repeat_bodies[i % s.repeat_bodies.len()].clone(),
        };
        let req = Request::post("/notify")
            .header("host", &*s.host)
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
        let t0 = since.unwrap_or_else(Instant::now);
        let ok = match sender.send_request(req).await {
            Ok(resp) => {
                let status = resp.status();
                match resp.into_body().collect().await {
                    Ok(b) => status == StatusCode::OK && b.to_bytes() == SUCCESS.as_bytes(),
                    Err(_) => false,
                }
            }
            Err(_) => {
                // The connection is gone: count the request as failed and
                // open a new one for the next.
                self.send = None;
                false
            }
        };
        let us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
        self.latencies_us.push(us);
        if !ok {
            self.errors += 1;
        }
    }
}

/// Open loop: a pacer thread (OS sleeps, finer than tokio's 1 ms timer
/// wheel) hands request `i` to connection `i % C` at `start + i / rate`.
/// A connection still busy with an earlier request queues it, and the wait
/// counts in that request's latency. Returns the pacer's own lateness
/// (time past each schedule when it handed the request over), in µs.
fn pace(
    rate: f64,
    total: usize,
    start: Instant,
    queues: Vec<mpsc::UnboundedSender<(usize, Instant)>>,
) -> std::thread::JoinHandle<Vec<u32>> {
    std::thread::spawn(move || {
        let mut lateness = Vec::with_capacity(total);
        for i in 0..total {
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            lateness.push(at.elapsed().as_micros().min(u32::MAX as u128) as u32);
            let _ = queues[i % queues.len()].send((i, at));
        }
        lateness
    })
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
    let shared = Arc::new(Shared {
        target: cfg.target,
        host: cfg.host.clone().into(),
        mode: cfg.mode,
        prefix: format!("first-{nanos:x}-{}-", std::process::id()),
        // Repeat mode: the bodies are built once.
        repeat_bodies: (0..cfg.keys)
            .map(|k| notification(&format!("repeat-{k}")))
            .collect(),
    });
    let per_conn = cfg.requests / cfg.connections;
    let next = Arc::new(AtomicUsize::new(0));

    let start = Instant::now();
    let mut tasks = Vec::with_capacity(cfg.connections);
    let mut queues = Vec::new();
    for _ in 0..cfg.connections {
        let shared = shared.clone();
        let total = cfg.requests;
        if cfg.rate.is_some() {
            let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Instant)>();
            queues.push(tx);
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::new(per_conn);
                while let Some((i, at)) = rx.recv().await {
                    conn.request(&shared, i, Some(at)).await;
                }
                conn
            }));
        } else {
            let next = next.clone();
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::new(per_conn);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break conn;
                    }
                    conn.request(&shared, i, None).await;
                }
            }));
        }
    }
    let pacer = cfg
        .rate
        .map(|rate| pace(rate, cfg.requests, start, std::mem::take(&mut queues)));
    let mut lat = Vec::with_capacity(cfg.requests);
    let mut errors = 0usize;
    for t in tasks {
        if let Ok(c) = t.await {
            lat.extend_from_slice(&c.latencies_us);
            errors += c.errors;
        }
    }
    let elapsed = start.elapsed();
    let mut lateness = pacer.and_then(|p| p.join().ok()).unwrap_or_default();
    let after = match upstream_hits(cfg.upstream).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("proxy_bench: {e}");
            return ExitCode::from(1);
        }
    };
    let report = Report {
        mode: match cfg.mode {
            Mode::First => "first",
            Mode::Repeat => "repeat",
        },
        requests: cfg.requests,
        connections: cfg.connections,
        rate: cfg.rate,
        seconds: elapsed.as_secs_f64(),
        lat: percentiles(&mut lat),
        pacer_p99_ms: cfg.rate.map(|_| percentiles(&mut lateness)[2]),
        upstream_hits: after.saturating_sub(before),
        errors,
    };
    report.print(cfg.json);
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// p50, p90, p99, p99.9 and max of `us` (microseconds), in milliseconds:
/// exact order statistics of every sample (nothing is bucketed).
fn percentiles(us: &mut [u32]) -> [f64; 5] {
    us.sort_unstable();
    let at = |p: f64| -> f64 {
        if us.is_empty() {
            return f64::NAN;
        }
        let i = ((us.len() as f64 * p).ceil() as usize).clamp(1, us.len()) - 1;
        us[i] as f64 / 1000.0
    };
    [at(0.50), at(0.90), at(0.99), at(0.999), at(1.0)]
}

struct Report {
    mode: &'static str,
    requests: usize,
    connections: usize,
    rate: Option<f64>,
    seconds: f64,
    lat: [f64; 5],
    pacer_p99_ms: Option<f64>,
    upstream_hits: u64,
    errors: usize,
}

impl Report {
    fn print(&self, json: bool) {
        let rps = self.requests as f64 / self.seconds.max(f64::MIN_POSITIVE);
        let [p50, p90, p99, p999, max] = self.lat;
        let fields: Vec<(&str, String)> = [
            ("mode", self.mode.to_owned()),
            ("requests", self.requests.to_string()),
            ("connections", self.connections.to_string()),
            (
                "rate",
                self.rate.map_or("closed".into(), |r| format!("{r:.0}")),
            ),
            ("seconds", format!("{:.3}", self.seconds)),
            ("rps", format!("{rps:.0}")),
            ("p50_ms", format!("{p50:.3}")),
            ("p90_ms", format!("{p90:.3}")),
            ("p99_ms", format!("{p99:.3}")),
            ("p999_ms", format!("{p999:.3}")),
            ("max_ms", format!("{max:.3}")),
            (
                "pacer_p99_ms",
                self.pacer_p99_ms.map_or("-".into(), |p| format!("{p:.3}")),
            ),
            ("upstream_hits", self.upstream_hits.to_string()),
            ("errors", self.errors.to_string()),
        ]
        .into();
        if json {
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| match v.parse::<f64>() {
                    Ok(_) => format!(r#""{k}":{v}"#),
                    Err(_) => format!(r#""{k}":"{v}""#),
                })
                .collect();
            println!("{{{}}}", body.join(","));
        } else {
            let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("{}", line.join(" "));
        }
    }
}
