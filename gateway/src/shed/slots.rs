//! [`Slots`]: a pool of call slots shared by its clones, and the answer to
//! a call that found none.

use super::adaptive::{Adaptive, AimdLimit};
use bytes::Bytes;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// How long a call waits for a slot when nothing else is said: 50 ms.
pub const DEFAULT_QUEUE_WAIT: Duration = Duration::from_millis(50);

/// A pool of `max` slots for calls in flight, shared by its clones (give
/// one clone to every service, or serving thread, that calls the same
/// upstream); or, from [`Slots::adaptive`], as many as an [`AimdLimit`]
/// gives, following what the upstream answers.
///
/// ```
/// use idempotency_gateway::shed::Slots;
///
/// let slots = Slots::new(20);
/// assert_eq!(slots.max(), 20);
/// assert_eq!(slots.clone().in_flight(), 0);
/// assert_eq!(slots.aimd(), None);
/// ```
#[derive(Clone)]
pub struct Slots {
    sem: Arc<Semaphore>,
    max: usize,
    adaptive: Option<Arc<Adaptive>>,
}

impl Slots {
    /// A pool of `max` slots (at least one).
    pub fn new(max: usize) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            sem: Arc::new(Semaphore::new(max)),
            max,
            adaptive: None,
        }
    }

    /// A pool whose size follows the upstream's answers (see
    /// [`AimdLimit`]), starting at its initial limit.
    pub fn adaptive(limit: AimdLimit) -> Self {
        let (adaptive, sem) = Adaptive::new(limit);
        Self {
            sem,
            max: limit.get_max(),
            adaptive: Some(Arc::new(adaptive)),
        }
    }

    /// How the pool adapts, if it does.
    pub fn aimd(&self) -> Option<AimdLimit> {
        self.adaptive.as_ref().map(|a| a.config())
    }

    /// An adaptive pool's current latency threshold: a call slower than
    /// this shrinks the limit. `None` for a fixed pool, or before the first
    /// success measured the baseline (with no fixed threshold).
    pub fn latency_threshold(&self) -> Option<Duration> {
        self.adaptive.as_ref().and_then(|a| a.threshold())
    }

    /// A pool too large to ever be full (for counting calls in flight
    /// without capping them).
    pub fn unlimited() -> Self {
        Self::new(Semaphore::MAX_PERMITS)
    }

    /// The number of slots: an adaptive pool's limit now.
    pub fn max(&self) -> usize {
        match &self.adaptive {
            Some(a) => a.limit(),
            None => self.max,
        }
    }

    /// The slots taken now.
    pub fn in_flight(&self) -> usize {
        match &self.adaptive {
            Some(a) => a.in_flight(),
            None => self.max - self.sem.available_permits(),
        }
    }

    /// Names the pool after `route`: the gauge `idempotency_upstream_limit{route}`
    /// shows its limit (0 for a pool too large to be full), and an adaptive
    /// pool logs its changes under that name.
    pub(crate) fn name(&self, route: &str) {
        match &self.adaptive {
            Some(a) => a.name(route),
            None => self.name_fixed(route),
        }
    }

    /// A fixed pool's limit in its gauge, once.
    fn name_fixed(&self, route: &str) {
        {
            let max = if self.max == Semaphore::MAX_PERMITS {
                0
            } else {
                self.max
            };
            metrics::gauge!("idempotency_upstream_limit", "route" => route.to_owned())
                .set(max as f64);
        }
    }

    /// `permit` as a call's slot, counted on `gauge` until it is dropped.
    pub(crate) fn hold(&self, permit: OwnedSemaphorePermit, gauge: &Gauge) -> Slot {
        if let Some(g) = &gauge.0 {
            g.increment(1.0);
        }
        let adaptive = self.adaptive.clone();
        let started = Instant::now();
        let slow_at = adaptive
            .as_ref()
            .and_then(|a| a.threshold())
            .and_then(|t| started.checked_add(t));
        Slot {
            permit: Some(permit),
            gauge: gauge.clone(),
            adaptive,
            sampled: false,
            slowed: false,
            started,
            slow_at,
        }
    }

    /// A slot if one is free now.
    pub(crate) fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.sem.clone().try_acquire_owned().ok()
    }

    /// A slot, waiting at most `wait` for one to be given back (`None` past
    /// it). Waiters are served first come, first served.
    pub(crate) async fn acquire_within(&self, wait: Duration) -> Option<OwnedSemaphorePermit> {
        if let Some(permit) = self.try_acquire() {
            return Some(permit);
        }
        if wait.is_zero() {
            return None;
        }
        match tokio::time::timeout(wait, self.sem.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Some(permit),
            // Timed out (the semaphore is never closed).
            _ => None,
        }
    }

    /// The semaphore, for a future that polls for a slot.
    pub(crate) fn semaphore(&self) -> Arc<Semaphore> {
        self.sem.clone()
    }
}

