//! How a [`Worker`](crate::Worker)'s deliveries are settled in the queue,
//! and what one round did.

use crate::{Delivery, Queue, QueueError};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::consumer::{Disposition, Failure};

/// What one [`Worker::run_once`](crate::Worker::run_once) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerRound {
    /// Entries handed to the service.
    pub fetched: usize,
    /// Delivered and acknowledged.
    pub delivered: usize,
    /// Failed; due again after their backoff.
    pub retried: usize,
    /// Failed for the last time; moved to the dead letters.
    pub dead_lettered: usize,
    /// Finished after their lease ran out and the entry went to another
    /// worker (its consumer keeps the handler from running twice).
    pub lease_lost: usize,
    /// Not delivered for want of a route, and kept: tried again later,
    /// never dead-lettered for it (see `idempotency_queue_stranded`).
    pub kept: usize,
    /// Not delivered because the circuit breaker was open, the rate left
    /// no turn within the lease, the lane was full, or the deliverer held it
    /// back itself (a gateway's own limit shed it): due again later, the
    /// attempt not counted.
    pub paused: usize,
}

/// How one delivery was settled, and whether its lease still held the
/// entry when it was.
pub(super) enum Settled {
    Delivered(Lease),
    Retried(Lease),
    DeadLettered(Lease),
    Kept(Lease),
    Paused(Lease),
}

/// Whether a delivery's lease still held its entry when it was settled
/// (what [`Queue::ack`] and the others answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lease {
    /// Settled by this delivery.
    Held,
    /// Lost: the lease ran out and the entry went to another worker.
    Lost,
}

impl From<bool> for Lease {
    /// A queue's answer: `true` if the lease still held.
    fn from(held: bool) -> Self {
        match held {
            true => Self::Held,
            false => Self::Lost,
        }
    }
}

/// Where a delivery stands in its entry's attempts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Attempted {
    /// The entry's last attempt: a failure the worker retries dead-letters
    /// it.
    pub(super) last: bool,
    /// How long the entry waits after a failure (or a hold) before it is
    /// due again.
    pub(super) backoff: Duration,
}

impl WorkerRound {
    pub(super) fn record(&mut self, settled: Settled) {
        let lease = match settled {
            Settled::Delivered(lease) => {
                self.delivered += 1;
                lease
            }
            Settled::Retried(lease) => {
                self.retried += 1;
                lease
            }
            Settled::DeadLettered(lease) => {
                self.dead_lettered += 1;
                lease
            }
            Settled::Kept(lease) => {
                self.kept += 1;
                lease
            }
            Settled::Paused(lease) => {
                self.paused += 1;
                lease
            }
        };
        self.lease_lost += usize::from(lease == Lease::Lost);
    }
}

/// How long an entry that no route delivers now waits before it is tried
/// again (its due time outlives a restart with the route configured).
const KEPT_FOR: Duration = Duration::from_secs(10);

/// How long an entry of a paused route waits before it is handed out again
/// when it is not parked (a queue that does not park, a worker not told
/// to): long enough that a paused route's entries, however many, cost the
/// worker little (10,000 of them: about 330 looks a second, none of them a
/// call); a resumed route's entries are delivered within it.
const PAUSED_FOR: Duration = Duration::from_secs(30);

/// What a delivery's result says of the upstream: `Some(true)` it answered
/// (delivered, or an answer that cannot succeed), `Some(false)` it failed,
/// `None` nothing (no route delivers the entry now, or the deliverer held it
/// back itself).
pub(super) fn verdict<E: Failure>(result: &Result<(), E>) -> Option<bool> {
    match result {
        Ok(()) => Some(true),
        Err(e) => match e.disposition() {
            Disposition::Retry => Some(false),
            Disposition::Permanent => Some(true),
            Disposition::Keep | Disposition::Hold | Disposition::Pause => None,
        },
    }
}

/// Dead-letters an entry handed out past `max_attempts` times without a
/// result.
pub(super) async fn unsettled<Q: Queue>(
    queue: &Q,
    name: &Arc<str>,
    delivery: &Delivery,
) -> Result<Settled, QueueError> {
    let why = format!(
        "handed out {} times without settling (each delivery died with its process or outlived its lease)",
        delivery.attempt
    );
    crate::metrics::attempt(
        name,
        "dead_lettered",
        delivery.message.destination.as_deref(),
    );
    crate::log_warn!(queue = %name, entry = %delivery.id, "{why}; dead-lettered");
    Ok(Settled::DeadLettered(
        queue.dead_letter(delivery, &why).await?.into(),
    ))
}

/// Settles a delivery by its result: acknowledged, retried after `after`,
/// kept, postponed after `after` without counting the attempt (held back by
/// the deliverer itself), or dead-lettered (`last`: this was the last
/// attempt).
pub(super) async fn settle<Q: Queue, E: Failure>(
    queue: &Q,
    (name, parker): (&Arc<str>, Option<&super::park::Parker>),
    Attempted { last, backoff }: Attempted,
    delivery: &Delivery,
    result: Result<(), E>,
) -> Result<Settled, QueueError> {
    let e = match result {
        Ok(()) => {
            crate::metrics::attempt(name, "delivered", delivery.message.destination.as_deref());
            return Ok(Settled::Delivered(queue.ack(delivery).await?.into()));
        }
        Err(e) => e,
    };
    // Kept short: an upstream's huge error body does not grow the entry.
    let text = e.to_string();
    let text = crate::attempts::cut(&text);
    Ok(match e.disposition() {
        Disposition::Keep => {
            crate::metrics::attempt(name, "kept", delivery.message.destination.as_deref());
            Settled::Kept(queue.postpone(delivery, KEPT_FOR, text).await?.into())
        }
        Disposition::Pause => {
            crate::metrics::attempt(name, "paused", delivery.message.destination.as_deref());
            if let Some(parker) = parker
                && let Some(parked) = parker.park(delivery).await
            {
                return Ok(Settled::Paused(parked?.into()));
            }
            Settled::Paused(queue.postpone(delivery, PAUSED_FOR, text).await?.into())
        }
        Disposition::Hold => {
            crate::metrics::attempt(name, "postponed", delivery.message.destination.as_deref());
            Settled::Paused(queue.postpone(delivery, backoff, text).await?.into())
        }
        Disposition::Permanent => {
            crate::metrics::attempt(
                name,
                "dead_lettered",
                delivery.message.destination.as_deref(),
            );
            crate::log_warn!(queue = %name, entry = %delivery.id, error = %e, "delivery cannot succeed; dead-lettered at once");
            Settled::DeadLettered(queue.dead_letter(delivery, text).await?.into())
        }
        Disposition::Retry if last => {
            crate::metrics::attempt(
                name,
                "dead_lettered",
                delivery.message.destination.as_deref(),
            );
            crate::log_warn!(queue = %name, entry = %delivery.id, error = %e, "delivery failed for the last time; dead-lettered");
            Settled::DeadLettered(queue.dead_letter(delivery, text).await?.into())
        }
        Disposition::Retry => {
            crate::metrics::attempt(name, "retried", delivery.message.destination.as_deref());
            Settled::Retried(queue.retry(delivery, backoff, text).await?.into())
        }
    })
}
