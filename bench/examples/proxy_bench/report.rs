//! The `load` subcommand's result line: latency order statistics and the
//! key=value (or JSON) line it prints.

use std::collections::BTreeMap;

/// p50, p90, p99, p99.9 and max of `us` (microseconds), in milliseconds:
/// exact order statistics of every sample (nothing is bucketed).
pub(crate) fn percentiles(us: &mut [u32]) -> [f64; 5] {
    us.sort_unstable();
    let at = |p: f64| -> f64 {
        if us.is_empty() {
            return f64::NAN;
        }
        let i = ((us.len() as f64 * p).ceil() as usize).clamp(1, us.len()) - 1;
        us[i] as f64 / 1000.0
    };
    [at(0.50), at(0.90), at(0.99), at(0.999), at(1.0)]
}

pub(crate) struct Report {
    pub(crate) mode: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) copies: usize,
    pub(crate) requests: usize,
    pub(crate) connections: usize,
    pub(crate) rate: Option<f64>,
    pub(crate) seconds: f64,
    pub(crate) lat: [f64; 5],
    pub(crate) pacer_p99_ms: Option<f64>,
    pub(crate) upstream_hits: u64,
    pub(crate) errors: usize,
    pub(crate) failures: BTreeMap<String, usize>,
    /// The upstream's `/__keys` line for this run's ids.
    pub(crate) per_key: Option<String>,
}

impl Report {
    pub(crate) fn print(&self, json: bool) {
        let rps = self.requests as f64 / self.seconds.max(f64::MIN_POSITIVE);
        let [p50, p90, p99, p999, max] = self.lat;
        let mut fields: Vec<(&str, String)> = [
            ("mode", self.mode.to_owned()),
            ("kind", self.kind.to_owned()),
            ("copies", self.copies.to_string()),
            ("requests", self.requests.to_string()),
            ("connections", self.connections.to_string()),
            (
                "rate",
                self.rate.map_or("closed".into(), |r| format!("{r:.0}")),
            ),
            ("seconds", format!("{:.3}", self.seconds)),
            ("rps", format!("{rps:.0}")),
            ("p50_ms", format!("{p50:.3}")),
            ("p90_ms", format!("{p90:.3}")),
            ("p99_ms", format!("{p99:.3}")),
            ("p999_ms", format!("{p999:.3}")),
            ("max_ms", format!("{max:.3}")),
            (
                "pacer_p99_ms",
                self.pacer_p99_ms.map_or("-".into(), |p| format!("{p:.3}")),
            ),
            ("upstream_hits", self.upstream_hits.to_string()),
            ("errors", self.errors.to_string()),
        ]
        .into();
        let failures: Vec<String> = self
            .failures
            .iter()
            .map(|(k, n)| format!("{k}:{n}"))
            .collect();
        fields.push((
            "failures",
            if failures.is_empty() {
                "-".to_owned()
            } else {
                failures.join(",")
            },
        ));
        if let Some(line) = &self.per_key {
            // keys=K total=T max=M dist=...: the executed keys, the most
            // executions of one key, and the distribution.
            for kv in line.split_whitespace() {
                match kv.split_once('=') {
                    Some(("keys", v)) => fields.push(("keys_executed", v.to_owned())),
                    Some(("max", v)) => fields.push(("key_max", v.to_owned())),
                    Some(("dist", v)) => fields.push(("key_dist", v.to_owned())),
                    _ => {}
                }
            }
        }
        if json {
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| match v.parse::<f64>() {
                    Ok(_) => format!(r#""{k}":{v}"#),
                    Err(_) => format!(r#""{k}":"{v}""#),
                })
                .collect();
            println!("{{{}}}", body.join(","));
        } else {
            let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("{}", line.join(" "));
        }
    }
}
