//! The `load` subcommand: closed loop (each connection sends its next
//! request when the previous one returned) or open loop (`--rate`: requests
//! sent on a fixed schedule whether or not earlier ones returned, latency
//! measured from each request's scheduled send time, as wrk2 does), and
//! with `--copies` each id sent as simultaneous copies on several connections.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderValue;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Barrier};

use crate::report::{percentiles, Report};
use crate::{Kind, LoadConfig, Mode, SUCCESS};

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

/// The body of `GET path` at the upstream.
async fn upstream_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("upstream {addr}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get(path)
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
    String::from_utf8(body.to_vec()).map_err(|_| format!("upstream {path}: not UTF-8"))
}

async fn upstream_hits(addr: SocketAddr) -> Result<u64, String> {
    upstream_get(addr, "/__hits")
        .await?
        .trim()
        .parse()
        .map_err(|_| "upstream /__hits: not a number".to_owned())
}

/// A client submission keyed by its `Idempotency-Key` header.
fn submission(id: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"order":"{id}","amount":100,"currency":"CNY","method":"card"}}"#
    ))
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
    path: String,
    kind: Kind,
    mode: Mode,
    timeout: Option<Duration>,
    prefix: String,
    /// Repeat mode: the ids and their bodies, built once.
    repeat: Vec<(HeaderValue, Bytes)>,
}

impl Shared {
    /// Id `i`'s request.
    fn request(&self, i: usize) -> Request<Full<Bytes>> {
        let (id, body) = match self.mode {
            Mode::First => {
                let id = format!("{}{i}", self.prefix);
                let body = self.body(&id);
                (
                    HeaderValue::try_from(id).expect("ids are visible ASCII"),
                    body,
                )
            }
            Mode::Repeat => self.repeat[i % self.repeat.len()].clone(),
        };
        let req = Request::post(&self.path)
            .header("host", &*self.host)
            .header("content-type", "application/json");
        match self.kind {
            Kind::WechatPayV3 => req
                .header("wechatpay-signature", "x")
                .header("wechatpay-timestamp", "1764460800")
                .header("wechatpay-nonce", "fdasflkja484w")
                .header(
                    "wechatpay-serial",
                    "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
                ),
            Kind::IdempotencyKey => req.header("idempotency-key", id),
        }
        .body(Full::new(body))
        .expect("request")
    }

    fn body(&self, id: &str) -> Bytes {
        match self.kind {
            Kind::WechatPayV3 => notification(id),
            Kind::IdempotencyKey => submission(id),
        }
    }
}

/// One connection: (re)opened on demand, one request in flight at a time.
struct Conn {
    send: Option<Sender>,
    latencies_us: Vec<u32>,
    errors: usize,
    /// Errors by kind: a status other than 200, `body`, `io`.
    failures: BTreeMap<String, usize>,
}

impl Conn {
    fn new(expected: usize) -> Self {
        Conn {
            send: None,
            latencies_us: Vec::with_capacity(expected + 16),
            errors: 0,
            failures: BTreeMap::new(),
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
        if let Some(sender) = self.send.as_mut()
            && sender.ready().await.is_err()
        {
            self.send = connect(s.target).await;
        }
        let Some(sender) = self.send.as_mut() else {
            self.fail("io");
            return;
        };
        let req = s.request(i);
        let t0 = since.unwrap_or_else(Instant::now);
        let exchange = async {
            match sender.send_request(req).await {
                Ok(resp) => {
                    let status = resp.status();
                    match resp.into_body().collect().await.map(|b| b.to_bytes()) {
                        Ok(_) if status != StatusCode::OK => Some(status.as_str().to_owned()),
                        Ok(b) if b != SUCCESS.as_bytes() => Some("body".to_owned()),
                        Ok(_) => None,
                        Err(_) => Some("io".to_owned()),
                    }
                }
                Err(_) => Some("io".to_owned()),
            }
        };
        let failure = match s.timeout {
            Some(limit) => tokio::time::timeout(limit, exchange)
                .await
                .unwrap_or_else(|_| Some("timeout".to_owned())),
            None => exchange.await,
        };
        if matches!(failure.as_deref(), Some("io" | "timeout")) {
            // The connection is gone or stuck: count the request as failed
            // and open a new one for the next.
            self.send = None;
        }
        let us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
        self.latencies_us.push(us);
        if let Some(f) = failure {
            self.fail(&f);
        }
    }

    fn fail(&mut self, kind: &str) {
        self.errors += 1;
        *self.failures.entry(kind.to_owned()).or_default() += 1;
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
    let mut shared = Shared {
        target: cfg.target,
        host: cfg.host.clone().into(),
        path: cfg.path.clone(),
        kind: cfg.kind,
        mode: cfg.mode,
        timeout: cfg.timeout,
        prefix: cfg
            .id_prefix
            .clone()
            .unwrap_or_else(|| format!("first-{nanos:x}-{}-", std::process::id())),
        repeat: Vec::new(),
    };
    shared.repeat = (0..cfg.keys)
        .map(|k| {
            let id = format!("repeat-{k}");
            let body = shared.body(&id);
            (
                HeaderValue::try_from(id).expect("ids are visible ASCII"),
                body,
            )
        })
        .collect();
    let shared = Arc::new(shared);
    let per_conn = cfg.requests / cfg.connections;
    let next = Arc::new(AtomicUsize::new(0));
    // With copies, each group of `copies` connections sends id
    // `round * groups + group` together, round after round.
    let groups = cfg.connections / cfg.copies;
    let ids = cfg.requests / cfg.copies;
    let barriers: Vec<Arc<Barrier>> = (0..groups)
        .map(|_| Arc::new(Barrier::new(cfg.copies)))
        .collect();

    let start = Instant::now();
    let mut tasks = Vec::with_capacity(cfg.connections);
    let mut queues = Vec::new();
    for c in 0..cfg.connections {
        let shared = shared.clone();
        let total = cfg.requests;
        if cfg.copies > 1 {
            let group = c / cfg.copies;
            let barrier = barriers[group].clone();
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::new(per_conn);
                for id in (group..ids).step_by(groups) {
                    barrier.wait().await;
                    conn.request(&shared, id, None).await;
                }
                conn
            }));
        } else if cfg.rate.is_some() {
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
    let mut failures = BTreeMap::<String, usize>::new();
    for t in tasks {
        if let Ok(c) = t.await {
            lat.extend_from_slice(&c.latencies_us);
            errors += c.errors;
            for (k, n) in c.failures {
                *failures.entry(k).or_default() += n;
            }
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
    // Executions per key of this run, when the upstream can tell them apart.
    let per_key = if cfg.kind == Kind::IdempotencyKey && cfg.mode == Mode::First {
        match upstream_get(cfg.upstream, &format!("/__keys?prefix={}", shared.prefix)).await {
            Ok(line) => Some(line),
            Err(e) => {
                eprintln!("proxy_bench: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        None
    };
    let report = Report {
        mode: match cfg.mode {
            Mode::First => "first",
            Mode::Repeat => "repeat",
        },
        kind: match cfg.kind {
            Kind::WechatPayV3 => "wechatpay-v3",
            Kind::IdempotencyKey => "idempotency-key",
        },
        copies: cfg.copies,
        requests: ids * cfg.copies,
        connections: cfg.connections,
        rate: cfg.rate,
        seconds: elapsed.as_secs_f64(),
        lat: percentiles(&mut lat),
        pacer_p99_ms: cfg.rate.map(|_| percentiles(&mut lateness)[2]),
        upstream_hits: after.saturating_sub(before),
        errors,
        failures,
        per_key,
    };
    report.print(cfg.json);
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
