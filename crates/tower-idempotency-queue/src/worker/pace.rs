//! [`Pace`]: how fast a [`Worker`](crate::Worker) delivers (concurrency, a
//! rate, a retry schedule and a circuit breaker), and the state of one lane
//! of its deliveries.

use super::breaker::{entry_of, Breaker, Gate};
use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a worker paces the deliveries of one lane (all of them, or those
/// [`Worker::lanes`](crate::Worker::lanes) sends to it).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency_queue::{Pace, Rate};
///
/// let pace = Pace::new()
///     .concurrency(20)
///     .rate("200/s".parse::<Rate>().unwrap())
///     .retry_schedule([15, 15, 30, 180, 600].map(Duration::from_secs))
///     .breaker(10, Duration::from_secs(30));
/// assert_eq!(pace.get_concurrency(), Some(20));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pace {
    concurrency: Option<usize>,
    rate: Option<Rate>,
    schedule: Option<Arc<[Duration]>>,
    breaker: Option<(u32, Duration)>,
}

impl Pace {
    /// No limits: as many deliveries at once as the worker's batch, no
    /// rate, the worker's exponential backoff, no breaker.
    pub fn new() -> Self {
        Self::default()
    }

    /// At most `n` deliveries in flight at once (at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// At most `rate` deliveries started, evenly spaced.
    pub fn rate(mut self, rate: Rate) -> Self {
        self.rate = Some(rate);
        self
    }

    /// The waits after failures, used instead of the exponential backoff:
    /// after the `n`th failure the entry waits a time drawn uniformly from
    /// `[0, delays[n - 1]]` (full jitter, so that a backlog that failed
    /// together does not come back together); past the list's end its last
    /// delay repeats. An empty list keeps the backoff.
    pub fn retry_schedule(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        let delays: Arc<[Duration]> = delays.into_iter().collect();
        self.schedule = (!delays.is_empty()).then_some(delays);
        self
    }

    /// A circuit breaker that judges the upstream, not single
    /// notifications: each notification delivered in the last minute has
    /// one vote, the result of its latest delivery, and the breaker opens
    /// when at least `failures` of them (at least 1) failed and they are at
    /// least half. A minority failing on their own, however often they are
    /// retried, never opens it. Open, no delivery starts for `cooldown` (the
    /// entries due meanwhile are postponed to its end, their attempts not
    /// counted); then it admits up to 3 probes (no more than `failures`),
    /// preferring entries that have not failed: a probe delivered closes it;
    /// a probe that had not failed before and fails, or all three failing,
    /// open it for another `cooldown`; a probe whose result says nothing of
    /// the upstream (no route for it now, or the gateway held it back) makes
    /// room for another. A delivery failed when the service returned an
    /// error the worker retries; an answer that cannot succeed (dead-lettered
    /// at once) shows the upstream is up.
    ///
    /// On a worker built with [`shared_pacing`](crate::Worker::shared_pacing)
    /// over a queue that shares a breaker (`RedisStreamsQueue`) the votes,
    /// the open state and the probes are the queue's (per lane name), so
    /// the breaker judges on every instance's deliveries and its 3 probes
    /// are for all of them together, each leased like the entry (one whose
    /// worker died makes room for another when its lease runs out); while
    /// the queue cannot answer, each worker's breaker judges alone.
    pub fn breaker(mut self, failures: u32, cooldown: Duration) -> Self {
        self.breaker = Some((failures.max(1), cooldown));
        self
    }

    /// The concurrency limit set with [`concurrency`](Self::concurrency), if
    /// any.
    pub fn get_concurrency(&self) -> Option<usize> {
        self.concurrency
    }

    /// The rate set with [`rate`](Self::rate), if any.
    pub fn get_rate(&self) -> Option<Rate> {
        self.rate
    }

