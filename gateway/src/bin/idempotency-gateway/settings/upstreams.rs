//! The config file's `[[upstreams]]` tables: named upstreams, each with its
//! own connection pool, call cap, error label and `/readyz` line; a route
//! names one with `upstream = "NAME"`.

use crate::settings::parse;
use crate::settings::spanned::{readable, At, Field};
use idempotency_gateway::proxy::{CallLimit, Forward, Upstream};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;
use toml::Spanned;

/// The named upstreams and their caps, once the gateway runs: `/readyz`
/// gives a line to each.
static RUNNING: std::sync::OnceLock<Vec<(String, Upstream, CallLimit)>> =
    std::sync::OnceLock::new();

/// Records the named upstreams for `/readyz` (once).
pub(crate) fn running(upstreams: &[Named], calls: &[CallLimit]) {
    let list = upstreams
        .iter()
        .zip(calls)
        .map(|(u, c)| (u.name.clone(), u.upstream.clone(), c.clone()))
        .collect();
    let _ = RUNNING.set(list);
}

/// One `/readyz` line per named upstream: its calls in flight and its cap
/// (empty without named upstreams).
pub(crate) fn ready_lines() -> String {
    let mut out = String::new();
    for (name, upstream, calls) in RUNNING.get().into_iter().flatten() {
        out.push_str(&format!(
            "upstream {name} ({upstream}): {} of {} calls in flight\n",
            calls.in_flight(),
            calls.max()
        ));
    }
    out
}

/// One `[[upstreams]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileUpstream {
    name: Spanned<String>,
    url: Spanned<String>,
    timeout: Field,
    max_calls: Option<Spanned<u64>>,
    ca: Option<Spanned<PathBuf>>,
    pool_idle_timeout: Field,
    /// Whether connections are kept between calls (`upstream_keepalive`
    /// for this upstream alone).
    #[serde(alias = "upstream_keepalive")]
    keepalive: Option<bool>,
}

/// A named upstream as the gateway runs it.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub(crate) name: String,
    pub(crate) upstream: Upstream,
    /// Unset: the global `upstream_timeout`.
    pub(crate) timeout: Option<Duration>,
    /// Unset: the global `max_upstream_calls`.
    pub(crate) max_calls: Option<usize>,
    pub(crate) ca: Option<PathBuf>,
    pub(crate) pool_idle_timeout: Option<Duration>,
    /// Unset: the global `upstream_keepalive`.
    pub(crate) keepalive: Option<bool>,
}

/// Reads every `[[upstreams]]` table (`ca` relative to `base`); an error
/// names its line.
pub(crate) fn from_file(
    tables: &[Spanned<FileUpstream>],
    at: &At<'_>,
    base: &std::path::Path,
) -> Result<Vec<Named>, String> {
    let mut out: Vec<Named> = Vec::new();
    for t in tables {
        let t = t.get_ref();
        let name = t.name.get_ref();
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(at.err(
                t.name.span(),
                format!("upstream name {name:?}: use letters, digits, `-` and `_`"),
            ));
        }
        if name == idempotency_gateway::proxy::DEFAULT_UPSTREAM_NAME
            || out.iter().any(|u| &u.name == name)
        {
            return Err(at.err(t.name.span(), format!("upstream `{name}` is defined twice")));
        }
        let upstream = parse::upstream(t.url.get_ref())
            .map_err(|e| at.err(t.url.span(), format!("`url`: {e}")))?;
        out.push(Named {
            name: name.clone(),
            upstream,
            timeout: at.value(&t.timeout, "timeout", parse::positive_duration)?,
            max_calls: at.value(&t.max_calls, "max_calls", parse::count)?,
            ca: match &t.ca {
                Some(ca) => Some(
                    readable(crate::settings::config::CA)(&base.join(ca.get_ref()))
                        .map_err(|e| at.err(ca.span(), format!("`ca`: {e}")))?,
                ),
                None => None,
            },
            pool_idle_timeout: at.value(
                &t.pool_idle_timeout,
                "pool_idle_timeout",
                parse::duration,
            )?,
            keepalive: t.keepalive,
        });
    }
    Ok(out)
}

impl Named {
    /// The upstream's call cap (its own, shared by every serving thread).
    pub(crate) fn calls(&self, default_max: usize, queue_wait: Duration) -> CallLimit {
        CallLimit::new(self.max_calls.unwrap_or(default_max)).queue_wait(queue_wait)
    }

    /// A forwarder to this upstream (its own pool) under `calls`; the
    /// global `timeout` and `keepalive` where the table sets none.
    pub(crate) fn forward(
        &self,
        default_timeout: Duration,
        default_keepalive: bool,
        accept_traceparent: bool,
        calls: Option<&CallLimit>,
    ) -> Result<Forward, String> {
        let mut builder = Forward::builder(self.upstream.clone())
            .name(self.name.clone())
            .timeout(self.timeout.unwrap_or(default_timeout))
            .upstream_keepalive(self.keepalive.unwrap_or(default_keepalive))
            .accept_traceparent(accept_traceparent);
        if let Some(idle) = self.pool_idle_timeout {
            builder = builder.pool_idle_timeout(idle);
        }
        if let Some(calls) = calls {
            builder = builder.call_limit(calls.clone());
        }
        if let Some(ca) = &self.ca {
            let pem =
                std::fs::read(ca).map_err(|e| format!("cannot read {}: {e}", ca.display()))?;
            builder = builder
                .add_root_certificates_pem(&pem)
                .map_err(|e| format!("{}: {e}", ca.display()))?;
        }
        Ok(builder.build())
    }
}
