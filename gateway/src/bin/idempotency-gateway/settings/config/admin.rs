//! The metrics and admin listener's settings: `metrics_listen`,
//! `admin_tls_cert`, `admin_tls_key`, and the rule that the admin API's
//! bearer token never crosses the network in clear.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse;
use crate::settings::spanned::At;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where the metrics (and admin) listener is, and its certificate pair.
#[derive(Debug, Clone, Default)]
pub(super) struct Listener {
    pub(super) listen: Option<SocketAddr>,
    /// `--admin-tls-cert` and `--admin-tls-key`: the listener speaks HTTPS.
    pub(super) tls: Option<(PathBuf, PathBuf)>,
}

/// The listener's address and TLS pair from the flags and the config file.
pub(super) fn settings(args: &Args, file: &File, at: &At<'_>) -> Result<Listener, String> {
    let listen = listen(args, file, at)?;
    let tls = match (cert(args, file), key(args, file)) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("`--admin-tls-cert` and `--admin-tls-key` go together".into()),
    };
    if tls.is_some() && listen.is_none() {
        return Err("`--admin-tls-cert` needs --metrics-listen (the listener it serves)".into());
    }
    Ok(Listener { listen, tls })
}

/// `metrics_listen`.
pub(super) fn listen(args: &Args, file: &File, at: &At<'_>) -> Result<Option<SocketAddr>, String> {
    Ok(args
        .metrics_listen
        .or(at.value(&file.metrics_listen, "metrics_listen", parse::addr)?))
}

/// `admin_tls_cert` (the admin commands trust it to speak HTTPS).
pub(super) fn cert(args: &Args, file: &File) -> Option<PathBuf> {
    args.admin_tls_cert.clone().or(file.admin_tls_cert.clone())
}

fn key(args: &Args, file: &File) -> Option<PathBuf> {
    args.admin_tls_key.clone().or(file.admin_tls_key.clone())
}

/// Refuses to serve the admin API (`admin`: a token is set) in clear on an
/// address other than loopback: its bearer token would cross the network
/// readable by anyone on the path. Metrics and health checks alone stay
/// plain (Prometheus and probes scrape them; they hold no secret).
pub(super) fn check(at: &Listener, admin: bool) -> Result<(), String> {
    match at.listen {
        Some(addr) if admin && at.tls.is_none() && !addr.ip().is_loopback() => Err(format!(
            "the admin API (--admin-token-file) would take its bearer token in clear on \
             {addr}: listen on a loopback address (127.0.0.1), or serve it over HTTPS with \
             --admin-tls-cert and --admin-tls-key"
        )),
        _ => Ok(()),
    }
}
