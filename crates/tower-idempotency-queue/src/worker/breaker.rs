//! A lane's circuit breaker: it judges the upstream on a failure rate over
//! the notifications delivered lately (each has one vote, its latest
//! result), opens for a cooldown when too many of them failed, then admits
//! a few probes.
//!
//! On a worker built with [`shared_pacing`](crate::Worker::shared_pacing)
//! over a queue that shares a breaker (Redis Streams) the judgement and the
//! state live in the queue ([`BreakerState`]: the votes, the open state, the
//! probes' leases), and this breaker follows what the queue answers; it
//! judges alone on a worker that paces alone, on a queue that shares no
//! breaker, and whenever the queue cannot answer.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a notification's vote counts after its latest delivery.
pub(crate) const WINDOW: Duration = Duration::from_secs(60);
/// The most votes kept (the oldest go first).
const MAX_VOTES: usize = 4096;
/// The share of failed votes that opens the breaker (with at least
/// `failures` of them).
const FAILURE_RATE: f64 = 0.5;
/// The most probes a half-open breaker admits (and no more than its
/// `failures`).
pub(crate) const MAX_PROBES: u32 = 3;

/// The share of failed votes that opens the breaker, in per mille (for the
/// shared breaker's script).
#[cfg(feature = "redis")]
pub(crate) const FAILURE_PER_MILLE: u32 = (FAILURE_RATE * 1000.0) as u32;
/// The most votes kept, for the shared breaker's script.
#[cfg(feature = "redis")]
pub(crate) const MAX_SHARED_VOTES: usize = MAX_VOTES;

/// Where a lane's breaker shared by every instance on a queue stands, as
/// the queue answers it (see [`SharedPacing::breaker_vote`](crate::SharedPacing::breaker_vote)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Deliveries flow.
    Closed,
    /// No delivery starts for this long.
    Open(Duration),
    /// The cooldown is over: a few probes may go.
    HalfOpen,
    /// Half-open, and every probe is out (with another instance, perhaps):
    /// wait for their results (or for their leases to run out).
    ProbesOut,
    /// Half-open, and this probe (its id) was taken, leased to the caller:
    /// renew it while its delivery runs, settle it with its result.
    Probe(u64),
}

/// What a lane's breaker is set to, for the shared breaker's scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BreakerRule {
    /// The least failed votes that open it (and they are at least half).
    pub failures: u32,
    /// How long it stays open.
    pub cooldown: Duration,
    /// The most probes a half-open breaker admits at once (across every
    /// instance).
    pub probes: u32,
}

impl BreakerRule {
    /// Opens after `failures` failed votes (at least half of them), stays
    /// open for `cooldown`, then admits at most `probes` probes at once.
    pub const fn new(failures: u32, cooldown: Duration, probes: u32) -> Self {
        Self {
            failures,
            cooldown,
            probes,
        }
    }
}

/// An entry's identity in the breaker: its key, hashed.
pub(crate) fn entry_of(key: &str) -> u64 {
    foldhash::quality::FixedState::with_seed(0xb4e4).hash_one(key)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Deliveries flow.
    Closed,
    /// No delivery starts before this instant.
    Open(Instant),
    /// The cooldown is over: up to `MAX_PROBES` probes are admitted.
    HalfOpen {
        /// Probes admitted so far (a probe that said nothing is given back).
        started: u32,
        /// The probes under way: their entry, and whether it had not failed
        /// before (its failure then speaks of the upstream).
        running: Vec<(u64, bool)>,
    },
}

/// What the breaker lets a lane do with its next delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Closed: deliver.
    Pass,
    /// Open: postpone by this long.
    Open(Duration),
    /// Half-open: the next delivery may be a probe.
    Probe,
    /// Half-open, every probe admitted: wait for their results.
    Wait,
}

/// One notification's vote: its latest result.
#[derive(Debug, Clone, Copy)]
struct Vote {
    ok: bool,
    seq: u64,
}

/// The votes of the notifications delivered within [`WINDOW`].
#[derive(Debug, Default)]
struct Votes {
    /// In the order cast: entry, sequence number, when.
    order: VecDeque<(u64, u64, Instant)>,
    /// The live vote of each entry.
    live: HashMap<u64, Vote>,
    failed: usize,
    seq: u64,
}

