//! [`Worker`]'s lanes: the lines of deliveries waiting for their turn, and
//! what each lane lets start.

use super::pace::{Admit, Lane, Role};
use super::Act;
use crate::{Delivery, Message, Queue, Worker};
use std::time::{Duration, Instant};

impl<Q: Queue, S> Worker<Q, S> {
    pub(super) fn lane_index(&self, message: &Message) -> usize {
        let Some(name) = self.lane_of.as_ref().and_then(|f| f(message)) else {
            return 0;
        };
        self.lanes
            .iter()
            .skip(1)
            .position(|l| l.name == name)
            .map_or(0, |i| i + 1)
    }

    pub(super) fn waiting(&self) -> usize {
        self.lanes.iter().map(|l| l.waiting.len()).sum()
    }

    /// How many more deliveries the lanes may hold together; `None` when
    /// one of them has no bound. More fetched would only be given back.
    pub(super) fn room(&self) -> Option<usize> {
        self.lanes.iter().map(Lane::room).sum()
    }

    /// Deliveries calling the service (until they are settled).
    pub(super) fn calls(&self) -> usize {
        self.lanes.iter().map(|l| l.running).sum()
    }

    /// Renews the lease of every delivery waiting for its lane's turn
    /// (waiting is not a handout: it must not run out meanwhile). The
    /// future borrows nothing of the worker.
    pub(super) fn renew_waiting(&self) -> impl std::future::Future<Output = ()> + use<Q, S> {
        let (queue, config) = (self.queue.clone(), self.config.clone());
        let waiting: Vec<Delivery> = self
            .lanes
            .iter()
            .flat_map(|l| l.waiting.iter().cloned())
            .collect();
        async move {
            let renewals = waiting.iter().map(|d| queue.renew(d, config.lease));
            for result in futures_util::future::join_all(renewals).await {
                if let Err(_e) = result {
                    crate::log_warn!(queue = %config.name, error = %_e, "cannot renew the lease of a waiting delivery");
                }
            }
        }
    }

    pub(super) fn gauges(&self) {
        for lane in &self.lanes {
            lane.gauges();
        }
    }

    /// Puts a fetched delivery in its lane's line, or says what to do with
    /// it at once (`skip_full`: give it back if its lane is full).
    pub(super) fn enqueue(
        &mut self,
        delivery: Delivery,
        skip_full: bool,
    ) -> Option<(usize, Delivery, Act)> {
        let i = self.lane_index(&delivery.message);
        // Handed out more often than it may fail without ever settling: its
        // deliveries died with the process (or outlived their lease).
        if delivery.attempt > self.config.max_attempts {
            return Some((i, delivery, Act::Unsettled));
        }
        let lane = &mut self.lanes[i];
        let wait = lane.rate_wait(Instant::now());
        if wait > self.config.lease / 2 {
            return Some((i, delivery, Act::Postpone(wait, RATE)));
        }
        // Its lane holds all it may and its turn would not come soon: back
        // to the queue for a moment, so that the fetch budget goes to the
        // other lanes' entries.
        if skip_full && lane.full() && !lane.quick(Instant::now()) {
            let after = lane.overflow_wait(Instant::now());
            return Some((i, delivery, Act::Postpone(after, FULL)));
        }
        lane.waiting.push_back(delivery);
        None
    }

    /// Takes from the lanes' lines what may start now, and (`skip_full`, as
    /// for [`enqueue`](Self::enqueue)) what a lane that is no longer quick
    /// holds past its room, to be given back; and when to look again (for
    /// the rate, or for a lane that may stop being quick).
    pub(super) fn admit(
        &mut self,
        skip_full: bool,
    ) -> (Vec<(usize, Delivery, Act)>, Option<Instant>) {
        let now = Instant::now();
        let (mut ready, mut wake) = (Vec::new(), None::<Instant>);
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            while !lane.waiting.is_empty() {
                let act = match lane.admit(now) {
                    Admit::Go(role) => {
                        lane.started();
                        Act::Call(role)
                    }
                    Admit::Postpone(after) => Act::Postpone(after, OPEN),
                    Admit::Wait(at) => {
                        wake = sooner(wake, at);
                        break;
                    }
                };
                let role = match act {
                    Act::Call(role) => role,
                    _ => Role::Plain,
                };
                let delivery = lane.take(role).expect("not empty");
                ready.push((i, delivery, act));
            }
            if !skip_full {
                continue;
            }
            // Kept past its room while it was quick, given back once not.
            let (excess, slow_at) = lane.excess(now);
            for delivery in excess {
                let after = lane.overflow_wait(now);
                ready.push((i, delivery, Act::Postpone(after, FULL)));
            }
            wake = sooner(wake, slow_at);
        }
        (ready, wake)
    }

    /// Every waiting delivery, given back to the queue (at shutdown).
    pub(super) fn release(&mut self) -> Vec<(usize, Delivery, Act)> {
        let mut out = Vec::new();
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            out.extend(
                lane.waiting
                    .drain(..)
                    .map(|d| (i, d, Act::Postpone(Duration::ZERO, STOPPED))),
            );
        }
        out
    }
}

/// The sooner of two instants, either of which may be none.
fn sooner(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

const RATE: &str = "the route's delivery rate left no turn within the lease";
const FULL: &str = "the route's deliveries are at their concurrency";
const OPEN: &str = "the upstream's circuit breaker is open";
const STOPPED: &str = "the worker stopped before its turn";
