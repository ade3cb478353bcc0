//! What the workers on one queue share, per lane: delivery slots (the
//! concurrency), turns (the rate) and the circuit breaker, each kept by a
//! queue that shares them (Redis Streams) and asked by every
//! [`Worker`](super::Worker) before and after a delivery. A queue that
//! shares nothing answers `None`, and one that cannot answer stops
//! nothing: the worker's own limits and breaker hold meanwhile.

use super::breaker::{BreakerRule, BreakerState};
use super::worker::Config;
use super::{Queue, QueueError, QueueErrorKind};
use std::sync::Arc;
use std::time::Duration;

/// One call to the queue's shared pacing or breaker, bounded by a sixth of
/// the lease: a slow or stalled backend holds up neither a delivery's
/// start nor its settlement (the entry's lease is renewed every third of
/// it, and not once the call ended) long enough for the entry to be
/// handed out again. Past it, the call counts as failed.
pub(super) async fn bounded<T>(
    config: &Config,
    what: &str,
    call: impl std::future::Future<Output = Result<T, QueueError>>,
) -> Result<T, QueueError> {
    let bound = super::worker::renew_every(config.lease) / 2;
    tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
        Err(QueueError::new(
            QueueErrorKind::Timeout,
            format!("{what} timed out after {bound:?}"),
        ))
    })
}

/// The lane's shared slot and turn, when its pace has a concurrency or
/// a rate: `Ok(slot)` to go (`None`: nothing shared taken), or how long
/// to wait. A queue that fails here does not stop the deliveries: the
/// worker's own limits still hold.
pub(super) async fn shared_turn<Q: Queue>(
    queue: Q,
    config: Arc<Config>,
    lane: Arc<str>,
    (concurrency, rate): (Option<usize>, Option<super::Rate>),
) -> Result<Option<u64>, Duration> {
    let mut slot = None;
    if let Some(n) = concurrency {
        match bounded(
            &config,
            "taking a shared slot",
            queue.take_slot(&lane, n, config.lease),
        )
        .await
        {
            Ok(Some(taken)) => slot = Some(taken),
            Ok(None) => return Err(SHARED_FULL_WAIT),
            Err(_e) => {
                crate::log_warn!(queue = %config.name, route = %lane, error = %_e, "cannot take a shared delivery slot; this instance's own limit holds");
            }
        }
    }
    if let Some(rate) = rate {
        let wait = match bounded(
            &config,
            "taking a shared turn",
            queue.take_turn(&lane, rate.interval()),
        )
        .await
        {
            Ok(wait) => wait,
            Err(_e) => {
                crate::log_warn!(queue = %config.name, route = %lane, error = %_e, "cannot take a shared delivery turn; this instance's own rate holds");
                None
            }
        };
        if let Some(wait) = wait {
            if let Some(taken) = slot {
                let _ = bounded(
                    &config,
                    "giving back a shared slot",
                    queue.give_slot(&lane, taken),
                )
                .await;
            }
            return Err(wait);
        }
    }
    Ok(slot)
}

/// What the lane's breaker shared on the queue says of a delivery about to
/// start.
pub(super) enum SharedGate {
    /// Nothing shared, or the queue cannot answer now: this worker's own
    /// breaker judges alone.
    Local,
    /// Go: the lane's breaker follows this state first (a probe asked of a
    /// breaker found closed goes as a plain delivery); with the shared
    /// probe's id if one was taken.
    Go(Option<BreakerState>, Option<u64>),
    /// Not now: the breaker stands so (open, half-open for a probe, or
    /// every probe out); the lane's breaker follows it.
    Hold(BreakerState),
}

/// Asks the lane's breaker shared on the queue whether a delivery (`probe`:
/// as the breaker's probe) may start.
///
/// A queue that cannot answer (Redis unreachable) stops nothing: this
/// worker's own breaker then judges alone on its own votes (kept warm all
/// along), which is logged and counted
/// (`idempotency_breaker_shared_errors_total{route}`). The breaker only
/// paces: whichever decides, each entry is still settled once through the
/// queue's lease and the dedup layer, so nothing is lost or delivered twice;
/// the price of the fallback is each instance probing on its own, as before.
pub(super) async fn shared_gate<Q: Queue>(
    queue: &Q,
    config: &Config,
    lane: &Arc<str>,
    rule: BreakerRule,
    probe: bool,
    lease: Duration,
) -> SharedGate {
    let asked = match probe {
        false => {
            bounded(
                config,
                "asking the shared breaker",
                queue.breaker_state(lane),
            )
            .await
        }
        true => {
            bounded(
                config,
                "taking a shared probe",
                queue.take_probe(lane, rule, lease),
            )
            .await
        }
    };
    match asked {
        Ok(None) => SharedGate::Local,
        Ok(Some(BreakerState::Closed)) => {
            SharedGate::Go(probe.then_some(BreakerState::Closed), None)
        }
        Ok(Some(BreakerState::Probe(id))) if probe => SharedGate::Go(None, Some(id)),
        Ok(Some(state)) => SharedGate::Hold(state),
        Err(_e) => {
            shared_failed(config, lane, &_e);
            SharedGate::Local
        }
    }
}

/// Casts a finished call's vote in the lane's shared breaker, or settles
/// its shared probe (`id`); what the breaker answered. `up` is what the
/// result says of the upstream (`None`: nothing, no vote).
pub(super) async fn judged<Q: Queue>(
    queue: &Q,
    config: &Config,
    lane: &Arc<str>,
    (entry, id, fresh): (u64, Option<u64>, bool),
    up: Option<bool>,
    rule: BreakerRule,
) -> Option<BreakerState> {
    let answered = match (id, up) {
        (Some(id), up) => {
            let settled = queue.settle_probe(lane, id, up, fresh, rule);
            bounded(config, "settling a shared probe", settled).await
        }
        (None, Some(ok)) => {
            let voted = queue.breaker_vote(lane, entry, ok, rule);
            bounded(config, "voting in the shared breaker", voted).await
        }
        (None, None) => return None,
    };
    answered.unwrap_or_else(|e| {
        shared_failed(config, lane, &e);
        None
    })
}

/// The shared breaker could not answer: counted each time, logged at most
/// every [`SHARED_WARNING_EVERY`] (it is asked before and after every
/// delivery).
fn shared_failed(_config: &Config, lane: &Arc<str>, _e: &QueueError) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static WARNED: AtomicU64 = AtomicU64::new(0);
    super::metrics::breaker_shared_error(lane);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = WARNED.load(Ordering::Relaxed);
    let due = now >= last.saturating_add(SHARED_WARNING_EVERY.as_secs()) || last == 0;
    if due
        && WARNED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        crate::log_warn!(queue = %_config.name, route = %lane, error = %_e, "the circuit breaker shared on the queue cannot answer; this instance's own breaker judges alone meanwhile (logged at most every 10 s; idempotency_breaker_shared_errors_total counts each)");
    }
}

/// How often the shared breaker's failures are logged at most.
const SHARED_WARNING_EVERY: Duration = Duration::from_secs(10);

/// How long a delivery waits while every probe of the shared breaker is
/// out (with other instances) before it asks again.
pub(super) fn probe_wait(cooldown: Duration) -> Duration {
    (cooldown / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// How long a delivery waits when its lane's shared slots are all taken
/// (by the workers of other instances) before it tries again.
const SHARED_FULL_WAIT: Duration = Duration::from_millis(50);
