//! What the workers on one queue share, per lane: delivery slots (the
//! concurrency), turns (the rate) and the circuit breaker, each kept by a
//! queue that shares them ([`SharedPacing`]) and asked, before and after a
//! delivery, by every [`Worker`](crate::Worker) built with
//! [`shared_pacing`](crate::Worker::shared_pacing). A worker built without
//! holds no [`Ops`] and asks nothing. A queue that shares no breaker
//! answers `None`, and one that cannot answer stops nothing: the worker's
//! own limits and breaker hold meanwhile.

use super::breaker::{BreakerRule, BreakerState};
use super::pace::Role;
use super::Config;
use crate::{QueueError, QueueErrorKind, SharedPacing};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// The breaker methods of a [`SharedPacing`] impl whose queue shares slots
/// and turns but no breaker (each worker's own judges alone): every one
/// answers that nothing is shared, as the trait allows.
macro_rules! no_shared_breaker {
    () => {
        async fn breaker_state(
            &self,
            _lane: &str,
        ) -> Result<Option<$crate::BreakerState>, $crate::QueueError> {
            Ok(None)
        }

        async fn breaker_vote(
            &self,
            _lane: &str,
            _entry: u64,
            _ok: bool,
            _rule: $crate::BreakerRule,
        ) -> Result<Option<$crate::BreakerState>, $crate::QueueError> {
            Ok(None)
        }

        async fn take_probe(
            &self,
            _lane: &str,
            _rule: $crate::BreakerRule,
            _lease: std::time::Duration,
        ) -> Result<Option<$crate::BreakerState>, $crate::QueueError> {
            Ok(None)
        }

        async fn renew_probe(
            &self,
            _lane: &str,
            _probe: u64,
            _lease: std::time::Duration,
        ) -> Result<(), $crate::QueueError> {
            Ok(())
        }

        async fn settle_probe(
            &self,
            _lane: &str,
            _probe: u64,
            _up: Option<bool>,
            _fresh: bool,
            _rule: $crate::BreakerRule,
        ) -> Result<Option<$crate::BreakerState>, $crate::QueueError> {
            Ok(None)
        }
    };
}
pub(crate) use no_shared_breaker;

/// A boxed answer of a shared pacing call: boxed only on a worker that
/// shares (each is a round trip to the queue's server anyway).
pub(super) type Answer<'a, T> = Pin<Box<dyn Future<Output = Result<T, QueueError>> + Send + 'a>>;

/// The [`SharedPacing`] methods of a worker's queue `Q`, captured when the
/// worker was built with [`shared_pacing`](crate::Worker::shared_pacing)
/// (where `Q: SharedPacing` is known), so that the worker itself needs only
/// `Q: Queue`: a worker that paces alone holds none (`None`) and asks the
/// queue nothing. Function pointers, so a worker holding them is no bigger
/// than a pointer per method and needs no `'static` bound on `Q`.
pub(super) struct Ops<Q> {
    pub(super) take_slot: for<'a> fn(&'a Q, &'a str, usize, Duration) -> Answer<'a, Option<u64>>,
    pub(super) renew_slot: for<'a> fn(&'a Q, &'a str, u64, Duration) -> Answer<'a, ()>,
    pub(super) give_slot: for<'a> fn(&'a Q, &'a str, u64) -> Answer<'a, ()>,
    pub(super) take_turn: for<'a> fn(&'a Q, &'a str, Duration) -> Answer<'a, Option<Duration>>,
    pub(super) breaker_state: for<'a> fn(&'a Q, &'a str) -> Answer<'a, Option<BreakerState>>,
    pub(super) breaker_vote:
        for<'a> fn(&'a Q, &'a str, Vote, BreakerRule) -> Answer<'a, Option<BreakerState>>,
    pub(super) take_probe:
        for<'a> fn(&'a Q, &'a str, BreakerRule, Duration) -> Answer<'a, Option<BreakerState>>,
    pub(super) renew_probe: for<'a> fn(&'a Q, &'a str, u64, Duration) -> Answer<'a, ()>,
    pub(super) settle_probe:
        for<'a> fn(&'a Q, &'a str, ProbeResult, BreakerRule) -> Answer<'a, Option<BreakerState>>,
}

impl<Q> Clone for Ops<Q> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Q> Copy for Ops<Q> {}

