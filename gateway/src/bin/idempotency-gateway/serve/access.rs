//! The access log line and the duplicate-ratio gauge, read from what the
//! library put in each response's extensions.

use idempotency_gateway::journal::{Business, Journal, JournalEvent, JournalOutcome};
use idempotency_gateway::proxy::{GatewayResponse, MatchedRoute, RoutedPreset, UpstreamAnswer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tower_idempotency::key::CapturedRequest;
use tower_idempotency::order::Stale;
use tower_idempotency::Preset;
use tower_idempotency::{IdempotencyKey, Outcome};
use tracing::info;

/// How far back `idempotency_duplicate_ratio` looks unless `--ratio-window`
/// says otherwise.
pub(crate) const DEFAULT_WINDOW: Duration = Duration::from_secs(300);
/// The window moves on in this many steps (every 10 s for 5 minutes).
const STEPS: u32 = 30;

/// Guarded requests and duplicates per preset: running totals, and the
/// totals as they stood one window ago, so that the gauge is the ratio over
/// the last five minutes (`--ratio-window`), not since the start (a spike
/// after a week of quiet would barely move a ratio since the start). One
/// set of counters per built-in preset and one for the rest, so that no
/// request waits on a lock for them; the lock guards only the window's
/// history, which [`tick`](Self::tick) moves on every thirtieth of the window.
pub(crate) struct Ratios {
    by_preset: Vec<Counts>,
    /// Per built-in preset (indexed like `by_preset`, the last for the
    /// rest), the latency histogram and the ratio gauge, registered once;
    /// `None` without a metrics recorder (no `--admin-listen`): nothing
    /// to feed.
    series: Option<Vec<Series>>,
    /// Totals at every step, oldest first, at most one window's worth.
    history: Mutex<VecDeque<Vec<(u64, u64)>>>,
    window: Duration,
    journal: Option<Journaling>,
}

/// The journal and what goes into its records.
pub(crate) struct Journaling {
    journal: Journal,
    /// With `journal_body`: the most body bytes a record keeps.
    body_max: Option<usize>,
}

impl Journaling {
    /// Events to `journal`; bodies kept (up to `body_max` bytes) when given.
    pub(crate) fn new(journal: Journal, body_max: Option<usize>) -> Self {
        Self { journal, body_max }
    }
}

/// One preset's series, registered once (a lookup per request hashes the
/// name and labels, and allocates them).
struct Series {
    latency: metrics::Histogram,
    ratio: metrics::Gauge,
}

impl Series {
    fn of(preset: &'static str) -> Self {
        Self {
            latency: metrics::histogram!("idempotency_request_seconds", "preset" => preset),
            ratio: metrics::gauge!("idempotency_duplicate_ratio", "preset" => preset),
        }
    }
}

#[derive(Default)]
struct Counts {
    guarded: AtomicU64,
    duplicates: AtomicU64,
    /// The totals at the start of the window.
    base_guarded: AtomicU64,
    base_duplicates: AtomicU64,
}

impl Counts {
    fn ratio(&self, guarded: u64, duplicates: u64) -> f64 {
        let g = guarded.saturating_sub(self.base_guarded.load(Ordering::Relaxed));
        let d = duplicates.saturating_sub(self.base_duplicates.load(Ordering::Relaxed));
        if g == 0 {
            0.0
        } else {
            d as f64 / g as f64
        }
    }
}

impl Ratios {
    /// Ratios over the last `window`; every guarded response also goes to
    /// `journal`, if there is one. With `metrics` (a recorder is installed,
    /// before this is called) the latency histogram and the ratio gauge
    /// are fed; without, only the journal and the access log.
    pub(crate) fn new(window: Duration, journal: Option<Journaling>, metrics: bool) -> Self {
        let by_preset = (0..=Preset::builtin_names().len()).map(|_| Counts::default());
        let series = metrics.then(|| {
            Preset::builtin_names()
                .iter()
                .map(|name| Series::of(name))
                .collect()
        });
        Self {
            by_preset: by_preset.collect(),
            series,
            history: Mutex::default(),
            window,
            journal,
        }
    }

    /// Whether [`record`](Self::record) reads the latency without an access
    /// line (the histogram is fed): when not, it needs no start time.
    pub(crate) fn timed(&self) -> bool {
        self.series.is_some()
    }

    /// Updates the gauge and the latency histogram for `res`, answered
    /// for a request that started at `started` (`None` when neither the
    /// histogram nor the access line reads it), and logs its access line,
    /// given the request's method and path when access lines are logged
    /// (inside the request's span: its request and trace ids go with it).
    /// `trace_id`: the request's, for the journal.
    pub(crate) fn record(
        &self,
        line: Option<(http::Method, String)>,
        started: Option<Instant>,
        res: &GatewayResponse,
        trace_id: Option<&str>,
    ) {
        let outcome = res.extensions().get::<Outcome>().copied();
        let preset = res.extensions().get::<RoutedPreset>().map(|p| &*p.0);
        let elapsed = started.map_or(Duration::ZERO, |started| started.elapsed());
        if let (Some(preset), Some(outcome)) = (preset, outcome) {
            // Counted only for the gauge: the counts are shared by every
            // serving thread, and without metrics nobody reads them.
            if let Some(series) = &self.series {
                let at = Self::index(preset);
                let ratio = self.count(at, outcome.is_duplicate());
                match series.get(at) {
                    // Until the head is answered: a streamed body may take longer.
                    Some(series) => {
                        series.latency.record(elapsed.as_secs_f64());
                        series.ratio.set(ratio);
                    }
                    // A preset of the library's own beyond the built-in ones.
                    None => {
                        let label = preset.to_owned();
                        metrics::histogram!("idempotency_request_seconds", "preset" => label.clone())
                            .record(elapsed.as_secs_f64());
                        metrics::gauge!("idempotency_duplicate_ratio", "preset" => label)
                            .set(ratio);
                    }
                }
            }
            if let Some(journal) = &self.journal {
                journal_event(journal, res, outcome, trace_id);
            }
        }
        let Some((method, path)) = line else {
            return;
        };
        // An event the route's order answered itself: looked for only in
        // an executed answer (a route without an order has none).
        let outcome = match outcome {
            Some(Outcome::Executed) if res.extensions().get::<Stale>().is_some() => "stale",
            outcome => outcome.map_or("-", Outcome::as_str),
        };
        info!(
            target: "gateway::access",
            %method,
            path = %path,
            preset = preset.unwrap_or("-"),
            outcome,
            status = res.status().as_u16(),
            ms = elapsed.as_millis() as u64,
        );
    }

    /// Counts one guarded request of the preset at `at`; returns its ratio
    /// in the window.
    fn count(&self, at: usize, duplicate: bool) -> f64 {
        let counts = &self.by_preset[at];
        let guarded = counts.guarded.fetch_add(1, Ordering::Relaxed) + 1;
        let duplicates = if duplicate {
            counts.duplicates.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            counts.duplicates.load(Ordering::Relaxed)
        };
        counts.ratio(guarded, duplicates)
    }

    fn index(preset: &str) -> usize {
        let at = Preset::builtin_names().iter().position(|n| *n == preset);
        at.unwrap_or(Preset::builtin_names().len())
    }

    /// Moves the window on: the base becomes the totals of one window ago
    /// (of the start, while the gateway is younger than a window), and the
    /// gauge of every preset seen is set again, so that it falls back once
    /// duplicates stop.
    pub(crate) fn tick(&self) {
        let now: Vec<(u64, u64)> = self
            .by_preset
            .iter()
            .map(|c| {
                let g = c.guarded.load(Ordering::Relaxed);
                (g, c.duplicates.load(Ordering::Relaxed))
            })
            .collect();
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        history.push_back(now.clone());
        let oldest = if history.len() > STEPS as usize {
            history.pop_front()
        } else {
            None
        };
        drop(history);
        for (i, counts) in self.by_preset.iter().enumerate() {
            if let Some(base) = &oldest {
                counts.base_guarded.store(base[i].0, Ordering::Relaxed);
                counts.base_duplicates.store(base[i].1, Ordering::Relaxed);
            }
            let (guarded, duplicates) = now[i];
            if let (true, Some(series)) = (guarded > 0, self.series.as_ref().and_then(|s| s.get(i)))
            {
                series.ratio.set(counts.ratio(guarded, duplicates));
            }
        }
    }

    /// Makes these the process's ratios (once: a second call is an error)
    /// and moves their window on for as long as the gateway runs. Every
    /// serving thread reads them per request through the `&'static`
    /// returned, so that no reference count is bumped (on a cache line the
    /// threads would pass back and forth) for each one.
    pub(crate) fn install(self) -> Result<&'static Ratios, String> {
        static RATIOS: OnceLock<Ratios> = OnceLock::new();
        RATIOS
            .set(self)
            .map_err(|_| "the duplicate ratios are set once per process".to_owned())?;
        let ratios = RATIOS.get().expect("set just above");
        tokio::spawn(ratios.keep_moving());
        Ok(ratios)
    }

    /// Moves the window on at every step, for as long as the gateway runs.
    async fn keep_moving(&'static self) {
        let step = (self.window / STEPS).max(Duration::from_millis(10));
        let mut every = tokio::time::interval(step);
        every.tick().await;
        loop {
            every.tick().await;
            self.tick();
        }
    }
}

