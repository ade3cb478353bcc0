//! `idempotency-gateway pause PREFIX [--reason TEXT]` and `idempotency-gateway resume PREFIX`:
//! clients of the running gateway's admin API (`POST
//! /admin/routes/pause?prefix=…`, `…/resume?prefix=…`).

use crate::commands::client::{call, query, AdminAt, Format, Target};
use crate::commands::escape::shown;
use clap::Args;
use http::Method;
use std::io::Write;
use std::path::Path;

/// `idempotency-gateway pause PREFIX`.
#[derive(Args, Debug, Clone)]
pub(crate) struct Pause {
    /// The route's prefix, as configured (`/notify/wechat`)
    prefix: String,
    /// Only this destination of the route (an upstream its `deliver` names):
    /// its deliveries wait, the route's others go on
    #[arg(long, value_name = "NAME")]
    upstream: Option<String>,
    /// Why, shown by `GET /admin/routes` and the console
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
    /// Who pauses it (default: $USER@hostname)
    #[arg(long, value_name = "NAME")]
    by: Option<String>,
    #[command(flatten)]
    target: Target,
}

/// `idempotency-gateway resume PREFIX`.
#[derive(Args, Debug, Clone)]
pub(crate) struct Resume {
    /// The route's prefix, as configured
    prefix: String,
    /// Only this destination of the route
    #[arg(long, value_name = "NAME")]
    upstream: Option<String>,
    #[command(flatten)]
    target: Target,
}

/// Runs `pause` or `resume`; `Err` is the message for exit status 1.
pub(crate) fn run(
    cmd: &crate::commands::dlq::Command,
    token_file: &Path,
    at: &AdminAt,
) -> Result<(), String> {
    let token = crate::admin::listener::read_token(token_file)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let (path, target, word, prefix) = match cmd {
        crate::commands::dlq::Command::Pause(p) => {
            let by =
                p.by.clone()
                    .unwrap_or_else(crate::commands::client::default_by);
            let pairs = [
                ("prefix", Some(p.prefix.as_str())),
                ("upstream", p.upstream.as_deref()),
                ("by", Some(by.as_str())),
                ("reason", p.reason.as_deref()),
            ];
            let path = format!("/admin/routes/pause?{}", query(&pairs));
            (path, &p.target, "paused", &p.prefix)
        }
        crate::commands::dlq::Command::Resume(r) => {
            let path = format!(
                "/admin/routes/resume?{}",
                query(&[
                    ("prefix", Some(r.prefix.as_str())),
                    ("upstream", r.upstream.as_deref())
                ])
            );
            (path, &r.target, "resumed", &r.prefix)
        }
        _ => return Err("not pause or resume".into()),
    };
    let base = target.resolve(at);
    let (status, json) = rt.block_on(call(&base, &token, Method::POST, &path))?;
    if status != 200 {
        let message = json["error"]
            .as_str()
            .map_or_else(|| json.to_string(), str::to_owned);
        return Err(format!("the admin API answered {status}: {message}"));
    }
    let mut out = std::io::stdout().lock();
    let written = if target.format == Format::Json {
        writeln!(out, "{json}")
    } else {
        writeln!(out, "{word} {}", shown(prefix))
    };
    written.map_err(|e| format!("cannot write to stdout: {e}"))
}
