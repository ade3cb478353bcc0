//! [`Worker`]: delivers queue entries to a tower service.
//!
//! Everything a worker does beside the queue lives here: its builder and
//! delivery loop, its pacing per lane ([`Pace`], [`Rate`]), its circuit
//! breaker, the pacing it shares with other instances through a
//! [`SharedPacing`] queue, how it settles a delivery ([`WorkerRound`]), and
//! how it parks a paused route's entries ([`Park`](crate::Park)).

pub(crate) mod breaker;
mod lanes;
pub(crate) mod pace;
pub(crate) mod park;
pub(crate) mod settle;
pub(crate) mod shared;

use self::breaker::{entry_of, BreakerState};
use self::pace::{Called, Lane, Pace, Rate, Role};
use self::settle::{settle, unsettled, verdict, Attempted, Settled, WorkerRound};
use self::shared::{
    bounded, judged, probe_wait, shared_gate, shared_turn, Judging, Ops, ProbeResult, SharedGate,
};
use crate::{Delivery, Message, Queue, QueueError, SharedPacing};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_service::Service;

#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) name: Arc<str>,
    pub(super) batch: usize,
    pub(super) lease: Duration,
    pub(super) poll: Duration,
    pub(super) max_attempts: u32,
    pub(super) backoff: Duration,
    pub(super) max_backoff: Duration,
    /// Parks a paused route's deliveries (see [`Worker::park_paused`]).
    pub(super) parker: Option<self::park::Parker>,
}

impl Config {
    fn backoff_after(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(30);
        self.backoff
            .saturating_mul(1u32 << shift)
            .min(self.max_backoff)
    }
}

/// Which lane a message goes to (by name).
pub(super) type LaneOf = Arc<dyn Fn(&Message) -> Option<Arc<str>> + Send + Sync>;

/// What to do with a delivery taken from its lane.
#[derive(Debug, Clone, Copy)]
pub(super) enum Act {
    /// Call the service, as a plain delivery or as the breaker's probe.
    Call(Role),
    /// Postpone the entry, its attempt not counted.
    Postpone(Duration, &'static str),
    /// Dead-letter it: handed out too often without settling.
    Unsettled,
}

/// How a delivery ended.
struct Done {
    lane: usize,
    key: String,
    /// For a call: how long it took, whether it was the probe, and what it
    /// says of the upstream.
    call: Option<Called>,
    /// What the lane's breaker shared on the queue answered after the call
    /// (`None`: nothing shared, or it could not answer).
    shared: Option<BreakerState>,
    settled: Result<Settled, QueueError>,
}

/// Delivers the entries of a [`Queue`] to a service: `Ok` acknowledges the
/// entry, `Err` retries it after an exponential backoff (or the
/// [retry schedule](Self::retry_schedule)), and the last of `max_attempts`
/// failures moves it to the dead letters.
///
/// The service gets each entry's [`Message`]. Wrap the handler in a
/// [`ConsumerLayer`](tower_idempotency::consumer::ConsumerLayer) (or send the message's
/// request through the [dedup layer](tower_idempotency::dedup)) so that an entry
/// redelivered after a crash does not run it twice; an HTTP client should
/// turn a non-2xx answer into an `Err`.
///
/// Deliveries can be paced so that a backlog does not knock the upstream
/// over: [`concurrency`](Self::concurrency), [`rate`](Self::rate) and a
/// [circuit breaker](Self::breaker), for all of them or per
/// [lane](Self::lanes) (for example one per upstream): by this worker
/// alone, or, built with [`shared_pacing`](Self::shared_pacing) over a
/// queue that implements [`SharedPacing`], together with every worker on
/// the queue. The gauges
/// `idempotency_deliveries_in_flight{route}` and
/// `idempotency_upstream_breaker{route}` (0 closed, 1 open, 2 half-open: the
/// probe under way) are labelled with the lane's name (the worker's
/// [`name`](Self::name) for the default lane), for the lanes that pace
/// something (a worker that paces nothing adds no series).
pub struct Worker<Q, S> {
    pub(super) queue: Q,
    pub(super) service: S,
    pub(super) config: Arc<Config>,
    /// The default lane first, then the named ones.
    pub(super) lanes: Vec<Lane>,
    pub(super) lane_of: Option<LaneOf>,
    /// The queue's shared pacing, when the worker was built with
    /// [`shared_pacing`](Self::shared_pacing): `None` paces alone and asks
    /// the queue nothing.
    shared: Option<Ops<Q>>,
    /// Keys whose last delivery found no route.
    stranded: HashSet<String>,
    /// When the stranded entries were last warned about.
    warned: Option<Instant>,
}

impl<Q: fmt::Debug, S: fmt::Debug> fmt::Debug for Worker<Q, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.queue)
            .field("service", &self.service)
            .field("config", &self.config)
            .field("lanes", &self.lanes.len())
            .field("shared_pacing", &self.shared.is_some())
            .finish_non_exhaustive()
    }
}