impl<Q: SharedPacing> Ops<Q> {
    /// `Q`'s own.
    pub(super) fn of() -> Self {
        Self {
            take_slot: |q, lane, n, lease| Box::pin(q.take_slot(lane, n, lease)),
            renew_slot: |q, lane, slot, lease| Box::pin(q.renew_slot(lane, slot, lease)),
            give_slot: |q, lane, slot| Box::pin(q.give_slot(lane, slot)),
            take_turn: |q, lane, every| Box::pin(q.take_turn(lane, every)),
            breaker_state: |q, lane| Box::pin(q.breaker_state(lane)),
            breaker_vote: |q, lane, v, rule| Box::pin(q.breaker_vote(lane, v.entry, v.ok, rule)),
            take_probe: |q, lane, rule, lease| Box::pin(q.take_probe(lane, rule, lease)),
            renew_probe: |q, lane, probe, lease| Box::pin(q.renew_probe(lane, probe, lease)),
            settle_probe: |q, lane, p, rule| {
                Box::pin(q.settle_probe(lane, p.probe, p.up, p.fresh, rule))
            },
        }
    }
}

/// An entry's vote in the shared breaker.
#[derive(Debug, Clone, Copy)]
pub(super) struct Vote {
    pub(super) entry: u64,
    pub(super) ok: bool,
}

/// A shared probe's result.
#[derive(Debug, Clone, Copy)]
pub(super) struct ProbeResult {
    pub(super) probe: u64,
    /// What the call said of the upstream (`None`: nothing).
    pub(super) up: Option<bool>,
    /// The probe's entry had not failed before.
    pub(super) fresh: bool,
}

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
    let bound = super::renew_every(config.lease) / 2;
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
pub(super) async fn shared_turn<Q>(
    (queue, ops): (Q, Ops<Q>),
    config: Arc<Config>,
    lane: Arc<str>,
    (concurrency, rate): (Option<usize>, Option<crate::Rate>),
) -> Result<Option<u64>, Duration> {
    let mut slot = None;
    if let Some(n) = concurrency {
        match bounded(
            &config,
            "taking a shared slot",
            (ops.take_slot)(&queue, &lane, n, config.lease),
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
            (ops.take_turn)(&queue, &lane, rate.interval()),
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
                    (ops.give_slot)(&queue, &lane, taken),
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
pub(super) async fn shared_gate<Q>(
    (queue, ops): (&Q, Ops<Q>),
    config: &Config,
    lane: &Arc<str>,
    rule: BreakerRule,
    role: Role,
    lease: Duration,
) -> SharedGate {
    let probe = role.is_probe();
    let asked = match role {
        Role::Plain => {
            bounded(
                config,
                "asking the shared breaker",
                (ops.breaker_state)(queue, lane),
            )
            .await
        }
        Role::Probe => {
            bounded(
                config,
                "taking a shared probe",
                (ops.take_probe)(queue, lane, rule, lease),
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

/// What a finished call puts to the lane's shared breaker.
#[derive(Debug, Clone, Copy)]
pub(super) struct Judging {
    /// Its entry (see `breaker::entry_of`), whose vote it casts.
    pub(super) entry: u64,
    /// The shared probe it was, if it was one: settled instead of a vote.
    pub(super) probe: Option<u64>,
    /// The probe's entry had not failed before.
    pub(super) fresh: bool,
}

/// Casts a finished call's vote in the lane's shared breaker, or settles
/// its shared probe; what the breaker answered. `up` is what the result
/// says of the upstream (`None`: nothing, no vote).
pub(super) async fn judged<Q>(
    (queue, ops): (&Q, Ops<Q>),
    config: &Config,
    lane: &Arc<str>,
    Judging {
        entry,
        probe,
        fresh,
    }: Judging,
    up: Option<bool>,
    rule: BreakerRule,
) -> Option<BreakerState> {
    let answered = match (probe, up) {
        (Some(id), up) => {
            let settled = (ops.settle_probe)(
                queue,
                lane,
                ProbeResult {
                    probe: id,
                    up,
                    fresh,
                },
                rule,
            );
            bounded(config, "settling a shared probe", settled).await
        }
        (None, Some(ok)) => {
            let voted = (ops.breaker_vote)(queue, lane, Vote { entry, ok }, rule);
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
    crate::metrics::breaker_shared_error(lane);
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
