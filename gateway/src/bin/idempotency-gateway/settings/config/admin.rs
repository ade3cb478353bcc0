//! The admin listener's settings (metrics, health, the admin API and the
//! console): `admin_listen` (`metrics_listen` its older name),
//! `admin_tls_cert`, `admin_tls_key`, and the rule that the admin API's
//! bearer token never crosses the network in clear.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse;
use crate::settings::spanned::{readable, At};
use std::net::SocketAddr;
use std::path::PathBuf;

/// The admin listener: metrics, health, the admin API and the console.
#[derive(Debug, Clone, Default)]
pub(crate) struct AdminSettings {
    pub(crate) listen: Option<SocketAddr>,
    /// `--admin-tls-cert` and `--admin-tls-key`: the listener speaks HTTPS.
    pub(crate) tls: Option<(PathBuf, PathBuf)>,
    /// The admin API's bearer token, when it is on.
    pub(crate) token: Option<String>,
}

/// The listener's address, TLS pair and token from the flags and the
/// config file.
pub(super) fn settings(args: &Args, file: &File, at: &At<'_>) -> Result<AdminSettings, String> {
    let token = at.file(
        args.admin_token_file.as_deref(),
        &file.admin_token_file,
        "admin_token_file",
        crate::admin::listener::read_token,
    )?;
    let listen = listen(args, file, at)?;
    let tls = match (
        at.file(
            args.admin_tls_cert.as_deref(),
            &file.admin_tls_cert,
            "admin_tls_cert",
            readable(super::CERT),
        )?,
        at.file(
            args.admin_tls_key.as_deref(),
            &file.admin_tls_key,
            "admin_tls_key",
            readable(super::KEY),
        )?,
    ) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("`--admin-tls-cert` and `--admin-tls-key` go together".into()),
    };
    if tls.is_some() && listen.is_none() {
        return Err("`--admin-tls-cert` needs --admin-listen (the listener it serves)".into());
    }
    let admin = AdminSettings { listen, tls, token };
    check(&admin)?;
    Ok(admin)
}

/// `admin_listen`: `--admin-listen` (or `--metrics-listen`), its
/// environment variable (`IDEMPOTENCY_GATEWAY_ADMIN_LISTEN`, or the older
/// `IDEMPOTENCY_GATEWAY_METRICS_LISTEN`), or the file's `admin_listen` (or
/// `metrics_listen`).
pub(super) fn listen(args: &Args, file: &File, at: &At<'_>) -> Result<Option<SocketAddr>, String> {
    let older = match std::env::var(OLDER_ENV) {
        Ok(v) => Some(parse::addr(&v).map_err(|e| format!("{OLDER_ENV}: {e}"))?),
        Err(_) => None,
    };
    let flag = args.metrics_listen.or(older);
    at.pick(flag, &file.admin_listen, "admin_listen", parse::addr)
}

/// The environment variable of `--admin-listen` under its older name.
const OLDER_ENV: &str = "IDEMPOTENCY_GATEWAY_METRICS_LISTEN";

/// `admin_tls_cert` (the admin commands trust it to speak HTTPS).
pub(super) fn cert(args: &Args, file: &File) -> Option<PathBuf> {
    (args.admin_tls_cert.clone()).or(file.admin_tls_cert.as_ref().map(|v| v.get_ref().clone()))
}

/// Refuses to serve the admin API (a token is set) in clear on an
/// address other than loopback: its bearer token would cross the network
/// readable by anyone on the path. Metrics and health checks alone stay
/// plain (Prometheus and probes scrape them; they hold no secret).
fn check(at: &AdminSettings) -> Result<(), String> {
    match at.listen {
        Some(addr) if at.token.is_some() && at.tls.is_none() && !addr.ip().is_loopback() => {
            Err(format!(
                "the admin API (--admin-token-file) would take its bearer token in clear on \
             {addr}: listen on a loopback address (127.0.0.1), or serve it over HTTPS with \
             --admin-tls-cert and --admin-tls-key"
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use crate::settings::cli::Args;
    use crate::settings::config;
    use clap::Parser as _;

    fn listen(argv: &[&str]) -> Result<Option<std::net::SocketAddr>, String> {
        let mut all = vec![
            "idempotency-gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ];
        all.extend_from_slice(argv);
        let args = Args::try_parse_from(all).map_err(|e| e.to_string())?;
        config::settings(args).map(|s| s.admin.listen)
    }

    /// `--admin-listen` and `admin_listen`, and their older names
    /// `--metrics-listen` and `metrics_listen`, set the same listener.
    #[test]
    fn the_admin_listener_by_its_name_and_its_older_one() {
        let want = Some("127.0.0.1:9101".parse().unwrap());
        assert_eq!(listen(&["--admin-listen", "127.0.0.1:9101"]), Ok(want));
        assert_eq!(listen(&["--metrics-listen", "127.0.0.1:9101"]), Ok(want));
        assert_eq!(listen(&[]), Ok(None));
        let dir = std::env::temp_dir();
        for key in ["admin_listen", "metrics_listen"] {
            let file = dir.join(format!("gateway-{key}-{}.toml", std::process::id()));
            std::fs::write(&file, format!("{key} = \"127.0.0.1:9101\"\n")).unwrap();
            let got = listen(&["--config", file.to_str().unwrap()]);
            std::fs::remove_file(&file).unwrap();
            assert_eq!(got, Ok(want), "{key}");
        }
        let both = dir.join(format!("gateway-both-{}.toml", std::process::id()));
        std::fs::write(
            &both,
            "admin_listen = \"127.0.0.1:9101\"\nmetrics_listen = \"127.0.0.1:9102\"\n",
        )
        .unwrap();
        let got = listen(&["--config", both.to_str().unwrap()]);
        std::fs::remove_file(&both).unwrap();
        assert!(got.is_err(), "both names at once: {got:?}");
    }
}
