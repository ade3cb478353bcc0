//! [`AimdLimit`]: a cap on the calls in flight that follows what the
//! upstream answers (additive increase, multiplicative decrease), and the
//! state it keeps behind the [`Slots`](super::Slots) it drives.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How the adaptive cap of [`Slots::adaptive`](super::Slots::adaptive)
/// moves: additive increase on fast successes, multiplicative decrease on
/// failures and slow calls, as Netflix's concurrency-limits `AIMDLimit`.
///
/// Every call that got a slot and was answered is a sample (a shed call is
/// none):
///
/// - **decrease**: the upstream failed (a 5xx or 429 answer, no answer,
///   a timeout), or took longer than the latency threshold: the limit is
///   multiplied by the backoff ratio ([`backoff`](Self::backoff), 0.9).
///   A call still unanswered at the threshold counts as slow at that
///   moment, not when it ends.
/// - **increase**: a success under the threshold while the limit is in use
///   (at least half of it in flight) adds `1 / limit`: one slot per limit's
///   worth of successes, about one a round trip when the limit is full (as
///   TCP's congestion window grows).
///
/// The limit stays within [`min`](Self::min) and [`max`](Self::max). The
/// latency threshold is fixed ([`latency_threshold`](Self::latency_threshold))
/// or, by default, [`tolerance`](Self::tolerance) times the measured
/// baseline: a moving average of the successful calls' latency under the
/// threshold, never less than the baseline plus 10 ms. Until the first
/// success there is no baseline, and only failures count.
///
/// Shrinking the limit never takes a slot back from a call holding it: no
/// new slot is given until the calls in flight are below the new limit.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::shed::{AimdLimit, Slots};
///
/// let limit = AimdLimit::new().min(5).max(40).initial(10).backoff(0.8);
/// assert_eq!(limit.get_max(), 40);
/// let slots = Slots::adaptive(limit);
/// assert_eq!(slots.max(), 10);
/// assert_eq!(slots.aimd(), Some(limit));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AimdLimit {
    min: usize,
    max: usize,
    initial: usize,
    threshold: Option<Duration>,
    tolerance: f64,
    backoff: f64,
}

impl Default for AimdLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// The least threshold over the baseline (scheduling jitter is not load).
const MIN_HEADROOM: Duration = Duration::from_millis(10);
/// The baseline moves by this share of each sample's difference.
const BASELINE_WEIGHT: f64 = 1.0 / 16.0;
/// The most often a change of the limit is logged.
const LOG_EVERY: Duration = Duration::from_secs(1);

impl AimdLimit {
    /// Every default: min 1, max 200, initial 20, threshold twice the
    /// baseline, backoff 0.9.
    pub const fn new() -> Self {
        Self {
            min: 1,
            max: 200,
            initial: 20,
            threshold: None,
            tolerance: 2.0,
            backoff: 0.9,
        }
    }

    /// The least the limit goes down to (at least one). Defaults to 1.
    pub const fn min(mut self, min: usize) -> Self {
        self.min = min;
        self
    }

    /// The most the limit goes up to. Defaults to 200.
    pub const fn max(mut self, max: usize) -> Self {
        self.max = max;
        self
    }

    /// The limit at the start (within min and max). Defaults to 20.
    pub const fn initial(mut self, initial: usize) -> Self {
        self.initial = initial;
        self
    }

    /// A fixed latency threshold: a call slower than this counts as a
    /// failure. Defaults to none: [`tolerance`](Self::tolerance) times the
    /// measured baseline.
    pub const fn latency_threshold(mut self, threshold: Duration) -> Self {
        self.threshold = Some(threshold);
        self
    }

    /// With no fixed threshold, a call slower than `tolerance` times the
    /// baseline (and at least the baseline plus 10 ms) counts as a failure.
    /// Values under 1 are taken as 1. Defaults to 2.
    pub const fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// What the limit is multiplied by on a failure or a slow call,
    /// between 0.5 and 1 (values outside are clamped). Defaults to 0.9.
    pub const fn backoff(mut self, ratio: f64) -> Self {
        self.backoff = ratio;
        self
    }

    /// The least limit (see [`min`](Self::min)).
    pub fn get_min(&self) -> usize {
        self.min.max(1)
    }

    /// The most limit (see [`max`](Self::max)).
    pub fn get_max(&self) -> usize {
        self.max.clamp(self.get_min(), Semaphore::MAX_PERMITS)
    }

    /// The limit at the start (see [`initial`](Self::initial)).
    pub fn get_initial(&self) -> usize {
        self.initial.clamp(self.get_min(), self.get_max())
    }

    /// The fixed latency threshold, if any.
    pub fn get_latency_threshold(&self) -> Option<Duration> {
        self.threshold
    }

    /// The tolerance over the baseline (see [`tolerance`](Self::tolerance)).
    pub fn get_tolerance(&self) -> f64 {
        if self.tolerance.is_nan() {
            return 1.0;
        }
        self.tolerance.max(1.0)
    }

    /// The backoff ratio (see [`backoff`](Self::backoff)).
    pub fn get_backoff(&self) -> f64 {
        if self.backoff.is_nan() {
            return 0.9;
        }
        self.backoff.clamp(0.5, 1.0)
    }
}

/// The moving state of an adaptive cap, shared by its [`Slots`](super::Slots).
pub(crate) struct Adaptive {
    config: AimdLimit,
    sem: Arc<Semaphore>,
    state: Mutex<State>,
    label: OnceLock<Label>,
}