impl<Q: crate::Park, S> Worker<Q, S> {
    /// Parks the entries of a paused route instead of postponing them: a
    /// delivery whose error says
    /// [`Disposition::Pause`](tower_idempotency::consumer::Disposition::Pause)
    /// is [parked](crate::Park::park) under `prefix_of(message)` (the paused
    /// prefix it is under; `None`: postponed as before), and nothing of it
    /// is fetched again until that prefix is [woken](crate::Park::wake).
    ///
    /// Only for a queue that implements [`Park`](crate::Park); a worker
    /// over one that does not (RabbitMQ, JetStream) postpones a paused
    /// route's entries (30 s at a time):
    ///
    /// ```compile_fail
    /// use tower_idempotency_queue::{Message, Queue, Worker};
    ///
    /// fn parking<Q: Queue>(queue: Q) {
    ///     let deliver = tower::service_fn(|_m: Message| async { Ok::<_, std::io::Error>(()) });
    ///     let _worker = Worker::new(queue, deliver).park_paused(|_m: &Message| None);
    /// }
    /// ```
    pub fn park_paused(
        mut self,
        prefix_of: impl Fn(&Message) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        let parker = self::park::Parker::new(self.queue.clone(), prefix_of);
        self.config().parker = Some(parker);
        self
    }
}

impl<Q: SharedPacing, S> Worker<Q, S> {
    /// Paces across instances: every lane's [concurrency](Self::concurrency)
    /// and [rate](Self::rate) hold for all the workers on this queue
    /// together (a slot and a turn are taken on the queue before each
    /// delivery, beside this worker's own), and its
    /// [breaker](Self::breaker) follows the one the queue shares, where it
    /// shares one. While the queue cannot answer, this worker's own limits
    /// and breaker hold alone (logged, and counted in
    /// `idempotency_breaker_shared_errors_total{route}`).
    ///
    /// Only for a queue that implements [`SharedPacing`]. Defaults to off:
    /// the worker paces alone, on its own concurrency, rate and breaker,
    /// and never calls the queue's shared pacing.
    ///
    /// ```
    /// use tower_idempotency_queue::{Message, SharedPacing, Worker};
    ///
    /// // A Redis Streams, RabbitMQ or JetStream queue: every instance on
    /// // it together delivers at most 8 at once, 50 a second.
    /// fn paced<Q: SharedPacing>(queue: Q) {
    ///     let deliver = tower::service_fn(|_m: Message| async { Ok::<_, std::io::Error>(()) });
    ///     let _worker = Worker::new(queue, deliver)
    ///         .concurrency(8)
    ///         .rate("50/s".parse().unwrap())
    ///         .shared_pacing();
    /// }
    /// ```
    ///
    /// It is not there for a queue that paces alone (the embedded one):
    ///
    /// ```compile_fail
    /// use tower_idempotency_queue::{MemoryQueue, Message, Worker};
    ///
    /// let deliver = tower::service_fn(|_m: Message| async { Ok::<_, std::io::Error>(()) });
    /// let worker = Worker::new(MemoryQueue::new(), deliver).shared_pacing();
    /// ```
    pub fn shared_pacing(mut self) -> Self {
        self.shared = Some(Ops::of());
        self
    }
}

