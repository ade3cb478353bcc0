//! A route's `max_in_flight`: a number, or `"auto"` (an adaptive limit,
//! tuned by the route's optional `auto_limit` table).
//!
//! ```toml
//! [[route]]
//! prefix = "/notify/wechat"
//! preset = "wechatpay-v3"
//! max_in_flight = "auto"
//! auto_limit = { min = 1, max = 40, initial = 20, tolerance = 2.0, backoff = 0.9 }
//! ```

use crate::settings::parse;
use crate::settings::spanned::SizeValue;
use idempotency_gateway::proxy::RouteOptions;
use idempotency_gateway::shed::AimdLimit;
use serde::Deserialize;

/// A route's `auto_limit` table: every key optional (the library's
/// defaults: min 1, max 200, initial 20, tolerance 2, backoff 0.9).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AutoLimit {
    min: Option<u64>,
    max: Option<u64>,
    initial: Option<u64>,
    latency_threshold: Option<String>,
    tolerance: Option<f64>,
    backoff: Option<f64>,
}

/// What `max_in_flight` says.
pub(crate) enum InFlight {
    Fixed(usize),
    Auto,
}

/// A route's `max_in_flight`: a whole number more than 0, or `"auto"`.
pub(crate) fn max_in_flight(v: &SizeValue) -> Result<InFlight, String> {
    const EXPECTED: &str = "expected a whole number more than 0 or \"auto\"";
    match v {
        SizeValue::Text(t) if t == "auto" => Ok(InFlight::Auto),
        SizeValue::Bytes(n) => parse::count(&n.to_string()).map(InFlight::Fixed),
        SizeValue::Text(t) => parse::count(t)
            .map(InFlight::Fixed)
            .map_err(|_| EXPECTED.into()),
    }
}

/// `options` with the route's cap: `auto_limit` only goes with
/// `max_in_flight = "auto"`.
pub(crate) fn apply(
    options: RouteOptions,
    in_flight: Option<InFlight>,
    auto: Option<&AutoLimit>,
) -> Result<RouteOptions, String> {
    match (in_flight, auto) {
        (Some(InFlight::Fixed(n)), None) => Ok(options.max_in_flight(n)),
        (Some(InFlight::Auto), auto) => Ok(options.adaptive_in_flight(aimd(auto)?)),
        (None, None) => Ok(options),
        (_, Some(_)) => Err("`auto_limit` tunes `max_in_flight = \"auto\"`; set that too".into()),
    }
}

/// The adaptive limit of an `auto_limit` table (defaults without one).
fn aimd(auto: Option<&AutoLimit>) -> Result<AimdLimit, String> {
    let mut limit = AimdLimit::new();
    let Some(a) = auto else {
        return Ok(limit);
    };
    let whole = |v: Option<u64>, key: &str| -> Result<Option<usize>, String> {
        v.map(|n| parse::count(&n.to_string()).map_err(|e| format!("`auto_limit.{key}`: {e}")))
            .transpose()
    };
    if let Some(min) = whole(a.min, "min")? {
        limit = limit.min(min);
    }
    if let Some(max) = whole(a.max, "max")? {
        limit = limit.max(max);
    }
    let (min, max) = (
        limit.get_min(),
        a.max.map_or(limit.get_max(), |m| m as usize),
    );
    if max < min {
        return Err(format!(
            "`auto_limit`: `max` ({max}) is below `min` ({min})"
        ));
    }
    let initial = match whole(a.initial, "initial")? {
        Some(i) if !(min..=max).contains(&i) => {
            return Err(format!(
                "`auto_limit.initial`: {i} must be from `min` ({min}) to `max` ({max})"
            ))
        }
        Some(i) => i,
        // The default 20, within min and max.
        None => 20.clamp(min, max),
    };
    limit = limit.initial(initial);
    match (&a.latency_threshold, a.tolerance) {
        (Some(_), Some(_)) => {
            return Err(
                "`auto_limit`: give `latency_threshold` (fixed) or `tolerance` (over the \
                 measured baseline), not both"
                    .into(),
            )
        }
        (Some(t), None) => {
            let t = parse::positive_duration(t)
                .map_err(|e| format!("`auto_limit.latency_threshold`: {e}"))?;
            limit = limit.latency_threshold(t);
        }
        (None, Some(t)) if !(t.is_finite() && t >= 1.0) => {
            return Err(format!(
                "`auto_limit.tolerance`: {t} must be a number of at least 1 (times the baseline)"
            ))
        }
        (None, Some(t)) => limit = limit.tolerance(t),
        (None, None) => {}
    }
    if let Some(b) = a.backoff {
        if !(0.5..1.0).contains(&b) {
            return Err(format!(
                "`auto_limit.backoff`: {b} must be at least 0.5 and less than 1"
            ));
        }
        limit = limit.backoff(b);
    }
    // What the checks above let through and no limit can work with (a
    // threshold of years).
    limit.validate().map_err(|e| format!("`auto_limit`: {e}"))?;
    Ok(limit)
}
