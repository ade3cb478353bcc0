//! The access log line and the duplicate-ratio gauge, read from what the
//! library put in each response's extensions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tower_idempotency::channel::PRESET_NAMES;
use tower_idempotency::proxy::{GatewayResponse, RoutedPreset};
use tower_idempotency::Outcome;
use tracing::info;

/// Guarded requests and duplicates per preset, since the start: one pair of
/// counters per built-in preset and one for the rest, so that no request
/// waits on a lock for them.
pub struct Ratios {
    by_preset: Vec<(AtomicU64, AtomicU64)>,
}

impl Default for Ratios {
    fn default() -> Self {
        let by_preset = (0..=PRESET_NAMES.len()).map(|_| Default::default());
        Self {
            by_preset: by_preset.collect(),
        }
    }
}

impl Ratios {
    /// Updates the gauge for `res` and logs its access line, given the
    /// request's method, path and start when access lines are logged.
    pub fn record(&self, line: Option<(http::Method, String, Instant)>, res: &GatewayResponse) {
        let outcome = res.extensions().get::<Outcome>().copied();
        let preset = res.extensions().get::<RoutedPreset>().map(|p| p.0);
        if let (Some(preset), Some(outcome)) = (preset, outcome) {
            let at = PRESET_NAMES.iter().position(|n| *n == preset);
            let (guarded, duplicates) = &self.by_preset[at.unwrap_or(PRESET_NAMES.len())];
            let guarded = guarded.fetch_add(1, Ordering::Relaxed) + 1;
            let duplicates = if outcome.is_duplicate() {
                duplicates.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                duplicates.load(Ordering::Relaxed)
            };
            metrics::gauge!("idempotency_duplicate_ratio", "preset" => preset)
                .set(duplicates as f64 / guarded as f64);
        }
        let Some((method, path, started)) = line else {
            return;
        };
        info!(
            target: "gateway::access",
            %method,
            path = %path,
            preset = preset.unwrap_or("-"),
            outcome = outcome.map_or("-", Outcome::as_str),
            status = res.status().as_u16(),
            ms = started.elapsed().as_millis() as u64,
        );
    }
}
