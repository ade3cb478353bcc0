//! The upstream and the calls to it: `upstream`, `upstream_timeout`,
//! `upstream_ca`, `upstream_keepalive`, `accept_traceparent`,
//! `max_upstream_calls`, `queue_wait`, and the `[[upstreams]]` tables.

use super::File;
use crate::settings::cli::Args;
use crate::settings::parse;
use crate::settings::spanned::{readable, At};
use crate::settings::upstreams::Named;
use idempotency_gateway::proxy::Upstream;
use std::path::PathBuf;
use std::time::Duration;

/// The upstream, how it is called, and the named upstreams.
#[derive(Debug)]
pub(crate) struct UpstreamSettings {
    pub(crate) url: Upstream,
    pub(crate) timeout: Duration,
    pub(crate) ca: Option<PathBuf>,
    /// Whether connections to the upstream are kept (`--upstream-keepalive`).
    pub(crate) keepalive: bool,
    /// Whether a client's `traceparent` is followed (`--accept-traceparent`).
    pub(crate) accept_traceparent: bool,
    pub(crate) max_calls: usize,
    /// How long a guarded request waits for an upstream slot before it is shed.
    pub(crate) queue_wait: Duration,
    /// The named upstreams (`[[upstreams]]`).
    pub(crate) named: Vec<Named>,
}

/// The upstream settings (`url` read by the caller: it is required).
pub(super) fn settings(
    args: &Args,
    file: &File,
    at: &At<'_>,
    url: Upstream,
    named: Vec<Named>,
) -> Result<UpstreamSettings, String> {
    Ok(UpstreamSettings {
        url,
        timeout: at
            .pick(
                args.upstream_timeout,
                &file.upstream_timeout,
                "upstream_timeout",
                parse::positive_duration,
            )?
            .unwrap_or(Duration::from_secs(30)),
        ca: at.file(
            args.upstream_ca.as_deref(),
            &file.upstream_ca,
            "upstream_ca",
            readable(super::CA),
        )?,
        keepalive: args
            .upstream_keepalive
            .or(file.upstream_keepalive)
            .unwrap_or(true),
        accept_traceparent: args.accept_traceparent || file.accept_traceparent.unwrap_or(false),
        max_calls: at
            .pick(
                args.max_upstream_calls,
                &file.max_upstream_calls,
                "max_upstream_calls",
                parse::count,
            )?
            .unwrap_or(idempotency_gateway::proxy::DEFAULT_MAX_UPSTREAM_CALLS),
        queue_wait: at
            .pick(
                args.queue_wait,
                &file.queue_wait,
                "queue_wait",
                parse::duration,
            )?
            .unwrap_or(idempotency_gateway::shed::DEFAULT_QUEUE_WAIT),
        named,
    })
}