impl Votes {
    fn cast(&mut self, entry: u64, ok: bool, now: Instant) {
        self.expire(now);
        self.seq += 1;
        let vote = Vote { ok, seq: self.seq };
        if let Some(old) = self.live.insert(entry, vote) {
            self.failed -= usize::from(!old.ok);
        }
        self.failed += usize::from(!ok);
        self.order.push_back((entry, self.seq, now));
        while self.order.len() > MAX_VOTES {
            self.pop();
        }
    }

    fn expire(&mut self, now: Instant) {
        while self
            .order
            .front()
            .is_some_and(|(_, _, at)| now.saturating_duration_since(*at) > WINDOW)
        {
            self.pop();
        }
    }

    /// Drops the oldest vote cast (if it is still its entry's live one).
    fn pop(&mut self) {
        let Some((entry, seq, _)) = self.order.pop_front() else {
            return;
        };
        if self.live.get(&entry).is_some_and(|v| v.seq == seq) {
            let vote = self.live.remove(&entry).expect("just seen");
            self.failed -= usize::from(!vote.ok);
        }
    }

    fn failed_entry(&self, entry: u64) -> bool {
        self.live.get(&entry).is_some_and(|v| !v.ok)
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// The breaker of one lane.
#[derive(Debug)]
pub(crate) struct Breaker {
    failures: u32,
    cooldown: Duration,
    votes: Votes,
    state: State,
}

impl Breaker {
    pub(crate) fn new(failures: u32, cooldown: Duration) -> Self {
        Self {
            failures: failures.max(1),
            cooldown,
            votes: Votes::default(),
            state: State::Closed,
        }
    }

    fn probes(&self) -> u32 {
        self.failures.min(MAX_PROBES)
    }

    /// What the next delivery may do now (changes nothing).
    pub(crate) fn gate(&self, now: Instant) -> Gate {
        match &self.state {
            State::Closed => Gate::Pass,
            State::Open(until) if now < *until => Gate::Open(*until - now),
            State::Open(_) => Gate::Probe,
            State::HalfOpen { started, .. } if *started < self.probes() => Gate::Probe,
            State::HalfOpen { .. } => Gate::Wait,
        }
    }

    /// Whether `entry`'s latest delivery failed (a probe prefers one that
    /// did not).
    pub(crate) fn failed_before(&self, entry: u64) -> bool {
        self.votes.failed_entry(entry)
    }

    /// A probe starts for `entry` (`fresh`: it had not failed before). Call
    /// only after [`gate`](Self::gate) said [`Gate::Probe`].
    pub(crate) fn start_probe(&mut self, entry: u64, fresh: bool) {
        if let State::Open(_) = self.state {
            self.state = State::HalfOpen {
                started: 0,
                running: Vec::new(),
            };
        }
        if let State::HalfOpen { started, running } = &mut self.state {
            *started += 1;
            running.push((entry, fresh));
        }
    }

    /// Records a delivery's result for `entry`: `up` is `Some(true)` when
    /// the upstream answered, `Some(false)` when it failed, `None` when the
    /// result says nothing of it (no route, held back by the gateway). While
    /// the breaker is open or half-open only the probes' results count
    /// (calls under way when it opened end as they may).
    pub(crate) fn record(
        &mut self,
        entry: u64,
        probe: bool,
        up: Option<bool>,
        now: Instant,
        _lane: &Arc<str>,
    ) {
        match &mut self.state {
            State::Closed => {
                let Some(ok) = up else { return };
                self.votes.cast(entry, ok, now);
                let failed = self.votes.failed;
                let rate = failed as f64 / self.votes.live.len().max(1) as f64;
                if !ok && failed >= self.failures as usize && rate >= FAILURE_RATE {
                    crate::log_warn!(
                        route = %_lane,
                        failed,
                        of = self.votes.live.len(),
                        cooldown = ?self.cooldown,
                        "upstream circuit breaker open: most notifications delivered lately failed; deliveries paused for the cooldown, then a few probes"
                    );
                    self.state = State::Open(now + self.cooldown);
                }
            }
            State::HalfOpen { started, running } if probe => {
                let Some(at) = running.iter().position(|(e, _)| *e == entry) else {
                    return;
                };
                let (_, fresh) = running.swap_remove(at);
                match up {
                    Some(true) => {
                        crate::log_info!(route = %_lane, "upstream circuit breaker closed: a probe was delivered; deliveries resume");
                        self.votes.clear();
                        self.state = State::Closed;
                        return;
                    }
                    // Said nothing: another probe may go in its place.
                    None => *started -= 1,
                    Some(false) => self.votes.cast(entry, false, now),
                }
                let all_failed = *started >= self.failures.min(MAX_PROBES) && running.is_empty();
                if up == Some(false) && (fresh || all_failed) {
                    crate::log_warn!(
                        route = %_lane,
                        cooldown = ?self.cooldown,
                        "upstream circuit breaker open again: the probe failed"
                    );
                    self.state = State::Open(now + self.cooldown);
                }
            }
            _ => {}
        }
    }

    /// Records a delivery's result as [`record`](Self::record) does, but
    /// the breaker shared on the queue judged it: this one keeps the vote
    /// (so that a probe still prefers entries that have not failed, and the
    /// judgement is warm if the queue stops answering) and follows `state`.
    pub(crate) fn record_shared(
        &mut self,
        entry: u64,
        probe: bool,
        up: Option<bool>,
        now: Instant,
        state: BreakerState,
        lane: &Arc<str>,
    ) {
        if let Some(ok) = up
            && (probe || self.state == State::Closed)
        {
            self.votes.cast(entry, ok, now);
        }
        if let (State::HalfOpen { started, running }, true) = (&mut self.state, probe)
            && let Some(at) = running.iter().position(|(e, _)| *e == entry)
        {
            running.swap_remove(at);
            *started = started.saturating_sub(u32::from(up.is_none()));
        }
        self.follow(state, now, lane);
    }

    /// Takes the state the shared breaker answered. Half-open, this one
    /// counts only its own probes under way: how many more may go is the
    /// shared breaker's to say (a probe is asked of it before it starts).
    pub(crate) fn follow(&mut self, state: BreakerState, now: Instant, _lane: &Arc<str>) {
        match state {
            BreakerState::Closed => {
                if self.state != State::Closed {
                    crate::log_info!(route = %_lane, "upstream circuit breaker closed (shared): a probe was delivered; deliveries resume");
                    self.votes.clear();
                    self.state = State::Closed;
                }
            }
            BreakerState::Open(left) => {
                if self.state == State::Closed {
                    crate::log_warn!(
                        route = %_lane,
                        cooldown = ?left,
                        "upstream circuit breaker open (shared by the instances on the queue): most notifications delivered lately failed; deliveries paused for the cooldown, then a few probes"
                    );
                }
                self.state = State::Open(now + left);
            }
            BreakerState::HalfOpen | BreakerState::ProbesOut | BreakerState::Probe(_) => {
                match &mut self.state {
                    State::HalfOpen { started, running } => *started = running.len() as u32,
                    _ => {
                        self.state = State::HalfOpen {
                            started: 0,
                            running: Vec::new(),
                        }
                    }
                }
            }
        }
    }

    /// What the breaker is set to.
    pub(crate) fn rule(&self) -> BreakerRule {
        BreakerRule {
            failures: self.failures,
            cooldown: self.cooldown,
            probes: self.probes(),
        }
    }

    /// `idempotency_upstream_breaker`: 0 closed, 1 open, 2 half-open (probing).
    pub(crate) fn gauge(&self) -> u8 {
        match self.state {
            State::Closed => 0,
            State::Open(_) => 1,
            State::HalfOpen { .. } => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane() -> Arc<str> {
        "r".into()
    }

    #[test]
    fn a_minority_failing_again_and_again_never_opens_it() {
        let mut b = Breaker::new(10, Duration::from_secs(30));
        let t = Instant::now();
        // 100 notifications, every fifth failing; each failing one fails
        // again and again (its own retries vote only once).
        for i in 0..100u64 {
            b.record(i, false, Some(!i.is_multiple_of(5)), t, &lane());
        }
        for _ in 0..10 {
            for i in (0..100u64).step_by(5) {
                b.record(i, false, Some(false), t, &lane());
                assert_eq!(b.gauge(), 0);
            }
        }
        // A vote lasts for the window only.
        let later = t + WINDOW + Duration::from_secs(1);
        for i in 0..9u64 {
            b.record(1000 + i, false, Some(false), later, &lane());
        }
        assert_eq!(b.gauge(), 0, "9 failures, under the 10 needed");
        b.record(2000, false, Some(false), later, &lane());
        assert_eq!(b.gauge(), 1, "10 of 10 failed: open");
    }

    #[test]
    fn half_open_admits_a_few_probes_and_a_probe_that_says_nothing_is_given_back() {
        let mut b = Breaker::new(10, Duration::from_secs(30));
        let t = Instant::now();
        for i in 0..10u64 {
            b.record(i, false, Some(false), t, &lane());
        }
        assert_eq!(b.gate(t), Gate::Open(Duration::from_secs(30)));
        // A call under way when it opened changes nothing.
        b.record(99, false, Some(true), t, &lane());
        assert_eq!(b.gauge(), 1);
        let end = t + Duration::from_secs(30);
        assert_eq!(b.gate(end), Gate::Probe);
        assert!(b.failed_before(3) && !b.failed_before(50));
        for e in [50, 51, 52] {
            assert_eq!(b.gate(end), Gate::Probe);
            b.start_probe(e, true);
        }
        assert_eq!(b.gauge(), 2);
        assert_eq!(b.gate(end), Gate::Wait, "three probes at most");
        // A probe kept back (no route): its place goes to another.
        b.record(50, true, None, end, &lane());
        assert_eq!(b.gate(end), Gate::Probe);
        b.start_probe(3, false);
        // A probe that had failed before fails again: says little.
        b.record(3, true, Some(false), end, &lane());
        assert_eq!(b.gauge(), 2);
        // One that had not succeeds: closed.
        b.record(51, true, Some(true), end, &lane());
        assert_eq!(b.gauge(), 0);
        // Closed afresh: nine failures do not open it.
        for i in 0..9u64 {
            b.record(i, false, Some(false), end, &lane());
        }
        assert_eq!(b.gauge(), 0);
    }

    #[test]
    fn it_follows_the_shared_breaker_and_keeps_its_votes_for_a_fallback() {
        let mut b = Breaker::new(3, Duration::from_secs(30));
        let t = Instant::now();
        // The shared one judged: these votes open nothing here...
        for i in 0..5u64 {
            b.record_shared(i, false, Some(false), t, BreakerState::Closed, &lane());
        }
        assert_eq!(b.gauge(), 0);
        assert!(b.failed_before(2), "the votes are kept");
        // ...but open it when the shared one says so.
        let left = Duration::from_secs(10);
        b.follow(BreakerState::Open(left), t, &lane());
        assert_eq!(b.gate(t), Gate::Open(left));
        // Half-open: only its own probes count here; the shared one says
        // how many more may go (so this one never waits for good).
        let end = t + left;
        b.follow(BreakerState::HalfOpen, end, &lane());
        b.start_probe(7, true);
        b.start_probe(8, true);
        b.start_probe(9, true);
        assert_eq!(b.gate(end), Gate::Wait);
        b.record_shared(7, true, Some(false), end, BreakerState::HalfOpen, &lane());
        assert_eq!(b.gate(end), Gate::Probe, "two under way here");
        b.record_shared(8, true, Some(true), end, BreakerState::Closed, &lane());
        assert_eq!(b.gauge(), 0);
        // The shared one cannot answer: this one judges alone again, on a
        // fresh window (closing forgot the votes).
        for i in 20..23u64 {
            b.record(i, false, Some(false), end, &lane());
        }
        assert_eq!(b.gauge(), 1);
    }

    #[test]
    fn a_fresh_probe_failing_opens_it_again() {
        let mut b = Breaker::new(1, Duration::from_secs(30));
        let t = Instant::now();
        b.record(1, false, Some(false), t, &lane());
        let end = t + Duration::from_secs(30);
        assert_eq!(b.gate(end), Gate::Probe);
        b.start_probe(2, true);
        assert_eq!(b.gate(end), Gate::Wait, "no more probes than failures");
        b.record(2, true, Some(false), end, &lane());
        assert_eq!(b.gate(end), Gate::Open(Duration::from_secs(30)));
    }
}
