//! The gateway's own request counters, sampled in memory every 5 seconds
//! for the last hour (per instance), for the console's charts: `GET
//! /admin/stats`.

use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// How often the counters are read.
const EVERY: Duration = Duration::from_secs(5);
/// Samples kept: one hour.
const KEPT: usize = 720;

/// One reading: when, `idempotency_requests_total` by outcome, and
/// `idempotency_duplicate_ratio` by preset.
type Sample = (u64, Read);

/// What one `/metrics` text says that the console shows.
#[derive(Debug, Default, PartialEq)]
struct Read {
    /// `idempotency_requests_total`, summed by outcome.
    requests: BTreeMap<String, f64>,
    /// `idempotency_duplicate_ratio` by preset (the gauge's own window).
    duplicate_ratio: BTreeMap<String, f64>,
}

/// The samples, shared by the sampler and the admin API.
#[derive(Clone, Default)]
pub(crate) struct Samples(Arc<Mutex<VecDeque<Sample>>>);

/// The value of label `name` (`name="X"`) of a series' labels.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let rest = &labels[at..];
    Some(&rest[..rest.find('"')?])
}

/// `idempotency_requests_total` by outcome and `idempotency_duplicate_ratio`
/// by preset in a `/metrics` text.
fn read(text: &str) -> Read {
    let mut out = Read::default();
    for line in text.lines() {
        let (series, by, into) =
            if let Some(rest) = line.strip_prefix("idempotency_requests_total{") {
                (rest, "outcome", &mut out.requests)
            } else if let Some(rest) = line.strip_prefix("idempotency_duplicate_ratio{") {
                (rest, "preset", &mut out.duplicate_ratio)
            } else {
                continue;
            };
        let Some((labels, value)) = series.rsplit_once("} ") else {
            continue;
        };
        if let (Some(o), Ok(v)) = (label(labels, by), value.trim().parse::<f64>()) {
            *into.entry(o.to_owned()).or_default() += v;
        }
    }
    out
}

impl Samples {
    /// Reads `handle`'s counters every 5 seconds, for as long as the
    /// process runs.
    pub(crate) fn spawn(&self, handle: PrometheusHandle) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            loop {
                tick.tick().await;
                let at = crate::admin::dead::ms_of(SystemTime::now());
                let counts = read(&handle.render());
                let mut kept = this.0.lock().unwrap_or_else(|p| p.into_inner());
                if kept.len() == KEPT {
                    kept.pop_front();
                }
                kept.push_back((at, counts));
            }
        });
    }

    /// The samples as `GET /admin/stats` answers them.
    pub(crate) fn json(&self) -> Value {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let samples: Vec<Value> = kept
            .iter()
            .map(|(at, read)| {
                json!({
                    "at_ms": at,
                    "requests": read.requests,
                    "duplicate_ratio": read.duplicate_ratio,
                })
            })
            .collect();
        json!({ "interval_ms": EVERY.as_millis() as u64, "samples": samples })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn requests_by_outcome() {
        let text = "# TYPE idempotency_requests_total counter\n\
            idempotency_requests_total{preset=\"stripe\",outcome=\"executed\"} 10\n\
            idempotency_requests_total{preset=\"wechatpay-v3\",outcome=\"executed\"} 5\n\
            idempotency_requests_total{outcome=\"replayed\",preset=\"stripe\"} 2\n\
            idempotency_requests_in_flight 3\n\
            # TYPE idempotency_duplicate_ratio gauge\n\
            idempotency_duplicate_ratio{preset=\"stripe\"} 0.25\n\
            idempotency_duplicate_ratio{preset=\"wechatpay-v3\"} 0\n";
        let got = super::read(text);
        assert_eq!(got.requests.get("executed"), Some(&15.0));
        assert_eq!(got.requests.get("replayed"), Some(&2.0));
        assert_eq!(got.requests.len(), 2);
        assert_eq!(got.duplicate_ratio.get("stripe"), Some(&0.25));
        assert_eq!(got.duplicate_ratio.get("wechatpay-v3"), Some(&0.0));
        assert_eq!(got.duplicate_ratio.len(), 2);
    }
}
