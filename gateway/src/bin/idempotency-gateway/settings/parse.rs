//! Values of flags and config-file keys: one parser for both.

use http::HeaderName;
use idempotency_gateway::proxy::{Target, Upstream};
use std::net::SocketAddr;
use std::time::Duration;
use tower_idempotency::{OnStoreError, Preset};

/// Where records live.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StoreSpec {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
    /// `postgres://…`, `mysql://…` (or `mariadb://…`), `sqlite:PATH`.
    Sql(String),
}

/// `PREFIX=PRESET` of `--route`.
#[derive(Debug, Clone)]
pub(crate) struct RouteArg {
    pub(crate) prefix: String,
    pub(crate) target: Target,
}

pub(crate) fn addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| "expected IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080".to_owned())
}

pub(crate) fn upstream(s: &str) -> Result<Upstream, String> {
    s.parse().map_err(|e| format!("{e}"))
}

pub(crate) fn store(s: &str) -> Result<StoreSpec, String> {
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
    if let Some(nodes) = s.strip_prefix("redis+cluster://") {
        let nodes: Vec<&str> = nodes
            .trim_end_matches('/')
            .split(',')
            .map(str::trim)
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
    let sql = ["postgres://", "postgresql://", "mysql://", "mariadb://"];
    if sql
        .iter()
        .any(|scheme| s.len() > scheme.len() && s.starts_with(scheme))
    {
        return Ok(StoreSpec::Sql(s.to_owned()));
    }
    if let Some(path) = s.strip_prefix("sqlite:") {
        if path.is_empty() || path.contains(":memory:") {
            return Err("sqlite:PATH needs a file (an in-memory database is not shared)".into());
        }
        return Ok(StoreSpec::Sql(s.to_owned()));
    }
    Err(
        "expected memory, redis://HOST:PORT, redis+cluster://HOST:PORT[,HOST:PORT...], \
         postgres://…, mysql://… or sqlite:PATH"
            .into(),
    )
}

/// `--backstop`: a SQL database (`postgres://…`, `mysql://…`, `sqlite:PATH`)
/// behind the Redis `--store`.
pub(crate) fn backstop(s: &str) -> Result<String, String> {
    match store(s) {
        Ok(StoreSpec::Sql(url)) => Ok(url),
        Ok(_) | Err(_) => Err(
            "expected a SQL database behind the Redis store: postgres://…, mysql://… or \
             sqlite:PATH"
                .into(),
        ),
    }
}

/// A preset name or `auto`.
pub(crate) fn target(preset: &str) -> Result<Target, String> {
    if preset == "auto" {
        return Ok(Target::Auto);
    }
    Preset::from_name(preset)
        .map(Target::Preset)
        .ok_or_else(|| {
            format!(
                "unknown preset `{preset}`; expected auto or one of {:?}",
                Preset::builtin_names()
            )
        })
}

pub(crate) fn prefix(prefix: &str) -> Result<String, String> {
    if !prefix.starts_with('/') {
        return Err("the prefix must start with `/`".into());
    }
    Ok(prefix.to_owned())
}

pub(crate) fn route(s: &str) -> Result<RouteArg, String> {
    let (p, preset) = s
        .split_once('=')
        .ok_or("expected PREFIX=PRESET, e.g. /notify/wechat=wechatpay-v3")?;
    Ok(RouteArg {
        prefix: prefix(p)?,
        target: target(preset)?,
    })
}

/// `500ms`, `30s`, `25h`, `2d`, `1h 30m` (humantime), at most a year.
pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{e}; expected a number and a unit: 500ms, 30s, 5m, 25h, 2d"))?;
    if d > tower_idempotency::dedup::MAX_SETTING {
        return Err("must be at most a year (365d)".into());
    }
    Ok(d)
}

/// `--lease`: from 100ms (renewed every lease/3) to a year.
pub(crate) fn lease(s: &str) -> Result<Duration, String> {
    match positive_duration(s)? {
        d if d < tower_idempotency::dedup::MIN_LEASE => {
            Err("must be at least 100ms (the lease is renewed every lease/3)".into())
        }
        d => Ok(d),
    }
}

pub(crate) fn positive_duration(s: &str) -> Result<Duration, String> {
    match duration(s)? {
        d if d.is_zero() => Err("must be more than 0".into()),
        d => Ok(d),
    }
}

/// Bytes, or a number with `B`, `KiB`, `MiB` or `GiB` (bytesize); the
/// decimal `KB`, `MB` are refused as ambiguous.
pub(crate) fn size(s: &str) -> Result<usize, String> {
    const UNITS: &str = "expected bytes or a whole number with B, KiB, MiB or GiB (e.g. 64KiB)";
    let unit = s
        .trim_start_matches(|c: char| c.is_ascii_digit() || c == '.')
        .trim();
    if !matches!(unit, "" | "B" | "KiB" | "MiB" | "GiB" | "TiB") {
        return Err(UNITS.into());
    }
    let size: bytesize::ByteSize = s.parse().map_err(|_| UNITS.to_owned())?;
    usize::try_from(size.as_u64()).map_err(|_| "too large".to_owned())
}

pub(crate) fn body_size(s: &str) -> Result<usize, String> {
    match size(s)? {
        0 => Err("must be more than 0".into()),
        n => Ok(n),
    }
}

pub(crate) fn count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) | Err(_) => Err("expected a whole number more than 0".into()),
        Ok(n) => Ok(n),
    }
}

/// `--h2-max-streams N`: 1 to 2^31-1.
pub(crate) fn streams(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n @ 1..=0x7fff_ffff) => Ok(n),
        _ => Err("expected a whole number from 1 to 2147483647".into()),
    }
}

/// `--workers N`: serving threads, 1 to [`MAX_WORKERS`].
pub(crate) fn workers(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=MAX_WORKERS) => Ok(n),
        _ => Err(format!(
            "expected a number of serving threads from 1 to {MAX_WORKERS}"
        )),
    }
}

/// The most serving threads `--workers` takes.
pub(crate) const MAX_WORKERS: usize = 1024;

/// `--workers` when it is not given: one serving thread per core.
pub(crate) fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_WORKERS))
}

pub(crate) fn policy(s: &str) -> Result<OnStoreError, String> {
    match s {
        "closed" => Ok(OnStoreError::FailClosed),
        "open" => Ok(OnStoreError::FailOpen),
        _ => Err("expected `closed` or `open`".into()),
    }
}

pub(crate) fn header_name(s: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(s.as_bytes()).map_err(|_| "not a header name".into())
}

/// `--principal-cookie` and `principal_cookie`: a cookie name.
pub(crate) fn cookie_name(s: &str) -> Result<tower_idempotency::key::CookiePrincipal, String> {
    tower_idempotency::key::CookiePrincipal::new(s).map_err(|_| "not a cookie name".into())
}
