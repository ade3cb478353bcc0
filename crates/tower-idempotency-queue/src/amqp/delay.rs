//! Retries waiting out their backoff: the delay queues, which hand an
//! entry back into the queue once due.

use super::super::{Delivery, QueueError};
use super::{ms_of, AmqpQueue, Envelope};
use lapin::options::BasicAckOptions;
use std::time::{Duration, Instant};
use tower_idempotency::store::Store;

/// The delay queues: 2^MIN_DELAY ..= 2^MAX_DELAY milliseconds.
pub(super) const MIN_DELAY: u32 = 4;
pub(super) const MAX_DELAY: u32 = 20;

/// The delay queue that holds an entry due after `after`: the next power of
/// two of milliseconds (so never due earlier than asked), within bounds.
pub(super) fn delay_bucket(after: Duration) -> u64 {
    let ms = after.as_millis().max(1) as u64;
    let exp = (64 - (ms - 1).leading_zeros()).clamp(MIN_DELAY, MAX_DELAY);
    1 << exp
}

/// How long after its due time an entry that left its delay queue is
/// counted in the depth, unless fetched again before.
pub(super) const IN_TRANSIT: Duration = Duration::from_secs(5);

impl<S: Store> AmqpQueue<S> {
    pub(super) fn delay_queue(&self, ms: u64) -> String {
        format!("{}.delay.{ms}", self.inner.name)
    }

    /// Publishes `delivery`'s message to a delay queue with `attempts`
    /// recorded, then acknowledges the delivery.
    pub(super) async fn back_off(
        &self,
        delivery: &Delivery,
        after: Duration,
        attempts: u32,
        error: &str,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        let bucket = delay_bucket(after);
        let queue = self.delay_queue(bucket);
        let env = Envelope {
            id: delivery.id.to_string(),
            attempts,
            error: Some(error),
            enqueued_ms: ms_of(held.enqueued),
            dead_at: None,
        };
        // The copy first: a crash between the two leaves the entry twice
        // (the consumer runs it once), never not at all.
        if let Err(e) = self.publish("", &queue, &delivery.message, env).await {
            self.give_back_one(held.generation, &held.acker).await;
            return Err(e);
        }
        self.inner
            .backing_off
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                delivery.id.to_string(),
                Instant::now() + Duration::from_millis(bucket),
            );
        self.settled(held.generation, held.acker.ack(BasicAckOptions::default()))
            .await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backoff_waits_in_the_next_delay_queue_up() {
        assert_eq!(delay_bucket(Duration::from_millis(1)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(16)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(17)), 32);
        assert_eq!(delay_bucket(Duration::from_secs(1)), 1024);
        assert_eq!(delay_bucket(Duration::from_secs(3600)), 1 << MAX_DELAY);
    }
}
