//! What the broker counts: the depth of the queue and its delay queues, the
//! dead letters, and what only this instance knows (its deliveries, its
//! retries on their way back).

use super::super::{QueueError, QueueStats};
use super::connection::string;
use super::delay::{IN_TRANSIT, MAX_DELAY, MIN_DELAY};
use super::AmqpQueue;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use std::time::{Instant, SystemTime};
use tower_idempotency::store::Store;

impl<S: Store> AmqpQueue<S> {
    pub(super) async fn stats_now(&self) -> Result<QueueStats, QueueError> {
        let link = self.link().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let ch = &link.publish;
        let count = |name: String| async move {
            ch.queue_declare(string(name), passive, FieldTable::default())
                .await
                .map(|q| u64::from(q.message_count()))
        };
        let result = async {
            // The queue's ready entries counted on the consumer's channel,
            // then what was pushed to the consumer before that answer: an
            // entry is in one or the other (or both, for a moment: counted
            // twice rather than not at all).
            let mut depth = link
                .take
                .queue_declare(
                    string(self.inner.name.clone()),
                    passive,
                    FieldTable::default(),
                )
                .await
                .map(|q| u64::from(q.message_count()))?;
            depth += self.pushed().await;
            for exp in MIN_DELAY..=MAX_DELAY {
                depth += count(self.delay_queue(1 << exp)).await?;
            }
            Ok::<_, lapin::Error>(depth)
        };
        let counted = self.bounded(link.generation, "the counts", result).await;
        if counted.is_err() {
            self.broken(link.generation);
        }
        let ready = counted?;
        let dead = self.dead_count().await?;
        // This instance's retries not fetched again yet: in a delay queue,
        // in the queue, or moving between the two, where the broker counts
        // them in neither. The broker's count is at least theirs unless
        // some are moving.
        let retried = {
            let now = Instant::now();
            let mut backing = self
                .inner
                .backing_off
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            backing.retain(|_, due| *due + IN_TRANSIT > now);
            backing.len() as u64
        };
        let held = self.inner.held.lock().unwrap_or_else(|e| e.into_inner());
        let now = SystemTime::now();
        let oldest = held
            .values()
            .map(|h| now.duration_since(h.enqueued).unwrap_or_default())
            .max();
        Ok(QueueStats {
            depth: ready.max(retried) + held.len() as u64,
            oldest,
            dead,
            ..QueueStats::default()
        })
    }
}
