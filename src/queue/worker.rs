//! [`Worker`]: delivers queue entries to a tower service.

use super::{Delivery, Message, Queue, QueueError};
use crate::consumer::failure::Failure;
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_service::Service;

#[derive(Debug, Clone)]
struct Config {
    name: Arc<str>,
    batch: usize,
    lease: Duration,
    poll: Duration,
    max_attempts: u32,
    backoff: Duration,
    max_backoff: Duration,
}

impl Config {
    fn backoff_after(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(30);
        self.backoff
            .saturating_mul(1u32 << shift)
            .min(self.max_backoff)
    }
}

/// What one [`Worker::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
}

/// How one delivery was settled, and whether the lease was still held.
enum Settled {
    Delivered(bool),
    Retried(bool),
    DeadLettered(bool),
    Kept(bool),
}

impl WorkerRound {
    fn record(&mut self, settled: Settled) {
        let kept = match settled {
            Settled::Delivered(kept) => {
                self.delivered += 1;
                kept
            }
            Settled::Retried(kept) => {
                self.retried += 1;
                kept
            }
            Settled::DeadLettered(kept) => {
                self.dead_lettered += 1;
                kept
            }
            Settled::Kept(kept) => {
                self.kept += 1;
                kept
            }
        };
        self.lease_lost += usize::from(!kept);
    }
}

/// Delivers the entries of a [`Queue`] to a service: `Ok` acknowledges the
/// entry, `Err` retries it after an exponential backoff, and the last of
/// `max_attempts` failures moves it to the dead letters.
///
/// The service gets each entry's [`Message`]. Wrap the handler in a
/// [`ConsumerLayer`](crate::consumer::ConsumerLayer) (or send the message's
/// request through the [dedup layer](crate::dedup)) so that an entry
/// redelivered after a crash does not run it twice; an HTTP client should
/// turn a non-2xx answer into an `Err`.
#[derive(Debug)]
pub struct Worker<Q, S> {
    queue: Q,
    service: S,
    config: Arc<Config>,
    /// Keys whose last delivery found no route.
    stranded: HashSet<String>,
    /// When the stranded entries were last warned about.
    warned: Option<Instant>,
}

