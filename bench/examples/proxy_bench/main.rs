//! Load generator and trivial upstream for comparing the gateway
//! (`examples/gateway/`) with another reverse proxy (nginx `proxy_pass`)
//! in front of the same upstream. `benches/gateway_vs_nginx.sh` drives it.
//!
//! ```text
//! proxy_bench upstream [--listen 127.0.0.1:0] [--body-bytes N]
//! proxy_bench load --target URL --upstream ADDR [--mode first|repeat] [--requests N]
//!     [--connections C] [--keys K] [--threads T] [--rate R] [--json]
//!     [--kind wechatpay-v3|idempotency-key] [--copies K] [--timeout SECS]
//!     [--id-prefix P]
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
//! With `--body-bytes N` every answer's body is exactly N bytes instead,
//! built once at start: a JSON object `{"code":"SUCCESS","pad":"xx…"}` padded
//! to N bytes (`application/json`), or N bytes of `x` (`text/plain`) when N
//! is below that object's 27-byte minimum. A gateway's record of the answer
//! then holds N body bytes (a channel-preset route still answers the caller
//! with the channel's success reply, so `load` through it sees no error).
//!
//! It also counts executions per `Idempotency-Key` header value (requests
//! without the header are not tallied): `GET /__keys?prefix=P` answers one
//! line about the keys starting with P, `keys=K total=T max=M dist=1:K1,2:K2`
//! (how many keys were executed, how many executions in all, the most for
//! one key, and how many keys were executed how many times).
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
//! `--id-prefix P` sets that prefix instead (ids `P0`, `P1`, ...), so that a
//! later run can send the same ids again (a client retrying them). A path in
//! `--target` (`http://IP:PORT/PATH`) is the request path instead of
//! `/notify`.
//!
//! With `--kind idempotency-key` the requests are instead generic client
//! submissions keyed by header: `POST` with `Idempotency-Key: ID` (the same
//! ids as above) and a small JSON body naming the id, as an API client
//! retrying a payment would send them. In `first` mode the line then also
//! shows the upstream's executions of the keys with this run's prefix
//! (`keys_executed`, `key_max`, `key_dist`, from the upstream's `/__keys`;
//! with `--id-prefix`, earlier runs' executions of those keys count too).
//!
//! With `--copies K` (default 1) every id is sent as K identical copies at
//! the same instant on K different connections (a retry storm): the
//! connections form groups of K (`--connections` must be a multiple of K),
//! each group's connections wait for each other before each id, send their
//! copy together, and take the next id when all K have answered.
//! `--requests` counts every copy (ids = requests / K). Only a closed loop.
//!
//! With `--timeout SECS` a request not answered within SECS (a decimal
//! number) counts as failed (`timeout`) and its connection is closed, as a
//! client with a deadline would; by default a request waits as long as it
//! takes.
//!
//! It reads the upstream's `/__hits` before and after, and prints one line:
//! throughput, p50/p99/max latency, how many requests reached the upstream,
//! and how many answers were not 200 with the success body (`errors`; a
//! request whose connection fails counts as one, and the next request opens
//! a new connection, as it does when the server closes one), and the
//! failures by kind (`failures`, e.g. `409:3,body:1,io:2`, `-` for none:
//! a status other than 200, a 200 with another body, a failed connection).
//! It exits with status 1 if there was any error. `--json` prints the same
//! as a JSON object. `--threads` is the load generator's own runtime threads
//! (default 1, so that it takes at most one core away from the system under
//! test).
//!
//! With `--rate R` the load is an open loop at R requests per second in
//! total (as wrk2 does): request `i` is scheduled at `start + i / R` and
//! handed to connection `i % C` then, whether or not that connection's
//! earlier requests returned (a busy connection queues it), and its latency
//! is measured from the scheduled time, so time spent waiting behind a slow
//! answer counts (no coordinated omission). The pacer is an OS thread that
//! sleeps to each schedule; its own lateness is reported as `pacer_p99_ms`
//! (it is part of every latency, so latencies are, if anything, high). Use
//! enough connections that `R / C` times the expected latency stays well
//! below 1. The line then also shows p90 and p99.9 (`p999_ms`), exact order
//! statistics of every request's latency.
//!
//! A bad flag prints a message on stderr and exits with status 2.

mod load;
mod report;
mod upstream;

use std::net::SocketAddr;
use std::process::ExitCode;

use load::run_load;
use upstream::run_upstream;

pub(crate) const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;