impl<Q: Queue, S> Worker<Q, S> {
    /// A worker with the defaults below.
    pub fn new(queue: Q, service: S) -> Self {
        let name: Arc<str> = Arc::from("default");
        Self {
            queue,
            service,
            config: Arc::new(Config {
                name: name.clone(),
                batch: 32,
                lease: Duration::from_secs(30),
                poll: Duration::from_millis(200),
                max_attempts: 25,
                backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(15 * 60),
                parker: None,
            }),
            lanes: vec![Lane::new(name, Pace::new())],
            lane_of: None,
            shared: None,
            stranded: HashSet::new(),
            warned: None,
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The queue's name in metrics (`queue` label, and `route` for the
    /// default lane). Defaults to `"default"`.
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        let name = name.into();
        self.config().name = name.clone();
        self.lanes[0].name = name;
        self
    }

    /// How many entries are fetched and held at once (delivered, or waiting
    /// for their lane's turn). Defaults to 32.
    pub fn batch(mut self, batch: usize) -> Self {
        self.config().batch = batch.max(1);
        self
    }

    /// How long a fetched entry is leased: if the worker dies, the entry is
    /// delivered again after it. The lease is renewed every third of it
    /// while the entry's delivery runs or waits for its lane's turn, so a
    /// delivery may run longer than the lease. Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config().lease = lease;
        self
    }

    /// How long [`run`](Self::run) sleeps when nothing is due. Defaults to
    /// 200 milliseconds.
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.config().poll = poll;
        self
    }

    /// How many failed attempts move an entry to the dead letters. Defaults
    /// to 25 (with the default backoff, about 4 hours of failures).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config().max_attempts = attempts.max(1);
        self
    }

    /// The backoff after the first failure, doubled after each next one up
    /// to `max`. Defaults to 1 second, up to 15 minutes.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        let config = self.config();
        config.backoff = first;
        config.max_backoff = max.max(first);
        self
    }

    fn pace_with(mut self, f: impl FnOnce(Pace) -> Pace) -> Self {
        let lane = &mut self.lanes[0];
        *lane = Lane::new(lane.name.clone(), f(lane.pace.clone()));
        self
    }

    /// At most `n` deliveries of the default lane in flight at once.
    /// Defaults to the batch size. See [`Pace::concurrency`].
    pub fn concurrency(self, n: usize) -> Self {
        self.pace_with(|p| p.concurrency(n))
    }

    /// At most `rate` deliveries of the default lane started. Defaults to
    /// no limit. See [`Pace::rate`].
    pub fn rate(self, rate: Rate) -> Self {
        self.pace_with(|p| p.rate(rate))
    }

    /// The waits after failures instead of the exponential backoff, with
    /// full jitter (uniform in `[0, delay]`; past the end the last delay
    /// repeats). See [`Pace::retry_schedule`].
    pub fn retry_schedule(self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.pace_with(|p| p.retry_schedule(delays))
    }

    /// A circuit breaker on the default lane: opened when at least
    /// `failures` of the notifications delivered lately failed and they are
    /// at least half; no delivery for `cooldown`, then a few probes. See
    /// [`Pace::breaker`].
    pub fn breaker(self, failures: u32, cooldown: Duration) -> Self {
        self.pace_with(|p| p.breaker(failures, cooldown))
    }

    /// The default lane's whole pace at once.
    pub fn pace(self, pace: Pace) -> Self {
        self.pace_with(|_| pace)
    }

    /// Paces the messages `lane_of` names `name` on their own (its own
    /// concurrency, rate, retry schedule and breaker). Messages it names
    /// no lane for go to the default lane.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tower_idempotency_queue::{MemoryQueue, Message, Pace, Worker};
    ///
    /// let deliver = tower::service_fn(|_m: Message| async { Ok::<_, std::io::Error>(()) });
    /// let worker = Worker::new(MemoryQueue::new(), deliver)
    ///     .lane("/notify/wx", Pace::new().concurrency(20).breaker(10, Duration::from_secs(30)))
    ///     .lanes(|m: &Message| m.uri.path().starts_with("/notify/wx").then(|| Arc::from("/notify/wx")));
    /// # drop(worker);
    /// ```
    pub fn lane(mut self, name: impl Into<Arc<str>>, pace: Pace) -> Self {
        let name = name.into();
        match self.lanes.iter_mut().skip(1).find(|l| l.name == name) {
            Some(lane) => *lane = Lane::new(name, pace),
            None => self.lanes.push(Lane::new(name, pace)),
        }
        for lane in &mut self.lanes[1..] {
            lane.reported = true;
        }
        self
    }

    /// Paces the messages of `destination` of `route` on their own, as
    /// [`lane`](Self::lane) does: the lane named `ROUTE@DESTINATION` (what
    /// [`lanes`](Self::lanes) names for them), whose gauges carry the
    /// labels `route` and `destination`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_idempotency_queue::{MemoryQueue, Message, Pace, Worker};
    ///
    /// let deliver = tower::service_fn(|_m: Message| async { Ok::<_, std::io::Error>(()) });
    /// let worker = Worker::new(MemoryQueue::new(), deliver)
    ///     .destination_lane("/stripe", "ledger", Pace::new().concurrency(4))
    ///     .lanes(|m: &Message| Some(Arc::from(format!("/stripe@{}", m.destination.as_deref()?))));
    /// # drop(worker);
    /// ```
    pub fn destination_lane(
        mut self,
        route: impl Into<Arc<str>>,
        destination: impl Into<Arc<str>>,
        pace: Pace,
    ) -> Self {
        let lane = Lane::destination(route.into(), destination.into(), pace);
        match self.lanes.iter_mut().skip(1).find(|l| l.name == lane.name) {
            Some(old) => *old = lane,
            None => self.lanes.push(lane),
        }
        for lane in &mut self.lanes[1..] {
            lane.reported = true;
        }
        self
    }

    /// Names the lane of each message (see [`lane`](Self::lane)).
    pub fn lanes(
        mut self,
        lane_of: impl Fn(&Message) -> Option<Arc<str>> + Send + Sync + 'static,
    ) -> Self {
        self.lane_of = Some(Arc::new(lane_of));
        self
    }

    /// The queue.
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// The service.
    pub fn get_ref(&self) -> &S {
        &self.service
    }
}

