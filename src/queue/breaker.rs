//! A lane's circuit breaker: closed, open for a cooldown after too many
//! consecutive failures, then one probe.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Deliveries flow; this many failed in a row.
    Closed(u32),
    /// No delivery starts before this instant.
    Open(Instant),
    /// The cooldown is over and one delivery (the probe) is under way.
    Probing,
}

/// The breaker of one lane.
#[derive(Debug)]
pub(crate) struct Breaker {
    failures: u32,
    cooldown: Duration,
    state: State,
}

impl Breaker {
    pub(crate) fn new(failures: u32, cooldown: Duration) -> Self {
        Self {
            failures: failures.max(1),
            cooldown,
            state: State::Closed(0),
        }
    }

    /// Until when it is open (possibly past: the probe is not sent yet).
    pub(crate) fn open_until(&self) -> Option<Instant> {
        match self.state {
            State::Open(until) => Some(until),
            _ => None,
        }
    }

    /// Whether the probe is under way.
    pub(crate) fn probing(&self) -> bool {
        self.state == State::Probing
    }

    /// Called when a delivery starts: `true` if it is the probe (the
    /// breaker was open and its cooldown is over).
    pub(crate) fn try_probe(&mut self, now: Instant) -> bool {
        match self.state {
            State::Open(until) if now >= until => {
                self.state = State::Probing;
                true
            }
            _ => false,
        }
    }

    /// Records a delivery's result (`up`: the upstream answered). While the
    /// breaker is open or probing, only the probe's result counts (calls
    /// that were under way when it opened end as they may).
    pub(crate) fn record(&mut self, probe: bool, up: bool, now: Instant, _lane: &Arc<str>) {
        self.state = match (self.state, probe, up) {
            (State::Closed(_), _, true) => State::Closed(0),
            (State::Closed(n), _, false) if n + 1 >= self.failures => {
                crate::outcome::log_warn!(
                    route = %_lane,
                    failures = n + 1,
                    cooldown = ?self.cooldown,
                    "upstream circuit breaker open: deliveries paused for the cooldown, then one probe"
                );
                State::Open(now + self.cooldown)
            }
            (State::Closed(n), _, false) => State::Closed(n + 1),
            (State::Probing, true, true) => {
                crate::outcome::log_info!(route = %_lane, "upstream circuit breaker closed: the probe was delivered; deliveries resume");
                State::Closed(0)
            }
            (State::Probing, true, false) => {
                crate::outcome::log_warn!(
                    route = %_lane,
                    cooldown = ?self.cooldown,
                    "upstream circuit breaker open again: the probe failed"
                );
                State::Open(now + self.cooldown)
            }
            (state, _, _) => state,
        };
    }

    /// `idempotency_upstream_breaker`: 0 closed, 1 open, 2 half-open (probing).
    pub(crate) fn gauge(&self) -> u8 {
        match self.state {
            State::Closed(_) => 0,
            State::Open(_) => 1,
            State::Probing => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_then_probes_once() {
        let lane: Arc<str> = "r".into();
        let mut b = Breaker::new(3, Duration::from_secs(30));
        let t = Instant::now();
        b.record(false, false, t, &lane);
        b.record(false, false, t, &lane);
        // A success in between starts the count again.
        b.record(false, true, t, &lane);
        b.record(false, false, t, &lane);
        b.record(false, false, t, &lane);
        assert_eq!(b.gauge(), 0);
        b.record(false, false, t, &lane);
        assert_eq!(b.gauge(), 1);
        assert_eq!(b.open_until(), Some(t + Duration::from_secs(30)));
        assert!(!b.try_probe(t + Duration::from_secs(29)));
        // A call that was under way ends: it changes nothing.
        b.record(false, true, t, &lane);
        assert_eq!(b.gauge(), 1);
        let end = t + Duration::from_secs(30);
        assert!(b.try_probe(end));
        assert!(b.probing());
        assert_eq!(b.gauge(), 2);
        // Exactly one probe.
        assert!(!b.try_probe(end));
        b.record(false, false, end, &lane);
        assert!(b.probing());
        // The probe fails: open for another cooldown.
        b.record(true, false, end, &lane);
        assert_eq!(b.open_until(), Some(end + Duration::from_secs(30)));
        let later = end + Duration::from_secs(30);
        assert!(b.try_probe(later));
        b.record(true, true, later, &lane);
        assert_eq!(b.gauge(), 0);
        // Closed again, with the count from zero.
        b.record(false, false, later, &lane);
        b.record(false, false, later, &lane);
        assert_eq!(b.gauge(), 0);
    }
}
