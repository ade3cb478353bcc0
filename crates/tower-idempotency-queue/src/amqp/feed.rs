//! Taking entries: one consumer (`basic.consume`) on the queue, whose
//! prefetch (`basic.qos`) is the most the worker asked for in one fetch, so
//! the broker pushes entries ahead of the fetches (no round trip per entry)
//! and never holds more of them on this instance than the worker's lanes
//! can take together.

use super::super::QueueError;
use super::connection::{string, Link};
use super::{err, fail, AmqpQueue};
use crate::QueueErrorKind;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tower_idempotency::store::Store;

/// How long an empty fetch waits for an entry the broker counts as ready
/// to be pushed (it usually takes a millisecond; another gateway's consumer
/// may take it instead).
const PUSH_WAIT: Duration = Duration::from_millis(250);

/// The consumer of one connection, and what it pushed that no fetch took
/// yet.
pub(super) struct Feed {
    generation: u64,
    consumer: lapin::Consumer,
    prefetch: u16,
    /// Pushed, unacknowledged, not handed out yet: since when.
    pending: VecDeque<(lapin::message::Delivery, Instant)>,
}

impl Feed {
    /// Moves what the consumer received into `pending`, without waiting.
    /// `Err` when the consumer failed (the connection broke) or was
    /// cancelled by the broker (the queue deleted).
    fn drain(&mut self) -> Result<(), QueueError> {
        loop {
            match self.consumer.next().now_or_never() {
                None => return Ok(()),
                Some(Some(Ok(d))) => self.pending.push_back((d, Instant::now())),
                Some(Some(Err(e))) => return Err(err(e)),
                Some(None) => {
                    return Err(fail(
                        QueueErrorKind::Unavailable,
                        "the broker cancelled the consumer",
                    ));
                }
            }
        }
    }
}

impl<S: Store> AmqpQueue<S> {
    /// Up to `max` deliveries the broker pushed to this instance, waiting
    /// briefly when none arrived yet and the queue holds some. Pushed
    /// deliveries no fetch took within `lease` are given back to the queue.
    pub(super) async fn take(
        &self,
        link: &Link,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<lapin::message::Delivery>, QueueError> {
        let want = u16::try_from(max.max(1)).unwrap_or(u16::MAX);
        let mut slot = self.inner.feed.lock().await;
        let result = async {
            let feed = self.feed(link, &mut slot, want).await?;
            feed.drain()?;
            // Pushed long ago and never taken (the worker fetched less than
            // its prefetch since): the queue hands them to whoever is free.
            let now = Instant::now();
            while feed
                .pending
                .front()
                .is_some_and(|(_, since)| now.duration_since(*since) > lease)
            {
                let (d, _) = feed.pending.pop_front().expect("checked");
                self.give_back_one(link.generation, &d.acker).await;
            }
            if feed.pending.is_empty() && self.credit(feed) > 0 {
                // Nothing pushed yet: is anything ready? The answer comes on
                // the consumer's channel after whatever the broker pushed
                // before it.
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                let declared = link.take.queue_declare(
                    string(self.inner.name.clone()),
                    passive,
                    FieldTable::default(),
                );
                let ready = self
                    .bounded(link.generation, "a declare", declared)
                    .await?
                    .message_count();
                feed.drain()?;
                if feed.pending.is_empty()
                    && ready > 0
                    && let Ok(got) = tokio::time::timeout(PUSH_WAIT, feed.consumer.next()).await
                {
                    match got {
                        Some(Ok(d)) => feed.pending.push_back((d, Instant::now())),
                        Some(Err(e)) => return Err(err(e)),
                        None => {
                            return Err(fail(
                                QueueErrorKind::Unavailable,
                                "the broker cancelled the consumer",
                            ));
                        }
                    }
                    feed.drain()?;
                }
            }
            let n = max.max(1).min(feed.pending.len());
            Ok(feed.pending.drain(..n).map(|(d, _)| d).collect())
        }
        .await;
        if result.is_err() {
            // The consumer goes with its connection: what it held, the
            // broker hands out again.
            *slot = None;
            self.broken(link.generation);
        }
        result
    }

    /// How many entries the broker pushed to this instance that no fetch
    /// took yet.
    pub(super) async fn pushed(&self) -> u64 {
        let mut slot = self.inner.feed.lock().await;
        match slot.as_mut() {
            Some(feed) => {
                let _ = feed.drain();
                feed.pending.len() as u64
            }
            None => 0,
        }
    }

    /// How many more the broker may push: the prefetch less what this
    /// instance holds on the consumer's connection.
    fn credit(&self, feed: &Feed) -> usize {
        let held = self
            .inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|h| h.generation == feed.generation)
            .count();
        usize::from(feed.prefetch).saturating_sub(held + feed.pending.len())
    }

    /// The consumer on `link`, started (or started again with a larger
    /// prefetch, when the worker asks for more at once than before).
    async fn feed<'a>(
        &self,
        link: &Link,
        slot: &'a mut Option<Feed>,
        want: u16,
    ) -> Result<&'a mut Feed, QueueError> {
        let current = slot
            .as_ref()
            .is_some_and(|f| f.generation == link.generation && f.prefetch >= want);
        if !current {
            let mut pending = VecDeque::new();
            if let Some(mut old) = slot.take().filter(|f| f.generation == link.generation) {
                // Cancelled first, so that nothing is pushed to it after;
                // what it received stays this instance's, unacknowledged,
                // and is handed out from the new feed.
                let cancel = link
                    .take
                    .basic_cancel(old.consumer.tag(), BasicCancelOptions::default());
                self.bounded(link.generation, "a consumer's cancel", cancel)
                    .await?;
                let _ = old.drain();
                pending = std::mem::take(&mut old.pending);
            }
            // The prefetch applies to the consumers started after it.
            let qos = link.take.basic_qos(want, BasicQosOptions { global: false });
            self.bounded(link.generation, "a prefetch", qos).await?;
            let consume = link.take.basic_consume(
                string(self.inner.name.clone()),
                string(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            );
            let consumer = self.bounded(link.generation, "a consume", consume).await?;
            *slot = Some(Feed {
                generation: link.generation,
                consumer,
                prefetch: want,
                pending,
            });
        }
        Ok(slot.as_mut().expect("set above"))
    }
}
