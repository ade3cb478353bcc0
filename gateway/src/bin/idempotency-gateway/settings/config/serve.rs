//! Where and how clients are served: `listen`, `tls_cert` and `tls_key`,
//! `workers`, `max_connections`, `header_timeout`, `body_timeout`,
//! `max_buffered`, `h2_max_streams`, `drain_timeout`.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse;
use crate::settings::spanned::{readable, At};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Where and how clients are served.
#[derive(Debug)]
pub(crate) struct ServeSettings {
    pub(crate) listen: SocketAddr,
    pub(crate) tls: Option<(PathBuf, PathBuf)>,
    /// Serving threads.
    pub(crate) workers: usize,
    pub(crate) max_connections: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) body_timeout: Duration,
    /// The budget of request bodies being read.
    pub(crate) max_buffered: usize,
    pub(crate) h2_max_streams: u32,
    /// The longest drain on SIGTERM or SIGINT.
    pub(crate) drain_timeout: Duration,
}

/// The budget of request bodies being read when `--max-buffered` is not given.
pub(crate) const DEFAULT_MAX_BUFFERED: usize = 64 << 20;

/// The TLS pair clients are served with, when there is one.
pub(super) fn tls(
    args: &Args,
    file: &File,
    at: &At<'_>,
) -> Result<Option<(PathBuf, PathBuf)>, String> {
    let cert = at.file(
        args.tls_cert.as_deref(),
        &file.tls_cert,
        "tls_cert",
        readable(super::CERT),
    )?;
    let key = at.file(
        args.tls_key.as_deref(),
        &file.tls_key,
        "tls_key",
        readable(super::KEY),
    )?;
    match (cert, key) {
        (Some(c), Some(k)) => Ok(Some((c, k))),
        (None, None) => Ok(None),
        _ => Err("`--tls-cert` and `--tls-key` go together".into()),
    }
}

/// The serving settings (`listen` read by the caller: it is required).
pub(super) fn settings(
    args: &Args,
    file: &File,
    at: &At<'_>,
    listen: SocketAddr,
    tls: Option<(PathBuf, PathBuf)>,
) -> Result<ServeSettings, String> {
    Ok(ServeSettings {
        listen,
        tls,
        workers: at
            .pick(args.workers, &file.workers, "workers", parse::workers)?
            .unwrap_or_else(parse::default_workers),
        max_connections: at
            .pick(
                args.max_connections,
                &file.max_connections,
                "max_connections",
                parse::count,
            )?
            .unwrap_or(10_000),
        header_timeout: at
            .pick(
                args.header_timeout,
                &file.header_timeout,
                "header_timeout",
                parse::positive_duration,
            )?
            .unwrap_or(Duration::from_secs(10)),
        body_timeout: at
            .pick(
                args.body_timeout,
                &file.body_timeout,
                "body_timeout",
                parse::positive_duration,
            )?
            .unwrap_or(tower_idempotency::limit::DEFAULT_BODY_TIMEOUT),
        max_buffered: at
            .pick(
                args.max_buffered,
                &file.max_buffered,
                "max_buffered",
                parse::body_size,
            )?
            .unwrap_or(DEFAULT_MAX_BUFFERED),
        h2_max_streams: at
            .pick(
                args.h2_max_streams,
                &file.h2_max_streams,
                "h2_max_streams",
                parse::streams,
            )?
            .unwrap_or(64),
        drain_timeout: at
            .pick(
                args.drain_timeout,
                &file.drain_timeout,
                "drain_timeout",
                parse::duration,
            )?
            .unwrap_or(Duration::from_secs(30)),
    })
}
