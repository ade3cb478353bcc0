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
/// Every call that got a slot and whose answer says something about load is
/// a sample (a shed call is none, nor a 4xx answer other than 429: a fast
/// refusal says nothing of how loaded the upstream is):
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
/// baseline, never less than the baseline plus 10 ms. The baseline is the
/// least latency of the last 256 successful calls, slow ones included (as
/// the Vegas limit's windowed minimum): it follows the upstream when its
/// latency steps up for good (a deploy, a failover, day-time load), so the
/// limit falls while the step is new and grows back once the window has
/// seen it, instead of staying at `min`. Until the first success there is
/// no baseline, and only failures count.
///
/// Values no limit can work with (a tolerance that is not a finite number
/// of at least 1, a threshold of zero or over a day, `max` under `min`, an
/// initial limit outside them, a backoff outside `[0.5, 1)`) are refused by
/// [`validate`](Self::validate); used anyway, they are brought within
/// bounds, never a panic.
///
/// Shrinking the limit never takes a slot back from a call holding it: no
/// new slot is given until the calls in flight are below the new limit.
///
/// ```
/// use std::time::Duration;
/// use idempotency_gateway::shed::{AimdLimit, Slots};
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
/// The baseline is the least latency of this many successful calls.
const BASELINE_WINDOW: u64 = 256;
/// The highest tolerance used (a larger one is taken as this).
const MAX_TOLERANCE: f64 = 1000.0;
/// The longest latency threshold used (a longer one is taken as this).
const MAX_THRESHOLD: Duration = Duration::from_secs(24 * 3600);
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
        self.min.clamp(1, Semaphore::MAX_PERMITS)
    }

    /// The most limit (see [`max`](Self::max)).
    pub fn get_max(&self) -> usize {
        self.max.clamp(self.get_min(), Semaphore::MAX_PERMITS)
    }

    /// The limit at the start (see [`initial`](Self::initial)).
    pub fn get_initial(&self) -> usize {
        self.initial.clamp(self.get_min(), self.get_max())
    }

    /// The fixed latency threshold (see
    /// [`latency_threshold`](Self::latency_threshold)), if any (at most a day).
    pub fn get_latency_threshold(&self) -> Option<Duration> {
        self.threshold.map(|t| t.min(MAX_THRESHOLD))
    }

    /// The tolerance over the baseline (see [`tolerance`](Self::tolerance)),
    /// from 1 to 1000.
    pub fn get_tolerance(&self) -> f64 {
        if self.tolerance.is_nan() {
            return 1.0;
        }
        self.tolerance.clamp(1.0, MAX_TOLERANCE)
    }

    /// Refuses the values no limit can work with: a tolerance that is not a
    /// finite number of at least 1 (or over 1000), a latency threshold of
    /// zero or over a day, `max` under `min`, an initial limit outside
    /// them, a backoff outside `[0.5, 1)`. (Used anyway, each is brought
    /// within its bounds.)
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_gateway::shed::AimdLimit;
    ///
    /// assert!(AimdLimit::new().validate().is_ok());
    /// assert!(AimdLimit::new().tolerance(f64::INFINITY).validate().is_err());
    /// assert!(AimdLimit::new().latency_threshold(Duration::MAX).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), InvalidAimdLimit> {
        let bad = |why: String| Err(InvalidAimdLimit(why));
        let t = self.tolerance;
        if !(t.is_finite() && (1.0..=MAX_TOLERANCE).contains(&t)) {
            return bad(format!(
                "tolerance {t}: expected a number from 1 to {MAX_TOLERANCE}"
            ));
        }
        if let Some(t) = self.threshold
            && (t.is_zero() || t > MAX_THRESHOLD)
        {
            return bad(format!(
                "latency threshold {t:?}: expected more than zero and at most a day"
            ));
        }
        if !(0.5..1.0).contains(&self.backoff) {
            return bad(format!(
                "backoff {}: expected at least 0.5 and less than 1",
                self.backoff
            ));
        }
        let (min, max) = (self.min, self.max);
        if min == 0 || min > Semaphore::MAX_PERMITS || max < min || max > Semaphore::MAX_PERMITS {
            return bad(format!(
                "min {min}, max {max}: expected 1 <= min <= max <= {}",
                Semaphore::MAX_PERMITS
            ));
        }
        if !(min..=max).contains(&self.initial) {
            return bad(format!(
                "initial {}: expected from min ({min}) to max ({max})",
                self.initial
            ));
        }
        Ok(())
    }

    /// The backoff ratio (see [`backoff`](Self::backoff)).
    pub fn get_backoff(&self) -> f64 {
        if self.backoff.is_nan() {
            return 0.9;
        }
        self.backoff.clamp(0.5, 1.0)
    }
}

