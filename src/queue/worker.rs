//! [`Worker`]: delivers queue entries to a tower service.

use super::{Delivery, Message, Queue, QueueError};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
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
}

/// How one delivery was settled, and whether the lease was still held.
enum Settled {
    Delivered(bool),
    Retried(bool),
    DeadLettered(bool),
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
    config: Config,
}

impl<Q: Queue, S> Worker<Q, S> {
    /// A worker with the defaults below.
    pub fn new(queue: Q, service: S) -> Self {
        Self {
            queue,
            service,
            config: Config {
                name: Arc::from("default"),
                batch: 32,
                lease: Duration::from_secs(30),
                poll: Duration::from_millis(200),
                max_attempts: 25,
                backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(15 * 60),
            },
        }
    }

    /// The queue's name in metrics (`queue` label). Defaults to `"default"`.
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.config.name = name.into();
        self
    }

    /// How many entries are fetched and delivered concurrently. Defaults to 32.
    pub fn batch(mut self, batch: usize) -> Self {
        self.config.batch = batch.max(1);
        self
    }

    /// How long a fetched entry is leased: if the worker dies, the entry is
    /// delivered again after it. Keep it longer than one delivery. Defaults
    /// to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long [`run`](Self::run) sleeps when nothing is due. Defaults to
    /// 200 milliseconds.
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.config.poll = poll;
        self
    }

    /// How many failed attempts move an entry to the dead letters. Defaults
    /// to 25 (with the default backoff, about 4 hours of failures).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts.max(1);
        self
    }

    /// The backoff after the first failure, doubled after each next one up
    /// to `max`. Defaults to 1 second, up to 15 minutes.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.backoff = first;
        self.config.max_backoff = max.max(first);
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

    fn backoff_after(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(30);
        self.config
            .backoff
            .saturating_mul(1u32 << shift)
            .min(self.config.max_backoff)
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
    /// ends (acknowledged, retried or dead-lettered). A queue error is
    /// returned once every entry of the round was settled or failed to be;
    /// an entry left unsettled is delivered again after its lease.
    pub async fn run_once(&mut self) -> Result<WorkerRound, QueueError> {
        let batch = self
            .queue
            .fetch(self.config.batch, self.config.lease)
            .await?;
        let mut round = WorkerRound {
            fetched: batch.len(),
            ..WorkerRound::default()
        };
        let mut calls = Vec::with_capacity(batch.len());
        for delivery in &batch {
            let ready = std::future::poll_fn(|cx| self.service.poll_ready(cx)).await;
            calls.push(match ready {
                Ok(()) => Ok(self.service.call(delivery.message.clone())),
                Err(e) => Err(e),
            });
        }
        // Each entry is settled as soon as its delivery ends, all of them
        // concurrently: the embedded queue carries the acknowledgements that
        // arrive together in one commit.
        let this = &*self;
        let settled = futures_util::future::join_all(batch.iter().zip(calls).map(
            |(delivery, call)| async move {
                let result = match call {
                    Ok(fut) => fut.await.map(drop),
                    Err(e) => Err(e),
                };
                this.settle(delivery, result).await
            },
        ))
        .await;
        for outcome in settled {
            round.record(outcome?);
        }
        #[cfg(feature = "metrics")]
        if let Ok(stats) = self.queue.stats().await {
            super::metrics::stats(&self.config.name, &stats);
        }
        Ok(round)
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        result: Result<(), S::Error>,
    ) -> Result<Settled, QueueError> {
        let name = &self.config.name;
        Ok(match result {
            Ok(()) => {
                super::metrics::attempt(name, "delivered");
                Settled::Delivered(self.queue.ack(delivery).await?)
            }
            Err(e) if delivery.attempt >= self.config.max_attempts => {
                super::metrics::attempt(name, "dead_lettered");
                crate::outcome::log_warn!(queue = %name, entry = %delivery.id, error = %e, "delivery failed for the last time; dead-lettered");
                Settled::DeadLettered(self.queue.dead_letter(delivery, &e.to_string()).await?)
            }
            Err(e) => {
                super::metrics::attempt(name, "retried");
                let after = self.backoff_after(delivery.attempt);
                Settled::Retried(self.queue.retry(delivery, after, &e.to_string()).await?)
            }
        })
    }

    /// Delivers until `shutdown` resolves, sleeping for the poll interval
    /// when nothing is due and after a queue error (which is logged).
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let idle = match self.run_once().await {
                Ok(round) => round.fetched == 0,
                Err(_e) => {
                    crate::outcome::log_warn!(queue = %self.config.name, error = %_e, "queue failed");
                    true
                }
            };
            if idle {
                if tokio::time::timeout(self.config.poll, &mut shutdown)
                    .await
                    .is_ok()
                {
                    return;
                }
            } else if futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
                return;
            }
        }
    }
}