impl<Q, S> Worker<Q, S>
where
    Q: Queue,
    S: Service<Message>,
    S::Error: tower_idempotency::consumer::Failure,
{
    /// Fetches the entries that are due (up to the batch size), delivers
    /// them concurrently, as their lanes' pace allows, and records each
    /// result as soon as its delivery ends (acknowledged, retried,
    /// dead-lettered, kept or paused). A queue error is returned once every
    /// entry of the round was settled or failed to be; an entry left
    /// unsettled is delivered again after its lease.
    ///
    /// One round waits for its slowest delivery; [`run`](Self::run) does
    /// not: each delivery settles on its own.
    pub async fn run_once(&mut self) -> Result<WorkerRound, QueueError> {
        self.gauges();
        let batch = self
            .queue
            .fetch(self.config.batch, self.config.lease)
            .await?;
        let mut round = WorkerRound {
            fetched: batch.len(),
            ..WorkerRound::default()
        };
        // Settled concurrently: the embedded queue carries the
        // acknowledgements that arrive together in one commit.
        let mut running = FuturesUnordered::new();
        for delivery in batch {
            if let Some((lane, delivery, act)) = self.enqueue(delivery, false) {
                running.extend(self.launch(lane, delivery, act).await);
            }
        }
        let mut failed = None;
        let mut renew_at = Instant::now() + renew_every(self.config.lease);
        loop {
            let (ready, wake) = self.admit(false);
            for (lane, delivery, act) in ready {
                running.extend(self.launch(lane, delivery, act).await);
            }
            if running.is_empty() && (self.waiting() == 0 || wake.is_none()) {
                break;
            }
            let waiting = self.waiting() > 0;
            tokio::select! {
                Some(done) = running.next() => match self.finish(done) {
                    Ok(settled) => round.record(settled),
                    Err(e) => failed = Some(e),
                },
                () = sleep_until(wake), if wake.is_some() => {}
                () = tokio::time::sleep_until(renew_at.into()), if waiting => {
                    self.renew_waiting().await;
                    renew_at = Instant::now() + renew_every(self.config.lease);
                }
            }
        }
        self.report_stranded();
        #[cfg(feature = "metrics")]
        if let Ok(stats) = self.queue.stats().await {
            crate::metrics::stats(&self.config.name, &stats);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(round),
        }
    }

    /// Starts `act` for `delivery`; the returned future settles it. `None`
    /// when the lane's shared slots or turns (held across every worker on
    /// the queue) are all taken: the delivery went back to its line.
    async fn launch(
        &mut self,
        lane: usize,
        delivery: Delivery,
        act: Act,
    ) -> Option<impl Future<Output = Done> + use<Q, S>> {
        let mut slot = None;
        let mut probe_id = None;
        let rule = self.lanes[lane].breaker.as_ref().map(|b| b.rule());
        let entry = entry_of(&delivery.message.key);
        let call = match act {
            Act::Call(mut role) => {
                let fresh = role.is_probe() && {
                    let b = self.lanes[lane].breaker.as_ref();
                    b.is_some_and(|b| !b.failed_before(entry)) && delivery.attempt <= 1
                };
                if let (Some(rule), Some(ops)) = (rule, self.shared) {
                    let name = self.lanes[lane].name.clone();
                    let lease = self.config.lease;
                    let asked =
                        shared_gate((&self.queue, ops), &self.config, &name, rule, role, lease);
                    match asked.await {
                        SharedGate::Local => {}
                        SharedGate::Go(follow, id) => {
                            if let (Some(state), Some(b)) =
                                (follow, self.lanes[lane].breaker.as_mut())
                            {
                                b.follow(state, Instant::now(), &name);
                                role = Role::Plain;
                            }
                            probe_id = id;
                        }
                        SharedGate::Hold(state) => {
                            let now = Instant::now();
                            let until = match state {
                                BreakerState::ProbesOut => now + probe_wait(rule.cooldown),
                                _ => now,
                            };
                            let l = &mut self.lanes[lane];
                            l.put_back(delivery, role, until);
                            if let Some(b) = l.breaker.as_mut() {
                                b.follow(state, now, &name);
                            }
                            l.gauges();
                            return None;
                        }
                    }
                }
                let turn = match self.shared {
                    Some(ops) => {
                        let l = &self.lanes[lane];
                        let pace = (l.pace.get_concurrency(), l.pace.get_rate());
                        let (queue, config) = (self.queue.clone(), self.config.clone());
                        shared_turn((queue, ops), config, l.name.clone(), pace).await
                    }
                    // Alone: the lane's own limits, already met.
                    None => Ok(None),
                };
                match turn {
                    Ok(taken) => slot = taken,
                    Err(wait) => {
                        if let (Some(rule), Some(id), Some(ops)) = (rule, probe_id, self.shared) {
                            let name = &self.lanes[lane].name;
                            let given = ProbeResult {
                                probe: id,
                                up: None,
                                fresh,
                            };
                            let given = (ops.settle_probe)(&self.queue, name, given, rule);
                            let given =
                                bounded(&self.config, "settling a shared probe", given).await;
                            if let Err(_e) = given {
                                crate::log_warn!(queue = %self.config.name, route = %name, error = %_e, "cannot give back a shared breaker probe (its place is freed when its lease runs out)");
                            }
                        }
                        self.lanes[lane].put_back(delivery, role, Instant::now() + wait);
                        return None;
                    }
                }
                let ready = std::future::poll_fn(|cx| self.service.poll_ready(cx)).await;
                let span = crate::span::deliver(&delivery.message, delivery.attempt);
                let call = ready.map(|()| {
                    let _entered = span.enter();
                    self.service.call(delivery.message.clone())
                });
                Some(Started {
                    role,
                    fresh,
                    call: call.map(|fut| crate::span::instrument(fut, span)),
                })
            }
            _ => None,
        };
        let name = self.lanes[lane].name.clone();
        let slot = slot.map(|id| Taken::new(&name, id));
        let probe_id = probe_id.map(|id| Taken::new(&name, id));
        let (queue, config, shared) = (self.queue.clone(), self.config.clone(), self.shared);
        let attempted = Attempted {
            last: delivery.attempt >= config.max_attempts,
            backoff: (self.lanes[lane].pace.scheduled_wait(delivery.attempt))
                .unwrap_or_else(|| config.backoff_after(delivery.attempt)),
        };
        Some(async move {
            let key = delivery.message.key.clone();
            let mut answered = None;
            let (call, settled) = match (act, call) {
                (_, Some(Started { role, fresh, call })) => {
                    let started = Instant::now();
                    let result = match call {
                        Ok(fut) => {
                            let held = Held {
                                slot: slot.as_ref(),
                                probe: probe_id.as_ref(),
                            };
                            renewing((&queue, shared), &config, (&delivery, held), fut)
                                .await
                                .map(drop)
                        }
                        Err(e) => Err(e),
                    };
                    let (took, up) = (started.elapsed(), verdict(&result));
                    if let (Some(rule), Some(ops)) = (rule, shared) {
                        let judging = Judging {
                            entry,
                            probe: probe_id.as_ref().map(|p| p.id),
                            fresh,
                        };
                        answered = judged((&queue, ops), &config, &name, judging, up, rule).await;
                    }
                    if let (Some(slot), Some(ops)) = (&slot, shared)
                        && let Err(_e) = bounded(
                            &config,
                            "giving back a shared slot",
                            (ops.give_slot)(&queue, &slot.lane, slot.id),
                        )
                        .await
                    {
                        crate::log_warn!(queue = %config.name, route = %slot.lane, error = %_e, "cannot give back a shared delivery slot (it is freed when its lease runs out)");
                    }
                    let parker = config.parker.as_ref();
                    let settled =
                        settle(&queue, (&config.name, parker), attempted, &delivery, result).await;
                    (Some(Called { took, role, up }), settled)
                }
                (Act::Postpone(after, why), None) => {
                    let kept = queue.postpone(&delivery, after, why).await;
                    (None, kept.map(|held| Settled::Paused(held.into())))
                }
                (_, None) => (None, unsettled(&queue, &config.name, &delivery).await),
            };
            Done {
                lane,
                key,
                call,
                shared: answered,
                settled,
            }
        })
    }

    /// Records a delivery that ended in its lane and the stranded set.
    fn finish(&mut self, done: Done) -> Result<Settled, QueueError> {
        if let Some(call) = done.call {
            let lane = &mut self.lanes[done.lane];
            lane.finished(&done.key, call, done.shared, Instant::now());
        }
        if let Ok(settled) = &done.settled {
            self.note(&done.key, settled);
        }
        done.settled
    }

    /// Keeps the set of stranded keys (kept for want of a route) current.
    fn note(&mut self, key: &str, settled: &Settled) {
        let changed = match settled {
            Settled::Kept(_) => self.stranded.insert(key.to_owned()),
            Settled::Paused(_) => false,
            _ => self.stranded.remove(key),
        };
        if changed {
            crate::metrics::stranded(&self.config.name, self.stranded.len());
        }
    }

    /// Warns about the stranded entries, at most once a minute.
    fn report_stranded(&mut self) {
        if self.stranded.is_empty() {
            return;
        }
        let due = self
            .warned
            .is_none_or(|at| at.elapsed() >= STRANDED_WARNING_EVERY);
        if due {
            self.warned = Some(Instant::now());
            crate::log_warn!(
                queue = %self.config.name,
                stranded = self.stranded.len(),
                "queued notifications stranded: no route delivers their path now; kept, not dead-lettered (route their path again to deliver them)"
            );
        }
    }

    /// Delivers until `shutdown` resolves: up to the batch size of entries
    /// are held at once, each delivery starts as soon as its lane's pace
    /// allows and settles as soon as it ends (a slow one never holds the
    /// others), an entry fetched for a lane that holds all it may (its
    /// concurrency running and a quarter more waiting) waits in its line
    /// when its turn comes within 100 ms (the lane's calls end quickly) and
    /// is given back until that lane should have room otherwise (so a slow
    /// lane never holds the fetch budget of the others; a lane whose calls
    /// stop ending gives back what it holds past its room), and the batch is refilled from the queue
    /// (one fetch under way at a time, beside the deliveries, which settle
    /// meanwhile) once as much of it is free as is held, or 10 ms after a
    /// slot fell free, and after the poll interval when nothing was due or
    /// the queue failed (which is logged). At shutdown no new entry is fetched or started (those
    /// waiting for their turn are given back to the queue, due at once) and
    /// the deliveries under way finish.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        self.gauges();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut running = FuturesUnordered::new();
        // The fetch under way (at most one) and how many entries it asked
        // for: it runs beside the deliveries, which settle meanwhile.
        let mut fetches = FuturesUnordered::new();
        let mut asked = 0;
        let mut next_fetch = Instant::now();
        // Since when part of the batch has been free without a refill.
        let mut short_since = None::<Instant>;
        let mut renew_at = Instant::now() + renew_every(self.config.lease);
        let mut stopping = false;
        loop {
            let (ready, wake) = match stopping {
                false => self.admit(true),
                true => (self.release(), None),
            };
            for (lane, delivery, act) in ready {
                // Not inside `push` (it borrows the set across the
                // service's readiness).
                let started = self.launch(lane, delivery, act).await;
                running.extend(started);
            }
            // Entries being postponed take no room: they are given back.
            // Never more than the lanes can hold together: an entry fetched
            // for a full lane is written back to the queue (a commit each)
            // and comes back no sooner than a second later.
            let held = self.calls() + self.waiting() + asked;
            let free = self
                .config
                .batch
                .saturating_sub(held)
                .min(self.room().map_or(usize::MAX, |r| r.saturating_sub(asked)));
            // Each fetch is a commit (or a round trip): the batch is
            // refilled once as much of it is free as is held, or once a
            // slot has been free for REFILL_WAIT (deliveries that hang
            // must not keep the rest of the batch empty).
            let fetch_at = match (free, fetches.is_empty()) {
                (0, _) | (_, false) => None,
                _ if free >= held => Some(next_fetch),
                _ => {
                    let since = *short_since.get_or_insert_with(Instant::now);
                    Some(next_fetch.max(since + REFILL_WAIT))
                }
            };
            if free == 0 {
                short_since = None;
            }
            let fetch_at = fetch_at.filter(|_| !stopping);
            if fetch_at.is_some_and(|at| Instant::now() >= at) {
                let (queue, lease) = (self.queue.clone(), self.config.lease);
                let fetch: FetchFuture = Box::pin(async move { queue.fetch(free, lease).await });
                fetches.push(fetch);
                asked = free;
                short_since = None;
                continue;
            }
            if stopping && running.is_empty() && fetches.is_empty() {
                return;
            }
            let busy = !running.is_empty();
            let waiting = self.waiting() > 0;
            tokio::select! {
                () = &mut shutdown, if !stopping => stopping = true,
                Some(done) = running.next(), if busy => {
                    match self.finish(done) {
                        Err(_e) if !_e.is_unwritable() => {
                            crate::log_warn!(queue = %self.config.name, error = %_e, "queue failed while settling a delivery; it is delivered again after its lease");
                        }
                        _ => {}
                    }
                    self.report_stranded();
                }
                Some(fetched) = fetches.next(), if asked > 0 => {
                    asked = 0;
                    match fetched {
                        Ok(batch) if batch.is_empty() => next_fetch = Instant::now() + self.config.poll,
                        Ok(batch) => {
                            // At shutdown they wait in their lines, and are
                            // given back with the others.
                            for delivery in batch {
                                if let Some((lane, delivery, act)) = self.enqueue(delivery, true) {
                                    let started = self.launch(lane, delivery, act).await;
                                    running.extend(started);
                                }
                            }
                        }
                        // The queue says so itself, once a minute.
                        Err(e) if e.is_unwritable() => next_fetch = Instant::now() + self.config.poll,
                        Err(_e) => {
                            crate::log_warn!(queue = %self.config.name, error = %_e, "queue failed");
                            next_fetch = Instant::now() + self.config.poll;
                        }
                    }
                    #[cfg(feature = "metrics")]
                    if let Ok(stats) = self.queue.stats().await {
                        crate::metrics::stats(&self.config.name, &stats);
                    }
                }
                () = sleep_until(fetch_at), if fetch_at.is_some() => {}
                () = sleep_until(wake), if wake.is_some() => {}
                () = tokio::time::sleep_until(renew_at.into()), if waiting => {
                    self.renew_waiting().await;
                    renew_at = Instant::now() + renew_every(self.config.lease);
                }
            }
        }
    }
}

