//! A route's `deliver` list: the named upstreams an ack-then-deliver route
//! delivers each notification to, each on its own, with the filter that
//! says which notifications each wants and its own pace.

use crate::settings::pace::{self, Keys};
use crate::settings::spanned::At;
use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;
use tower_idempotency::key::Field;
use tower_idempotency_queue::Pace;

/// One destination of a route's `deliver` list: a named upstream, which
/// notifications it wants (`only`: a source as a preset's key names it,
/// and the values it accepts), and its own pace over the route's.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileDestination {
    upstream: Spanned<String>,
    only: Option<Spanned<BTreeMap<String, Spanned<Vec<String>>>>>,
    deliver_concurrency: Option<Spanned<toml::Value>>,
    deliver_rate: Option<Spanned<toml::Value>>,
    retry_schedule: Option<Spanned<toml::Value>>,
    breaker_failures: Option<Spanned<toml::Value>>,
    breaker_cooldown: Option<Spanned<toml::Value>>,
}

/// A destination of a route, as the gateway runs it.
#[derive(Debug, Clone)]
pub(crate) struct RouteDestination {
    /// The named upstream.
    pub(crate) upstream: String,
    /// The fields it filters on and the values each accepts (all must hold).
    pub(crate) only: Vec<(Field, Vec<String>)>,
    /// Its deliveries' pace: its own keys over the route's.
    pub(crate) pace: Pace,
}

/// What the route's own table says where a destination says nothing.
pub(crate) struct RouteKeys<'a> {
    pub(crate) prefix: &'a str,
    /// Whether the route acknowledges, then delivers.
    pub(crate) acked: bool,
    /// The route's own `upstream`, when it names one.
    pub(crate) upstream: Option<&'a Spanned<String>>,
    pub(crate) pace: Keys<'a>,
}

/// Reads a route's `deliver` list; `known` checks each upstream's name.
pub(crate) fn from_file(
    deliver: &Spanned<Vec<Spanned<FileDestination>>>,
    route: &RouteKeys<'_>,
    at: &At<'_>,
    known: impl Fn(&Spanned<String>) -> Result<String, String>,
) -> Result<Vec<RouteDestination>, String> {
    let prefix = route.prefix;
    if !route.acked {
        return Err(at.err(
            deliver.span(),
            format!(
                "`deliver`: route `{prefix}` answers synchronously, from its one upstream; only an ack-then-deliver route (mode = \"ack-then-deliver\") delivers to several destinations, each from the queue"
            ),
        ));
    }
    if let Some(u) = route.upstream {
        return Err(at.err(
            u.span(),
            format!("route `{prefix}`: `upstream` and `deliver` both say where it delivers; list every destination in `deliver`"),
        ));
    }
    if deliver.get_ref().is_empty() {
        return Err(at.err(deliver.span(), "`deliver`: give at least one destination"));
    }
    let mut list: Vec<RouteDestination> = Vec::new();
    for d in deliver.get_ref() {
        let d = d.get_ref();
        let name = known(&d.upstream)?;
        if list.iter().any(|l| l.upstream == name) {
            return Err(at.err(
                d.upstream.span(),
                format!("`deliver`: upstream `{name}` is listed twice"),
            ));
        }
        let own = Keys {
            deliver_concurrency: d
                .deliver_concurrency
                .as_ref()
                .map_or(route.pace.deliver_concurrency, |_| &d.deliver_concurrency),
            deliver_rate: d
                .deliver_rate
                .as_ref()
                .map_or(route.pace.deliver_rate, |_| &d.deliver_rate),
            retry_schedule: d
                .retry_schedule
                .as_ref()
                .map_or(route.pace.retry_schedule, |_| &d.retry_schedule),
            breaker_failures: d
                .breaker_failures
                .as_ref()
                .map_or(route.pace.breaker_failures, |_| &d.breaker_failures),
            breaker_cooldown: d
                .breaker_cooldown
                .as_ref()
                .map_or(route.pace.breaker_cooldown, |_| &d.breaker_cooldown),
        };
        let mut only = Vec::new();
        if let Some(table) = &d.only {
            for (source, values) in table.get_ref() {
                let field = source
                    .parse::<Field>()
                    .map_err(|e| at.err(table.span(), format!("`only`: {}", e.message())))?;
                if values.get_ref().is_empty() {
                    return Err(at.err(
                        values.span(),
                        format!("`only`: `{source}` accepts no value: list the values it accepts"),
                    ));
                }
                only.push((field, values.get_ref().clone()));
            }
        }
        list.push(RouteDestination {
            upstream: name,
            only,
            pace: pace::route(at, &own)?,
        });
    }
    Ok(list)
}