    /// The schedule set with [`retry_schedule`](Self::retry_schedule), if any.
    pub fn get_retry_schedule(&self) -> Option<&[Duration]> {
        self.schedule.as_deref()
    }

    /// The breaker's failures and cooldown set with
    /// [`breaker`](Self::breaker), if any.
    pub fn get_breaker(&self) -> Option<(u32, Duration)> {
        self.breaker
    }

    /// The wait after the `attempt`th failure, if a schedule is set:
    /// uniform in `[0, delay]`.
    pub(super) fn scheduled_wait(&self, attempt: u32) -> Option<Duration> {
        let schedule = self.schedule.as_deref()?;
        let i = (attempt.max(1) as usize - 1).min(schedule.len() - 1);
        Some(jitter(schedule[i], random()))
    }
}

/// `delay × r / 2^64`: uniform in `[0, delay]` for a uniform `r`.
fn jitter(delay: Duration, r: u64) -> Duration {
    let nanos = delay.as_nanos().min(u64::MAX as u128);
    let scaled = (nanos * (r as u128 + 1)) >> 64;
    Duration::from_nanos(scaled as u64)
}

fn random() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        // No entropy source: the clock's low bits still spread the waits.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| {
                u64::from(d.subsec_nanos()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            })
    })
}

/// A rate: `n` per `per`, written `"200/s"` or `"30/m"` (also `"/h"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    n: u32,
    per: Duration,
}

impl Rate {
    /// `n` (at least 1) per `per` (more than zero).
    pub fn new(n: u32, per: Duration) -> Self {
        Self {
            n: n.max(1),
            per: per.max(Duration::from_nanos(1)),
        }
    }

    /// `n` per second.
    pub fn per_second(n: u32) -> Self {
        Self::new(n, Duration::from_secs(1))
    }

    /// `n` per minute.
    pub fn per_minute(n: u32) -> Self {
        Self::new(n, Duration::from_secs(60))
    }

    /// The time between two starts.
    pub fn interval(&self) -> Duration {
        self.per / self.n
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.per.as_secs() {
            1 if self.per.subsec_nanos() == 0 => write!(f, "{}/s", self.n),
            60 if self.per.subsec_nanos() == 0 => write!(f, "{}/m", self.n),
            3600 if self.per.subsec_nanos() == 0 => write!(f, "{}/h", self.n),
            _ => write!(f, "{} per {:?}", self.n, self.per),
        }
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected a rate like \"200/s\", \"30/m\" or \"100/h\"");
        let (n, unit) = s.trim().split_once('/').ok_or_else(bad)?;
        let n: u32 = n.trim().parse().map_err(|_| bad())?;
        let per = match unit.trim() {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        if n == 0 {
            return Err(format!("`{s}`: the rate must be more than 0"));
        }
        Ok(Self::new(n, per))
    }
}

/// One lane of a worker's deliveries: its pace and where it stands.
#[derive(Debug)]
pub(crate) struct Lane {
    pub(super) name: Arc<str>,
    /// The labels of its gauges: its route (its name) and, for the lane of
    /// one destination of a route, the destination.
    labels: (Arc<str>, Option<Arc<str>>),
    pub(super) pace: Pace,
    /// Deliveries calling the service now.
    pub(super) running: usize,
    /// Fetched, not started yet (over the concurrency or the rate, or
    /// waiting for the probe's result).
    pub(super) waiting: VecDeque<crate::Delivery>,
    /// When the rate lets the next delivery start.
    next_start: Option<Instant>,
    pub(super) breaker: Option<Breaker>,
    /// Whether its gauges are exported: a worker that paces nothing (and
    /// names no lane) adds no series.
    pub(super) reported: bool,
    /// How long its calls take (a moving average), once one ended.
    latency: Option<Duration>,
    /// Since when calls have been running without a pause.
    busy_since: Option<Instant>,
    /// When its last call ended.
    last_end: Option<Instant>,
    /// Until when the entries given back for a full lane are spread (each
    /// due when the lane should have room for it).
    spread_until: Option<Instant>,
    /// Until when no delivery starts: the shared slots or turns (held
    /// across every worker on the queue) were all taken.
    held_until: Option<Instant>,
}