/// A fetch under way in [`Worker::run`].
type FetchFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Vec<Delivery>, QueueError>> + Send>>;

/// How long part of a worker's batch may stay free before it is refilled,
/// when less of it is free than is held.
const REFILL_WAIT: Duration = Duration::from_millis(10);

/// Runs a delivery's call, renewing the entry's lease every third of it
/// meanwhile (a delivery may run longer than the lease; it must not be
/// handed out again while it runs), and the shared slot and probe it
/// holds. The entry is renewed first, and each call is bounded: a pacing
/// backend that is slow or stalled can neither keep the entry's lease
/// from being renewed in time nor hold up the call, which is polled while
/// the renewals run.
async fn renewing<Q: Queue, F: Future>(
    (queue, shared): (&Q, Option<Ops<Q>>),
    config: &Config,
    (delivery, Held { slot, probe }): (&Delivery, Held<'_>),
    call: F,
) -> F::Output {
    let every = renew_every(config.lease);
    // At most half a period for the shared slot and probe together: the
    // entry's next renewal comes at most 1.5 periods (half a lease) later.
    let pacing = every / 4;
    let mut call = std::pin::pin!(call);
    loop {
        let renew = async {
            tokio::time::sleep(every).await;
            match tokio::time::timeout(every, queue.renew(delivery, config.lease)).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    crate::log_warn!(queue = %config.name, entry = %delivery.id, "the lease of a running delivery was lost (it outlived its lease before it could be renewed)");
                }
                Ok(Err(_e)) => {
                    crate::log_warn!(queue = %config.name, entry = %delivery.id, error = %_e, "cannot renew the lease of a running delivery");
                }
                Err(_) => {
                    crate::log_warn!(queue = %config.name, entry = %delivery.id, "renewing the lease of a running delivery timed out");
                }
            }
            if let (Some(Taken { lane, id }), Some(ops)) = (slot, shared) {
                let renewed = (ops.renew_slot)(queue, lane, *id, config.lease);
                let renewed = tokio::time::timeout(pacing, renewed);
                match renewed.await {
                    Ok(Ok(())) => {}
                    Ok(Err(_e)) => {
                        crate::log_warn!(queue = %config.name, route = %lane, error = %_e, "cannot renew a shared delivery slot");
                    }
                    Err(_) => {
                        crate::log_warn!(queue = %config.name, route = %lane, "renewing a shared delivery slot timed out");
                    }
                }
            }
            if let (Some(Taken { lane, id }), Some(ops)) = (probe, shared) {
                let renewed = (ops.renew_probe)(queue, lane, *id, config.lease);
                let renewed = tokio::time::timeout(pacing, renewed);
                match renewed.await {
                    Ok(Ok(())) => {}
                    Ok(Err(_e)) => {
                        crate::log_warn!(queue = %config.name, route = %lane, error = %_e, "cannot renew a shared breaker probe");
                    }
                    Err(_) => {
                        crate::log_warn!(queue = %config.name, route = %lane, "renewing a shared breaker probe timed out");
                    }
                }
            }
        };
        tokio::select! {
            out = &mut call => return out,
            () = renew => {}
        }
    }
}

/// The shared slot and probe a delivery holds.
#[derive(Clone, Copy)]
struct Held<'a> {
    slot: Option<&'a Taken>,
    probe: Option<&'a Taken>,
}

/// A shared slot or probe taken on the queue: its lane and id.
struct Taken {
    lane: Arc<str>,
    id: u64,
}

impl Taken {
    fn new(lane: &Arc<str>, id: u64) -> Self {
        Self {
            lane: lane.clone(),
            id,
        }
    }
}

/// A call the service was asked for, and what the breaker makes of it.
struct Started<C> {
    role: Role,
    /// The probe's entry had not failed before (its failure reopens the
    /// breaker).
    fresh: bool,
    call: C,
}

/// How often a lease is renewed: a third of it (at least 10 ms).
pub(super) fn renew_every(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(10))
}

/// Sleeps until `at` (forever for `None`: the branch is off then).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// How often stranded entries are warned about.
const STRANDED_WARNING_EVERY: Duration = Duration::from_secs(60);