/// Why [`AimdLimit::validate`] refused a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidAimdLimit(String);

impl fmt::Display for InvalidAimdLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidAimdLimit {}

/// The least of the last [`BASELINE_WINDOW`] latencies (a sliding-window
/// minimum: each sample is pushed once and popped once).
#[derive(Default)]
struct WindowMin {
    /// Increasing latencies, each with its sample's number.
    mins: std::collections::VecDeque<(u64, f64)>,
    seen: u64,
}

impl WindowMin {
    fn push(&mut self, secs: f64) {
        self.seen += 1;
        while self.mins.back().is_some_and(|(_, v)| *v >= secs) {
            self.mins.pop_back();
        }
        self.mins.push_back((self.seen, secs));
        while self
            .mins
            .front()
            .is_some_and(|(n, _)| *n + BASELINE_WINDOW <= self.seen)
        {
            self.mins.pop_front();
        }
    }

    fn get(&self) -> Option<f64> {
        self.mins.front().map(|(_, v)| *v)
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
    baseline: WindowMin,
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
            baseline: WindowMin::default(),
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
    pub(crate) fn name(&self, route: &str) {
        let _ = self.label.set(Label {
            route: route.to_owned(),
            gauge: metrics::gauge!("idempotency_upstream_limit", "route" => route.to_owned()),
        });
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
        if let Some(fixed) = self.config.get_latency_threshold() {
            return Some(fixed);
        }
        let secs = s.baseline.get()?;
        let base = Duration::try_from_secs_f64(secs).unwrap_or(MAX_THRESHOLD);
        let scaled = Duration::try_from_secs_f64(secs * self.config.get_tolerance())
            .unwrap_or(MAX_THRESHOLD);
        Some(
            scaled
                .max(base.saturating_add(MIN_HEADROOM))
                .min(MAX_THRESHOLD),
        )
    }

    /// A success's latency, for the baseline only (its call was already
    /// counted as slow while it ran).
    pub(crate) fn learn(&self, latency: Duration) {
        self.lock().baseline.push(latency.as_secs_f64());
    }

    /// One answered call: `failed` (or slower than the threshold) shrinks
    /// the limit; a fast success while the limit is in use grows it; every
    /// success's latency joins the baseline. The call's own slot is still
    /// held.
    pub(crate) fn sample(&self, latency: Duration, failed: bool) {
        let mut s = self.lock();
        let slow = self.threshold_of(&s).is_some_and(|t| latency > t);
        let (min, max) = (self.config.get_min() as f64, self.config.get_max() as f64);
        if !failed && latency != Duration::MAX {
            s.baseline.push(latency.as_secs_f64());
        }
        if failed || slow {
            s.limit = (s.limit * self.config.get_backoff()).max(min);
        } else {
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
            tracing::info!(
                route,
                limit = target,
                was,
                "adaptive upstream limit changed"
            );
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
            .field("baseline", &s.baseline.get())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `calls` calls at once, each taking `latency` and succeeding: the
    /// whole limit in use, as under a backlog.
    fn round(a: &Adaptive, sem: &Arc<Semaphore>, latency: Duration) -> usize {
        let calls = a.limit();
        let held: Vec<_> = (0..calls)
            .map(|_| sem.clone().try_acquire_owned().expect("a free slot"))
            .collect();
        for permit in held {
            a.sample(latency, false);
            a.release(permit);
        }
        calls
    }

    /// The upstream's latency steps up for good (10 ms for 200 calls, then
    /// 30 ms): the limit falls while the step is new, then follows the new
    /// baseline back up instead of staying at `min`. Time is counted, not
    /// slept: each round of calls at once takes one latency.
    #[test]
    fn a_latency_step_up_does_not_pin_the_limit_at_min() {
        let (a, sem) = Adaptive::new(AimdLimit::new().max(40).initial(20));
        let fast = Duration::from_millis(10);
        let mut calls = 0;
        while calls < 200 {
            calls += round(&a, &sem, fast);
        }
        assert!(a.limit() >= 20, "fast calls at full use: {}", a.limit());
        let slow = Duration::from_millis(30);
        let mut clock = Duration::ZERO;
        let mut lowest = a.limit();
        // Until the step has shrunk the limit and it is back above half of
        // max (or 30 s of calls).
        while (lowest >= 10 || a.limit() <= 20) && clock < Duration::from_secs(30) {
            round(&a, &sem, slow);
            clock += slow;
            lowest = lowest.min(a.limit());
        }
        assert!(lowest < 10, "the step shrank the limit first: {lowest}");
        assert!(
            a.limit() > 20,
            "the limit is {} after {clock:?} of 30 ms calls (it fell to {lowest})",
            a.limit()
        );
    }
}