/// The longest an entry fetched for a full lane is given back for.
const MAX_OVERFLOW_WAIT: Duration = Duration::from_secs(30);
/// The least (so that the entries given back do not come back before the
/// ones behind them were fetched).
const MIN_OVERFLOW_WAIT: Duration = Duration::from_secs(1);
/// An entry fetched for a full lane waits in its line when its turn comes
/// within this (given back, it would be away a second and cost a write);
/// past it, it is given back, so that a slow lane never holds the fetch
/// budget of the others.
const KEEP_HORIZON: Duration = Duration::from_millis(100);

/// Whether a call is the breaker's probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// A delivery as usual.
    Plain,
    /// The breaker's probe (half-open): its result closes the breaker or
    /// opens it again.
    Probe,
}

impl Role {
    pub(super) fn is_probe(self) -> bool {
        self == Self::Probe
    }
}

/// A finished call, for its lane.
#[derive(Debug, Clone, Copy)]
pub(super) struct Called {
    /// How long it took.
    pub(super) took: Duration,
    /// Whether it was the breaker's probe.
    pub(super) role: Role,
    /// What its result says of the upstream: `Some(true)` up, `Some(false)`
    /// down, `None` nothing (see `settle::verdict`).
    pub(super) up: Option<bool>,
}

/// What to do with a lane's next waiting delivery.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// Call the service, as a plain delivery or as the breaker's probe.
    Go(Role),
    /// The breaker is open: postpone the entry by this long.
    Postpone(Duration),
    /// Not yet: until this instant (the rate) or until a delivery ends.
    Wait(Option<Instant>),
}

impl Lane {
    pub(super) fn new(name: Arc<str>, pace: Pace) -> Self {
        Self::labelled(name.clone(), (name, None), pace)
    }

    /// The lane of `destination` of `route`, named `ROUTE@DESTINATION`.
    pub(super) fn destination(route: Arc<str>, destination: Arc<str>, pace: Pace) -> Self {
        let name = Arc::from(format!("{route}@{destination}"));
        Self::labelled(name, (route, Some(destination)), pace)
    }

    fn labelled(name: Arc<str>, labels: (Arc<str>, Option<Arc<str>>), pace: Pace) -> Self {
        let reported = pace != Pace::default();
        let breaker = pace
            .breaker
            .map(|(failures, cooldown)| Breaker::new(failures, cooldown));
        Self {
            name,
            labels,
            pace,
            running: 0,
            waiting: VecDeque::new(),
            next_start: None,
            breaker,
            reported,
            latency: None,
            busy_since: None,
            last_end: None,
            spread_until: None,
            held_until: None,
        }
    }

    /// Whether the next waiting delivery may start now.
    pub(super) fn admit(&mut self, now: Instant) -> Admit {
        let role = match self.breaker.as_ref().map(|b| b.gate(now)) {
            None | Some(Gate::Pass) => Role::Plain,
            Some(Gate::Open(left)) => return Admit::Postpone(left),
            Some(Gate::Wait) => return Admit::Wait(None),
            Some(Gate::Probe) => Role::Probe,
        };
        if let Some(at) = self.held_until.filter(|at| now < *at) {
            return Admit::Wait(Some(at));
        }
        if self.pace.concurrency.is_some_and(|n| self.running >= n) {
            return Admit::Wait(None);
        }
        if let (Some(rate), Some(at)) = (self.pace.rate, self.next_start) {
            if now < at {
                return Admit::Wait(Some(at));
            }
            self.next_start = Some(at.max(now) + rate.interval());
        } else if let Some(rate) = self.pace.rate {
            self.next_start = Some(now + rate.interval());
        }
        Admit::Go(role)
    }