const USAGE: &str = "usage:
  proxy_bench upstream [--listen 127.0.0.1:0] [--body-bytes N]
  proxy_bench load --target URL --upstream ADDR [--mode first|repeat] [--requests N]
      [--connections C] [--keys K] [--threads T] [--rate R] [--json]
      [--kind wechatpay-v3|idempotency-key] [--copies K] [--timeout SECS]
      [--id-prefix P]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("upstream") => match parse_upstream(&args[1..]) {
            Ok((listen, body_bytes)) => run_upstream(listen, body_bytes),
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

fn parse_upstream(args: &[String]) -> Result<(SocketAddr, Option<usize>), String> {
    let mut listen: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let mut body_bytes = None;
    for (k, v) in pairs(args)? {
        match k.as_str() {
            "--listen" => listen = v.parse().map_err(|e| format!("--listen {v}: {e}"))?,
            "--body-bytes" => {
                body_bytes = Some(
                    v.parse::<usize>()
                        .map_err(|e| format!("--body-bytes {v}: {e}"))?,
                )
            }
            _ => return Err(format!("unknown flag `{k}` for `upstream`")),
        }
    }
    Ok((listen, body_bytes))
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Mode {
    First,
    Repeat,
}

/// What the load sends: WeChat Pay v3 notifications keyed by body, or
/// generic submissions keyed by the `Idempotency-Key` header.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    WechatPayV3,
    IdempotencyKey,
}

pub(crate) struct LoadConfig {
    target: SocketAddr,
    host: String,
    path: String,
    kind: Kind,
    copies: usize,
    timeout: Option<std::time::Duration>,
    id_prefix: Option<String>,
    upstream: SocketAddr,
    mode: Mode,
    requests: usize,
    connections: usize,
    keys: usize,
    threads: usize,
    rate: Option<f64>,
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
    let mut rate = None;
    let mut kind = Kind::WechatPayV3;
    let mut copies = 1usize;
    let mut timeout = None;
    let mut id_prefix = None;
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
            "--rate" => match v.parse::<f64>() {
                Ok(r) if r.is_finite() && r > 0.0 => rate = Some(r),
                _ => return Err(format!("--rate {v}: expected requests per second above 0")),
            },
            "--kind" => {
                kind = match v.as_str() {
                    "wechatpay-v3" => Kind::WechatPayV3,
                    "idempotency-key" => Kind::IdempotencyKey,
                    _ => {
                        return Err(format!(
                            "--kind {v}: expected `wechatpay-v3` or `idempotency-key`"
                        ))
                    }
                }
            }
            "--copies" => copies = num(&k, &v)?,
            "--id-prefix" => {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                    return Err(format!("--id-prefix {v}: expected letters, digits and `-`"));
                }
                id_prefix = Some(v)
            }
            "--timeout" => match v.parse::<f64>() {
                Ok(t) if t.is_finite() && t > 0.0 => {
                    timeout = Some(std::time::Duration::from_secs_f64(t))
                }
                _ => return Err(format!("--timeout {v}: expected seconds above 0")),
            },
            "--json" => json = true,
            _ => return Err(format!("unknown flag `{k}` for `load`")),
        }
    }
    let target = target.ok_or("--target is required")?;
    let upstream = upstream.ok_or("--upstream is required")?;
    if copies > 1 && (!connections.is_multiple_of(copies) || rate.is_some()) {
        return Err(format!(
            "--copies {copies}: needs --connections a multiple of it and no --rate"
        ));
    }
    // http://IP:PORT[/PATH]: a literal address keeps DNS out of the loop.
    let rest = target
        .strip_prefix("http://")
        .ok_or_else(|| format!("--target {target}: expected http://IP:PORT"))?;
    let (hostport, path) = match rest.split_once('/') {
        Some((h, p)) if !p.is_empty() => (h.to_owned(), format!("/{p}")),
        Some((h, _)) => (h.to_owned(), "/notify".to_owned()),
        None => (rest.to_owned(), "/notify".to_owned()),
    };
    let target_addr = hostport
        .parse::<SocketAddr>()
        .map_err(|e| format!("--target {target}: {e} (use a literal IP:PORT)"))?;
    Ok(LoadConfig {
        target: target_addr,
        host: hostport,
        path,
        kind,
        copies,
        timeout,
        id_prefix,
        upstream,
        mode,
        requests,
        connections,
        keys,
        threads,
        rate,
        json,
    })
}