/// One guarded response's event: its stored key, route, outcome and status,
/// what the upstream answered when it ran, the request's trace id, the notification's business ids
/// and (with `journal_body`) its body.
fn journal_event(
    journaling: &Journaling,
    res: &GatewayResponse,
    outcome: Outcome,
    trace_id: Option<&str>,
) {
    let journal = &journaling.journal;
    let Some(key) = res.extensions().get::<IdempotencyKey>() else {
        return;
    };
    let route = res.extensions().get::<MatchedRoute>().map_or("", |r| &r.0);
    // The route's order answered it: the upstream was not called.
    let outcome = match res.extensions().get::<Stale>() {
        Some(_) => JournalOutcome::Stale,
        None => JournalOutcome::Layer(outcome),
    };
    let mut event =
        JournalEvent::new(key.as_str(), key.preset(), route, outcome).status(res.status().as_u16());
    if let Some(up) = res.extensions().get::<UpstreamAnswer>() {
        event = event.upstream(up.status.as_u16(), up.took);
    }
    if let Some(trace_id) = trace_id {
        event = event.trace_id(trace_id);
    }
    if let Some(captured) = res.extensions().get::<CapturedRequest>() {
        event = event.verified(captured.verified);
        if let Some(business) = Business::read(key.preset(), captured) {
            event = event.business(business);
        }
        if let Some(max) = journaling.body_max {
            event = event.body(&captured.body, max);
        }
    }
    journal.record(event);
}