    /// Takes the waiting delivery that goes next: the first in line, or
    /// for a probe the first that has not failed before (fewest attempts),
    /// which then starts as the probe.
    pub(super) fn take(&mut self, role: Role) -> Option<crate::Delivery> {
        let Some(breaker) = self.breaker.as_mut().filter(|_| role.is_probe()) else {
            return self.waiting.pop_front();
        };
        let at = self
            .waiting
            .iter()
            .enumerate()
            .min_by_key(|(i, d)| {
                let failed = breaker.failed_before(entry_of(&d.message.key));
                (failed || d.attempt > 1, d.attempt, *i)
            })
            .map(|(i, _)| i)?;
        let delivery = self.waiting.remove(at)?;
        let entry = entry_of(&delivery.message.key);
        let fresh = !breaker.failed_before(entry) && delivery.attempt <= 1;
        breaker.start_probe(entry, fresh);
        crate::metrics::breaker(&self.labels, 2);
        Some(delivery)
    }

    /// A delivery admitted but not started (the shared slots or turns were
    /// all taken): back to the front of the line, no start before `until`;
    /// a probe gives its place back.
    pub(super) fn put_back(&mut self, delivery: crate::Delivery, role: Role, until: Instant) {
        self.running = self.running.saturating_sub(1);
        if let (Some(breaker), Role::Probe) = (self.breaker.as_mut(), role) {
            let entry = entry_of(&delivery.message.key);
            breaker.record(entry, true, None, until, &self.name);
        }
        self.waiting.push_front(delivery);
        self.held_until = Some(until);
        self.gauges();
    }

    /// Whether the lane holds as many deliveries as it may (its
    /// concurrency running, and a quarter more waiting, at least 4): more
    /// fetched now would only wait, holding the fetch budget the other
    /// lanes need.
    pub(super) fn full(&self) -> bool {
        self.room() == Some(0)
    }

    /// How many more deliveries the lane may hold before it is
    /// [full](Self::full); `None` without a concurrency (no bound).
    pub(super) fn room(&self) -> Option<usize> {
        self.limit().map(|limit| limit.saturating_sub(self.held()))
    }

    /// How many deliveries the lane may hold: its concurrency, and a
    /// quarter more (at least 4) waiting.
    fn limit(&self) -> Option<usize> {
        let n = self.pace.concurrency?;
        Some(n.saturating_add(n.div_ceil(4).max(4)))
    }

    fn held(&self) -> usize {
        self.running + self.waiting.len()
    }

    /// Whether an entry joining the full lane's line now starts within
    /// [`KEEP_HORIZON`], so that it waits there rather than be given back:
    /// the breaker closed, the rate's turn and the shared slots' near, and
    /// the line ahead of it
    /// moving one call's latency over the concurrency apart (the latency at
    /// least as long as calls have run without one ending: a lane whose
    /// calls hang looks slow at once).
    pub(super) fn quick(&self, now: Instant) -> bool {
        let closed = self
            .breaker
            .as_ref()
            .is_none_or(|b| matches!(b.gate(now), Gate::Pass));
        let held = self.held_until.is_some_and(|at| at > now + KEEP_HORIZON);
        closed
            && !held
            && self.rate_wait(now) <= KEEP_HORIZON
            && self.stalled(now).max(self.latency.unwrap_or_default()) <= self.keep_latency()
    }

    /// The longest a call may take for the lane to be [quick](Self::quick)
    /// with its line as it is.
    fn keep_latency(&self) -> Duration {
        let n = u32::try_from(self.pace.concurrency.unwrap_or(1).max(1)).unwrap_or(u32::MAX);
        let ahead = u32::try_from(self.waiting.len() + 1).unwrap_or(u32::MAX);
        KEEP_HORIZON.saturating_mul(n) / ahead
    }

