//! How an ack-then-deliver route paces its deliveries: the route's
//! `deliver_concurrency`, `deliver_rate`, `retry_schedule`,
//! `breaker_failures` and `breaker_cooldown`.

use crate::settings::parse;
use crate::settings::spanned::At;
use std::time::Duration;
use toml::Spanned;
use tower_idempotency_queue::{Pace, Rate};

/// `deliver_concurrency` when a route does not set it.
pub(crate) const DEFAULT_DELIVER_CONCURRENCY: usize = 16;
/// `breaker_failures` when a route does not set it.
pub(crate) const DEFAULT_BREAKER_FAILURES: u32 = 10;
/// `breaker_cooldown` when a route does not set it.
pub(crate) const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(30);

/// A route's pacing keys as written (any TOML type: a wrong one is
/// refused here, naming the key).
pub(crate) struct Keys<'a> {
    pub(crate) deliver_concurrency: &'a Option<Spanned<toml::Value>>,
    pub(crate) deliver_rate: &'a Option<Spanned<toml::Value>>,
    pub(crate) retry_schedule: &'a Option<Spanned<toml::Value>>,
    pub(crate) breaker_failures: &'a Option<Spanned<toml::Value>>,
    pub(crate) breaker_cooldown: &'a Option<Spanned<toml::Value>>,
}

/// The pace of a route that sets none of the keys.
pub(crate) fn default_pace() -> Pace {
    Pace::new()
        .concurrency(DEFAULT_DELIVER_CONCURRENCY)
        .breaker(DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_COOLDOWN)
}

/// The most deliveries one route may run at once: far past what an
/// upstream bears, and small enough that the worker's fetch (the routes'
/// sum) stays a sane number.
pub(crate) const MAX_DELIVER_CONCURRENCY: usize = 65_536;

/// The route's pace; an error names the key and its line.
pub(crate) fn route(at: &At<'_>, keys: &Keys<'_>) -> Result<Pace, String> {
    let concurrency = at
        .checked(keys.deliver_concurrency, "deliver_concurrency", |v| {
            let n = whole(v, "expected a whole number more than 0")?;
            usize::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_DELIVER_CONCURRENCY)
                .ok_or_else(|| {
                    format!("expected a whole number from 1 to {MAX_DELIVER_CONCURRENCY}")
                })
        })?
        .unwrap_or(DEFAULT_DELIVER_CONCURRENCY);
    let failures = at
        .checked(keys.breaker_failures, "breaker_failures", |v| {
            let n = whole(v, "expected a whole number from 1 to 4294967295")?;
            u32::try_from(n).map_err(|_| "expected a whole number from 1 to 4294967295".to_owned())
        })?
        .unwrap_or(DEFAULT_BREAKER_FAILURES);
    let cooldown = at
        .checked(keys.breaker_cooldown, "breaker_cooldown", |v| {
            parse::positive_duration(text(v, "a duration such as \"30s\"")?)
        })?
        .unwrap_or(DEFAULT_BREAKER_COOLDOWN);
    let mut pace = Pace::new()
        .concurrency(concurrency)
        .breaker(failures, cooldown);
    let rate = at.checked(keys.deliver_rate, "deliver_rate", |v| {
        text(v, "a rate such as \"200/s\"")?.parse::<Rate>()
    })?;
    if let Some(rate) = rate {
        pace = pace.rate(rate);
    }
    if let Some(delays) = at.checked(keys.retry_schedule, "retry_schedule", schedule)? {
        pace = pace.retry_schedule(delays);
    }
    Ok(pace)
}

/// A whole number more than 0 (`why` otherwise).
fn whole(v: &toml::Value, why: &str) -> Result<u64, String> {
    v.as_integer()
        .and_then(|n| u64::try_from(n).ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| why.to_owned())
}

/// A string (`expected` otherwise).
fn text<'v>(v: &'v toml::Value, expected: &str) -> Result<&'v str, String> {
    v.as_str().ok_or_else(|| format!("expected {expected}"))
}

/// `retry_schedule`: a non-empty list of durations, each more than 0.
fn schedule(value: &toml::Value) -> Result<Vec<Duration>, String> {
    const LIST: &str = "expected a list of delays, e.g. [\"15s\", \"30s\", \"3m\"]";
    let delays = value.as_array().ok_or(LIST)?;
    if delays.is_empty() {
        return Err("expected at least one delay, e.g. [\"15s\", \"30s\", \"3m\"]".into());
    }
    delays
        .iter()
        .map(|d| {
            let d = d.as_str().ok_or(LIST)?;
            parse::positive_duration(d).map_err(|e| format!("`{d}`: {e}"))
        })
        .collect()
}

/// How the route paces its deliveries, for the start line.
pub(crate) fn describe(pace: &Pace) -> String {
    let mut parts = vec![format!(
        "deliver_concurrency={}",
        pace.get_concurrency().unwrap_or(0)
    )];
    if let Some(rate) = pace.get_rate() {
        parts.push(format!("deliver_rate={rate}"));
    }
    if let Some(schedule) = pace.get_retry_schedule() {
        let delays: Vec<String> = schedule
            .iter()
            .map(|d| humantime::format_duration(*d).to_string())
            .collect();
        parts.push(format!("retry_schedule=[{}]", delays.join(",")));
    }
    if let Some((failures, cooldown)) = pace.get_breaker() {
        parts.push(format!(
            "breaker_failures={failures} breaker_cooldown={}",
            humantime::format_duration(cooldown)
        ));
    }
    parts.join(" ")
}

/// `pace` with its `deliver_concurrency` brought down to the route's own
/// `max_in_flight` (the most an `"auto"` limit may give), with a warning:
/// deliveries past it would only be shed by the gateway itself.
fn clamped(prefix: &str, pace: Pace, options: &idempotency_gateway::proxy::RouteOptions) -> Pace {
    let cap = options.get_max_in_flight().or_else(|| {
        options
            .get_adaptive_in_flight()
            .map(|limit| limit.get_max())
    });
    match (pace.get_concurrency(), cap) {
        (Some(n), Some(cap)) if n > cap => {
            tracing::warn!(
                route = %prefix,
                deliver_concurrency = n,
                max_in_flight = cap,
                "`deliver_concurrency` is above the route's `max_in_flight`: lowered to it (deliveries past it would only be shed by the gateway)"
            );
            pace.concurrency(cap)
        }
        _ => pace,
    }
}

/// The pace of every ack-then-deliver route (its own keys, or the
/// defaults for a route of the flags), by prefix; `None` for the others.
pub(crate) fn lanes(
    routes: &[crate::settings::routes::RouteSettings],
) -> Vec<(String, Option<Pace>)> {
    routes
        .iter()
        .map(|r| {
            let pace = r.options.is_ack_then_deliver().then(|| {
                let pace = r.pace.clone().unwrap_or_else(default_pace);
                clamped(&r.prefix, pace, &r.options)
            });
            (r.prefix.clone(), pace)
        })
        .collect()
}