impl fmt::Debug for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slots")
            .field("max", &self.max())
            .field("in_flight", &self.in_flight())
            .field("adaptive", &self.adaptive)
            .finish()
    }
}

/// The answer to a call that found no free slot in time: `503 Service
/// Unavailable` with `Retry-After: 1`, marked [`Outcome::Shed`](tower_idempotency::Outcome::Shed)
/// so that the dedup layer releases its claim and counts it as shed, and
/// the normalize layer turns it into the channel's failure reply.
pub(crate) fn shed_response<B: From<Bytes>>(what: &'static str) -> http::Response<B> {
    let mut res =
        tower_idempotency::__private::text_response(http::StatusCode::SERVICE_UNAVAILABLE, what);
    res.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    res.extensions_mut()
        .insert(tower_idempotency::Outcome::Shed);
    res
}

/// What an answer says of the upstream's load: `Some(true)` it failed
/// (5xx) or said it is overloaded (429), which shrinks an adaptive limit;
/// `None` nothing (another 4xx: a fast refusal is no measure of load);
/// `Some(false)` it served the call.
pub(crate) fn failed(status: http::StatusCode) -> Option<bool> {
    if status.is_server_error() || status == http::StatusCode::TOO_MANY_REQUESTS {
        Some(true)
    } else if status.is_client_error() {
        None
    } else {
        Some(false)
    }
}

/// A gauge that follows the slots taken (`idempotency_upstream_in_flight`
/// and its labels), or nothing (a limit no route names).
#[derive(Clone, Default)]
pub(crate) struct Gauge(Option<metrics::Gauge>);

impl Gauge {
    /// The gauge `idempotency_upstream_in_flight{route}`.
    pub(crate) fn route(route: &str) -> Self {
        Self(Some(metrics::gauge!(
            "idempotency_upstream_in_flight",
            "route" => route.to_owned()
        )))
    }
}

/// One call's slot, given back (and uncounted) when dropped. An adaptive
/// pool's slot is also its call's sample: [`answered`](Self::answered) or
/// [`slow`](Self::slow) tells the limit how the upstream did (once).
pub(crate) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    gauge: Gauge,
    adaptive: Option<Arc<Adaptive>>,
    sampled: bool,
    /// Counted as slow while it ran: its answer only teaches the baseline.
    slowed: bool,
    started: Instant,
    slow_at: Option<Instant>,
}

impl Slot {
    /// When the call, still unanswered, counts as slow (adaptive pools
    /// with a threshold, until sampled).
    pub(crate) fn slow_at(&self) -> Option<Instant> {
        if self.sampled || self.slowed {
            return None;
        }
        self.slow_at
    }

    /// Times the call from now (the request goes out after other waits).
    pub(crate) fn start(&mut self) {
        self.started = Instant::now();
        self.slow_at = self
            .adaptive
            .as_ref()
            .and_then(|a| a.threshold())
            .and_then(|t| self.started.checked_add(t));
    }

    /// The upstream answered: `Some(true)` it failed (a 5xx, 429, no
    /// answer or timeout), `Some(false)` a success, timed from the slot's
    /// start; `None` an answer that says nothing of load (another 4xx).
    pub(crate) fn answered(&mut self, failed: Option<bool>) {
        let Some(a) = self.adaptive.as_ref().filter(|_| !self.sampled) else {
            return;
        };
        self.sampled = true;
        match (failed, self.slowed) {
            (Some(failed), false) => a.sample(self.started.elapsed(), failed),
            // Counted as slow already: its latency still moves the baseline.
            (Some(false), true) => a.learn(self.started.elapsed()),
            _ => {}
        }
    }

    /// The call is past its threshold, unanswered: a slow sample now.
    pub(crate) fn slow(&mut self) {
        if let (Some(a), false, false) = (&self.adaptive, self.sampled, self.slowed) {
            self.slowed = true;
            a.sample(Duration::MAX, true);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(g) = &self.gauge.0 {
            g.decrement(1.0);
        }
        if let (Some(a), Some(permit)) = (&self.adaptive, self.permit.take()) {
            a.release(permit);
        }
    }
}