    /// How long calls have been running without one ending.
    fn stalled(&self, now: Instant) -> Duration {
        let Some(busy) = self.busy_since else {
            return Duration::ZERO;
        };
        let since = self.last_end.map_or(busy, |end| end.max(busy));
        now.saturating_duration_since(since)
    }

    /// What the lane holds past its [limit](Self::limit) (kept while it was
    /// [quick](Self::quick)), taken from the back of its line once it is
    /// not, to be given back; else when to look again (when it stops being
    /// quick if no call ends before).
    pub(super) fn excess(&mut self, now: Instant) -> (Vec<crate::Delivery>, Option<Instant>) {
        let Some(over) = self.limit().and_then(|l| self.held().checked_sub(l)) else {
            return (Vec::new(), None);
        };
        if over == 0 {
            return (Vec::new(), None);
        }
        if self.quick(now) {
            // With no call running, nothing changes until one starts.
            let slow_at = self
                .busy_since
                .map(|_| now + self.keep_latency().saturating_sub(self.stalled(now)));
            return (Vec::new(), slow_at);
        }
        let keep = self.waiting.len().saturating_sub(over);
        (self.waiting.split_off(keep).into(), None)
    }

    /// How long an entry fetched for this full lane is given back for:
    /// until the lane should have room for it (one call's latency over the
    /// concurrency after the last one given back), from 1 to 30 seconds.
    /// Until a call ended, the latency is at least how long the lane has
    /// been busy.
    pub(super) fn overflow_wait(&mut self, now: Instant) -> Duration {
        let n = self.pace.concurrency.unwrap_or(1).max(1) as u32;
        let busy = self
            .busy_since
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        let latency = self.latency.unwrap_or(busy).max(Duration::from_millis(10));
        let from = self.spread_until.map_or(now, |t| t.max(now));
        let at = (from + latency / n)
            .max(now + MIN_OVERFLOW_WAIT)
            .min(now + MAX_OVERFLOW_WAIT);
        self.spread_until = Some(at);
        at - now
    }

    /// How long a delivery joining the waiting line now would wait for its
    /// turn at the rate (the line ahead of it, each one interval apart).
    pub(super) fn rate_wait(&self, now: Instant) -> Duration {
        let Some(rate) = self.pace.rate else {
            return Duration::ZERO;
        };
        let first = self.next_start.map_or(now, |at| at.max(now));
        (first - now) + rate.interval() * self.waiting.len() as u32
    }

    /// Records a finished call of `key`. `shared`: what the breaker shared
    /// on the queue answered (it judged; this lane's breaker follows),
    /// `None` when this one judges alone.
    pub(super) fn finished(
        &mut self,
        key: &str,
        call: Called,
        shared: Option<crate::BreakerState>,
        now: Instant,
    ) {
        let Called { took, role, up } = call;
        let probe = role.is_probe();
        self.running = self.running.saturating_sub(1);
        if self.running == 0 {
            self.busy_since = None;
        }
        self.last_end = Some(now);
        self.latency = Some(match self.latency {
            None => took,
            Some(avg) => (avg * 7 + took) / 8,
        });
        if let Some(breaker) = self.breaker.as_mut() {
            let entry = entry_of(key);
            match shared {
                Some(state) => breaker.record_shared(entry, probe, up, now, state, &self.name),
                None => breaker.record(entry, probe, up, now, &self.name),
            }
        }
        self.gauges();
    }

    /// One more call running.
    pub(super) fn started(&mut self) {
        self.running += 1;
        self.busy_since.get_or_insert_with(Instant::now);
        if self.reported {
            crate::metrics::deliveries_in_flight(&self.labels, self.running);
        }
    }