/// The route the cap is logged and measured under.
struct Label {
    route: String,
    #[cfg(feature = "metrics")]
    gauge: metrics::Gauge,
}

struct State {
    /// The limit, fractional between steps.
    limit: f64,
    /// The whole slots it gives: `limit` rounded down, within min and max.
    target: usize,
    /// Permits held by calls beyond `target` (the limit shrank under
    /// them): the next this many given back are forgotten.
    debt: usize,
    /// The successful calls' latency, in seconds.
    baseline: Option<f64>,
    logged: usize,
    logged_at: Option<Instant>,
}

impl Adaptive {
    pub(crate) fn new(config: AimdLimit) -> (Self, Arc<Semaphore>) {
        let target = config.get_initial();
        let sem = Arc::new(Semaphore::new(target));
        let state = State {
            limit: target as f64,
            target,
            debt: 0,
            baseline: None,
            logged: target,
            logged_at: None,
        };
        let adaptive = Self {
            config,
            sem: sem.clone(),
            state: Mutex::new(state),
            label: OnceLock::new(),
        };
        (adaptive, sem)
    }

    pub(crate) fn config(&self) -> AimdLimit {
        self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is whole after every step: a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The slots the cap gives now.
    pub(crate) fn limit(&self) -> usize {
        self.lock().target
    }

    /// The slots held now.
    pub(crate) fn in_flight(&self) -> usize {
        let s = self.lock();
        (s.target + s.debt).saturating_sub(self.sem.available_permits())
    }

    /// Names the cap after `route` for its log lines and its gauge
    /// `idempotency_upstream_limit{route}` (the first name given stays).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn name(&self, route: &str) {
        let _ = self.label.set(Label {
            route: route.to_owned(),
            #[cfg(feature = "metrics")]
            gauge: metrics::gauge!("idempotency_upstream_limit", "route" => route.to_owned()),
        });
        #[cfg(feature = "metrics")]
        if let Some(label) = self.label.get() {
            label.gauge.set(self.limit() as f64);
        }
    }

    /// The latency past which a call counts as slow, if known yet.
    pub(crate) fn threshold(&self) -> Option<Duration> {
        let s = self.lock();
        self.threshold_of(&s)
    }

    fn threshold_of(&self, s: &State) -> Option<Duration> {
        if let Some(fixed) = self.config.threshold {
            return Some(fixed);
        }
        let base = Duration::try_from_secs_f64(s.baseline?).ok()?;
        let scaled = base.mul_f64(self.config.get_tolerance());
        Some(scaled.max(base + MIN_HEADROOM))
    }

    /// One answered call: `failed` (or slower than the threshold) shrinks
    /// the limit; a fast success while the limit is in use grows it. The
    /// call's own slot is still held.
    pub(crate) fn sample(&self, latency: Duration, failed: bool) {
        let mut s = self.lock();
        let slow = self.threshold_of(&s).is_some_and(|t| latency > t);
        let (min, max) = (self.config.get_min() as f64, self.config.get_max() as f64);
        if failed || slow {
            s.limit = (s.limit * self.config.get_backoff()).max(min);
        } else {
            let secs = latency.as_secs_f64();
            s.baseline = Some(match s.baseline {
                None => secs,
                Some(b) => b + (secs - b) * BASELINE_WEIGHT,
            });
            let in_flight = (s.target + s.debt).saturating_sub(self.sem.available_permits());
            if in_flight * 2 >= s.target {
                s.limit = (s.limit + 1.0 / s.limit).min(max);
            }
        }
        self.resize(&mut s);
    }

    /// The semaphore's permits brought to the limit: more given at once,
    /// fewer by forgetting free ones, and the rest as debt paid by the
    /// calls holding them when they give them back.
    fn resize(&self, s: &mut State) {
        let min = self.config.get_min();
        let target = (s.limit.floor() as usize).clamp(min, self.config.get_max());
        if target > s.target {
            let more = target - s.target;
            let paid = more.min(s.debt);
            s.debt -= paid;
            self.sem.add_permits(more - paid);
        } else if target < s.target {
            let fewer = s.target - target;
            let forgotten = self.sem.forget_permits(fewer);
            s.debt += fewer - forgotten;
        }
        if target == s.target {
            return;
        }
        s.target = target;
        #[cfg(feature = "metrics")]
        if let Some(label) = self.label.get() {
            label.gauge.set(target as f64);
        }
        // Logged when it moved more than a step, at most once a second.
        let moved = target.abs_diff(s.logged) > 1;
        let due = s.logged_at.is_none_or(|at| at.elapsed() >= LOG_EVERY);
        if moved && due {
            let was = s.logged;
            s.logged = target;
            s.logged_at = Some(Instant::now());
            let route = self.label.get().map_or("", |l| l.route.as_str());
            #[cfg(feature = "tracing")]
            tracing::info!(
                route,
                limit = target,
                was,
                "adaptive upstream limit changed"
            );
            #[cfg(not(feature = "tracing"))]
            let _ = (route, was);
        }
    }

    /// A held permit given back: forgotten while the limit owes slots.
    pub(crate) fn release(&self, permit: OwnedSemaphorePermit) {
        let mut s = self.lock();
        if s.debt > 0 {
            s.debt -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("Adaptive")
            .field("config", &self.config)
            .field("limit", &s.limit)
            .field("debt", &s.debt)
            .field("baseline", &s.baseline)
            .finish()
    }
}
