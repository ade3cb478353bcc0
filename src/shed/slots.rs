//! [`Slots`]: a pool of call slots shared by its clones, and the answer to
//! a call that found none.

use bytes::Bytes;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a call waits for a slot when nothing else is said: 50 ms.
pub const DEFAULT_QUEUE_WAIT: Duration = Duration::from_millis(50);

/// A pool of `max` slots for calls in flight, shared by its clones (give
/// one clone to every service, or serving thread, that calls the same
/// upstream).
///
/// ```
/// use tower_idempotency::shed::Slots;
///
/// let slots = Slots::new(20);
/// assert_eq!(slots.max(), 20);
/// assert_eq!(slots.clone().in_flight(), 0);
/// ```
#[derive(Clone)]
pub struct Slots {
    sem: Arc<Semaphore>,
    max: usize,
}

impl Slots {
    /// A pool of `max` slots (at least one).
    pub fn new(max: usize) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            sem: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A pool too large to ever be full (for counting calls in flight
    /// without capping them).
    pub fn unlimited() -> Self {
        Self::new(Semaphore::MAX_PERMITS)
    }

    /// The number of slots.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The slots taken now.
    pub fn in_flight(&self) -> usize {
        self.max - self.sem.available_permits()
    }

    /// A slot if one is free now.
    pub(crate) fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.sem.clone().try_acquire_owned().ok()
    }

    /// A slot, waiting at most `wait` for one to be given back (`None` past
    /// it). Waiters are served first come, first served.
    #[cfg_attr(not(feature = "proxy"), allow(dead_code))]
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
            .field("max", &self.max)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// The answer to a call that found no free slot in time: `503 Service
/// Unavailable` with `Retry-After: 1`, marked [`Outcome::Shed`](crate::Outcome::Shed)
/// so that the dedup layer releases its claim and counts it as shed, and
/// the normalize layer turns it into the channel's failure reply.
pub(crate) fn shed_response<B: From<Bytes>>(what: &'static str) -> http::Response<B> {
    let mut res = crate::body::text_response(http::StatusCode::SERVICE_UNAVAILABLE, what);
    res.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    res.extensions_mut().insert(crate::Outcome::Shed);
    res
}

/// A gauge that follows the slots taken (`idempotency_upstream_in_flight`
/// and its labels), or nothing without the `metrics` feature.
#[derive(Clone, Default)]
pub(crate) struct Gauge(#[cfg(feature = "metrics")] Option<metrics::Gauge>);

impl Gauge {
    /// The gauge `idempotency_upstream_in_flight{route}`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn route(route: &str) -> Self {
        #[cfg(feature = "metrics")]
        return Self(Some(metrics::gauge!(
            "idempotency_upstream_in_flight",
            "route" => route.to_owned()
        )));
        #[cfg(not(feature = "metrics"))]
        Self()
    }

    /// `permit` counted on this gauge until it is dropped.
    pub(crate) fn hold(&self, permit: OwnedSemaphorePermit) -> Slot {
        #[cfg(feature = "metrics")]
        if let Some(g) = &self.0 {
            g.increment(1.0);
        }
        Slot {
            _permit: permit,
            gauge: self.clone(),
        }
    }
}

/// One call's slot, given back (and uncounted) when dropped.
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    gauge: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        if let Some(g) = &self.gauge.0 {
            g.decrement(1.0);
        }
    }
}