    pub(super) fn gauges(&self) {
        if !self.reported {
            return;
        }
        crate::metrics::deliveries_in_flight(&self.labels, self.running);
        if let Some(b) = &self.breaker {
            crate::metrics::breaker(&self.labels, b.gauge());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_per_second_minute_and_hour() {
        assert_eq!("200/s".parse::<Rate>(), Ok(Rate::per_second(200)));
        assert_eq!(" 30 / m ".parse::<Rate>(), Ok(Rate::per_minute(30)));
        assert_eq!(
            "100/h".parse::<Rate>().unwrap().interval(),
            Duration::from_secs(36)
        );
        assert_eq!(Rate::per_second(200).interval(), Duration::from_millis(5));
        for bad in ["", "200", "0/s", "-1/s", "10/d", "x/s", "10/"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad:?} parsed");
        }
        assert_eq!(Rate::per_minute(30).to_string(), "30/m");
    }

    #[test]
    fn full_jitter_stays_within_zero_and_the_delay() {
        let d = Duration::from_secs(15);
        assert_eq!(jitter(d, 0), Duration::ZERO);
        assert_eq!(jitter(d, u64::MAX), d);
        assert_eq!(jitter(d, u64::MAX / 2 + 1), d / 2);
        let pace = Pace::new().retry_schedule([1, 2, 4].map(Duration::from_secs));
        let mut below_half = 0;
        for attempt in 1..=200u32 {
            let wait = pace.scheduled_wait(attempt).unwrap();
            // Past the list's end, the last delay repeats.
            let cap = Duration::from_secs([1, 2, 4][(attempt as usize - 1).min(2)]);
            assert!(wait <= cap, "attempt {attempt}: {wait:?} over {cap:?}");
            below_half += usize::from(wait < cap / 2);
        }
        // Spread over the range, not pinned to either end.
        assert!(
            (40..160).contains(&below_half),
            "{below_half} of 200 below half"
        );
        assert_eq!(Pace::new().scheduled_wait(1), None);
        assert_eq!(Pace::new().retry_schedule([]).get_retry_schedule(), None);
    }

    fn delivery() -> crate::Delivery {
        use crate::{Delivery, EntryId, Message};
        Delivery {
            id: EntryId::new("1"),
            message: Message::new("k", tower_idempotency::Fingerprint::of(b"x"), "body"),
            attempt: 1,
            enqueued_at: std::time::SystemTime::now(),
            lease: 0,
            history: None,
        }
    }

    #[test]
    fn concurrency_holds_deliveries_until_one_ends() {
        let mut lane = Lane::new("t".into(), Pace::new().concurrency(2));
        let now = Instant::now();
        lane.waiting.push_back(delivery());
        assert_eq!(lane.admit(now), Admit::Go(Role::Plain));
        lane.started();
        assert_eq!(lane.admit(now), Admit::Go(Role::Plain));
        lane.started();
        assert_eq!(lane.admit(now), Admit::Wait(None));
        let call = Called {
            took: Duration::ZERO,
            role: Role::Plain,
            up: Some(true),
        };
        lane.finished("k", call, None, now);
        assert_eq!(lane.admit(now), Admit::Go(Role::Plain));
    }

    #[test]
    fn the_rate_spaces_the_starts() {
        let mut lane = Lane::new("t".into(), Pace::new().rate(Rate::per_second(10)));
        let now = Instant::now();
        assert_eq!(lane.admit(now), Admit::Go(Role::Plain));
        let next = now + Duration::from_millis(100);
        assert_eq!(lane.admit(now), Admit::Wait(Some(next)));
        assert_eq!(lane.admit(next), Admit::Go(Role::Plain));
        lane.waiting.push_back(delivery());
        lane.waiting.push_back(delivery());
        assert_eq!(lane.rate_wait(next), Duration::from_millis(300));
        // Idle for a while: no burst is saved up.
        let later = next + Duration::from_secs(10);
        assert_eq!(lane.admit(later), Admit::Go(Role::Plain));
        let after = later + Duration::from_millis(100);
        assert_eq!(lane.admit(later), Admit::Wait(Some(after)));
    }
}
