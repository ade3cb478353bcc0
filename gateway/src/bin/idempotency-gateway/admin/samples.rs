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

/// One reading: when, and `idempotency_requests_total` by outcome.
type Sample = (u64, BTreeMap<String, f64>);

/// The samples, shared by the sampler and the admin API.
#[derive(Clone, Default)]
pub(crate) struct Samples(Arc<Mutex<VecDeque<Sample>>>);

/// `outcome="X"` of a series' labels.
fn outcome(labels: &str) -> Option<&str> {
    let at = labels.find("outcome=\"")? + "outcome=\"".len();
    let rest = &labels[at..];
    Some(&rest[..rest.find('"')?])
}

/// `idempotency_requests_total` by outcome in a `/metrics` text.
fn read(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("idempotency_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        if let (Some(o), Ok(v)) = (outcome(labels), value.trim().parse::<f64>()) {
            *out.entry(o.to_owned()).or_default() += v;
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
            .map(|(at, counts)| json!({ "at_ms": at, "requests": counts }))
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
            idempotency_requests_in_flight 3\n";
        let got = super::read(text);
        assert_eq!(got.get("executed"), Some(&15.0));
        assert_eq!(got.get("replayed"), Some(&2.0));
        assert_eq!(got.len(), 2);
    }
}