impl<Q: Queue, S> Worker<Q, S> {
    /// A worker with the defaults below.
    pub fn new(queue: Q, service: S) -> Self {
        Self {
            queue,
            service,
            config: Arc::new(Config {
                name: Arc::from("default"),
                batch: 32,
                lease: Duration::from_secs(30),
                poll: Duration::from_millis(200),
                max_attempts: 25,
                backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(15 * 60),
            }),
            stranded: HashSet::new(),
            warned: None,
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The queue's name in metrics (`queue` label). Defaults to `"default"`.
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.config().name = name.into();
        self
    }

    /// How many entries are fetched and delivered concurrently. Defaults to 32.
    pub fn batch(mut self, batch: usize) -> Self {
        self.config().batch = batch.max(1);
        self
    }

    /// How long a fetched entry is leased: if the worker dies, the entry is
    /// delivered again after it. Keep it longer than one delivery. Defaults
    /// to 30 seconds.
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
    S::Error: fmt::Display,
{
    /// Fetches the entries that are due (up to the batch size), delivers
    /// them concurrently and records each result as soon as its delivery
    /// ends (acknowledged, retried, dead-lettered or kept). A queue error
    /// is returned once every entry of the round was settled or failed to
    /// be; an entry left unsettled is delivered again after its lease.
    ///
    /// One round waits for its slowest delivery; [`run`](Self::run) does
    /// not: each delivery settles on its own.
    pub async fn run_once(&mut self) -> Result<WorkerRound, QueueError> {
        let batch = self
            .queue
            .fetch(self.config.batch, self.config.lease)
            .await?;
        let mut round = WorkerRound {
            fetched: batch.len(),
            ..WorkerRound::default()
        };
        let mut deliveries = Vec::with_capacity(batch.len());
        for delivery in batch {
            deliveries.push(self.start(delivery).await);
        }
        // Settled concurrently: the embedded queue carries the
        // acknowledgements that arrive together in one commit.
        let settled = futures_util::future::join_all(deliveries).await;
        let mut failed = None;
        for (key, outcome) in settled {
            match outcome {
                Ok(settled) => {
                    self.note(&key, &settled);
                    round.record(settled);
                }
                Err(e) => failed = Some(e),
            }
        }
        self.report_stranded();
        #[cfg(feature = "metrics")]
        if let Ok(stats) = self.queue.stats().await {
            super::metrics::stats(&self.config.name, &stats);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(round),
        }
    }

    /// Calls the service for `delivery`; the returned future settles it.
    async fn start(
        &mut self,
        delivery: Delivery,
    ) -> impl Future<Output = (String, Result<Settled, QueueError>)> + use<Q, S> {
        // Handed out more often than it may fail without ever settling: its
        // deliveries died with the process (or outlived their lease).
        let call = match delivery.attempt > self.config.max_attempts {
            true => None,
            false => {
                let ready = std::future::poll_fn(|cx| self.service.poll_ready(cx)).await;
                Some(ready.map(|()| self.service.call(delivery.message.clone())))
            }
        };
        let (queue, config) = (self.queue.clone(), self.config.clone());
        async move {
            let key = delivery.message.key.clone();
            let result = match call {
                Some(Ok(fut)) => fut.await.map(drop),
                Some(Err(e)) => Err(e),
                None => return (key, unsettled(&queue, &config, &delivery).await),
            };
            (key, settle(&queue, &config, &delivery, result).await)
        }
    }

    /// Keeps the set of stranded keys (kept for want of a route) current.
    fn note(&mut self, key: &str, settled: &Settled) {
        let changed = match settled {
            Settled::Kept(_) => self.stranded.insert(key.to_owned()),
            _ => self.stranded.remove(key),
        };
        if changed {
            super::metrics::stranded(&self.config.name, self.stranded.len());
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
            crate::outcome::log_warn!(
                queue = %self.config.name,
                stranded = self.stranded.len(),
                "queued notifications stranded: no route delivers their path now; kept, not dead-lettered (route their path again to deliver them)"
            );
        }
    }

    /// Delivers until `shutdown` resolves: up to the batch size of
    /// deliveries run at once, each settled as soon as it ends (a slow one
    /// never holds the others), and a free slot is filled from the queue at
    /// once, or after the poll interval when nothing was due or the queue
    /// failed (which is logged). At shutdown no new entry is fetched and
    /// the deliveries under way finish.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut running = FuturesUnordered::new();
        let mut next_fetch = Instant::now();
        let mut stopping = false;
        loop {
            let free = self.config.batch.saturating_sub(running.len());
            if !stopping && free > 0 && Instant::now() >= next_fetch {
                match self.queue.fetch(free, self.config.lease).await {
                    Ok(batch) if batch.is_empty() => next_fetch = Instant::now() + self.config.poll,
                    Ok(batch) => {
                        for delivery in batch {
                            // Not inside `push` (it borrows the set across
                            // the service's readiness).
                            let started = self.start(delivery).await;
                            running.push(started);
                        }
                    }
                    Err(_e) => {
                        crate::outcome::log_warn!(queue = %self.config.name, error = %_e, "queue failed");
                        next_fetch = Instant::now() + self.config.poll;
                    }
                }
                #[cfg(feature = "metrics")]
                if let Ok(stats) = self.queue.stats().await {
                    super::metrics::stats(&self.config.name, &stats);
                }
                continue;
            }
            if stopping && running.is_empty() {
                return;
            }
            let can_fetch = !stopping && free > 0;
            let busy = !running.is_empty();
            tokio::select! {
                () = &mut shutdown, if !stopping => stopping = true,
                Some((key, settled)) = running.next(), if busy => {
                    match settled {
                        Ok(settled) => self.note(&key, &settled),
                        Err(_e) => {
                            crate::outcome::log_warn!(queue = %self.config.name, error = %_e, "queue failed while settling a delivery; it is delivered again after its lease");
                        }
                    }
                    self.report_stranded();
                }
                () = tokio::time::sleep_until(next_fetch.into()), if can_fetch => {}
            }
        }
    }
}

/// How often stranded entries are warned about.
const STRANDED_WARNING_EVERY: Duration = Duration::from_secs(60);

/// How long an entry that no route delivers now waits before it is tried
/// again (its due time outlives a restart with the route configured).
const KEPT_FOR: Duration = Duration::from_secs(10);

/// Dead-letters an entry handed out past `max_attempts` times without a
/// result.
async fn unsettled<Q: Queue>(
    queue: &Q,
    config: &Config,
    delivery: &Delivery,
) -> Result<Settled, QueueError> {
    let why = format!(
        "handed out {} times without settling (each delivery died with its process or outlived its lease)",
        delivery.attempt
    );
    super::metrics::attempt(&config.name, "dead_lettered");
    crate::outcome::log_warn!(queue = %config.name, entry = %delivery.id, "{why}; dead-lettered");
    Ok(Settled::DeadLettered(
        queue.dead_letter(delivery, &why).await?,
    ))
}

async fn settle<Q: Queue, E: fmt::Display>(
    queue: &Q,
    config: &Config,
    delivery: &Delivery,
    result: Result<(), E>,
) -> Result<Settled, QueueError> {
    let name = &config.name;
    let e = match result {
        Ok(()) => {
            super::metrics::attempt(name, "delivered");
            return Ok(Settled::Delivered(queue.ack(delivery).await?));
        }
        Err(e) => e,
    };
    let last = delivery.attempt >= config.max_attempts;
    Ok(match Failure::of(&e) {
        Failure::Kept => {
            super::metrics::attempt(name, "kept");
            Settled::Kept(queue.postpone(delivery, KEPT_FOR, &e.to_string()).await?)
        }
        Failure::Permanent => {
            super::metrics::attempt(name, "dead_lettered");
            crate::outcome::log_warn!(queue = %name, entry = %delivery.id, error = %e, "delivery cannot succeed; dead-lettered at once");
            Settled::DeadLettered(queue.dead_letter(delivery, &e.to_string()).await?)
        }
        Failure::Retry if last => {
            super::metrics::attempt(name, "dead_lettered");
            crate::outcome::log_warn!(queue = %name, entry = %delivery.id, error = %e, "delivery failed for the last time; dead-lettered");
            Settled::DeadLettered(queue.dead_letter(delivery, &e.to_string()).await?)
        }
        Failure::Retry => {
            super::metrics::attempt(name, "retried");
            let after = config.backoff_after(delivery.attempt);
            Settled::Retried(queue.retry(delivery, after, &e.to_string()).await?)
        }
    })
}
