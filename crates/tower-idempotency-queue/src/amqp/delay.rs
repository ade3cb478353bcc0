//! Retries waiting out their backoff: the delay queues, which hand an
//! entry back into the queue once due.

use super::super::Message;
use super::super::{Delivery, QueueError};
use super::entry::{
    header_text, header_u64, Envelope, ATTEMPTS_HEADER, ENQUEUED_HEADER, HISTORY_HEADER,
    LAST_ERROR_HEADER,
};
use super::{ms_of, AmqpQueue};
use crate::common::now_ms;
use lapin::options::BasicAckOptions;
use lapin::types::{AMQPValue, FieldTable};
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

    /// Publishes `delivery`'s message to a delay queue with `attempts` and
    /// the failed attempts' `history` recorded, then acknowledges the
    /// delivery.
    pub(super) async fn back_off(
        &self,
        delivery: &Delivery,
        after: Duration,
        attempts: u32,
        error: &str,
        history: Option<&str>,
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
            history,
        };
        // The copy first: a crash between the two leaves the entry twice
        // (the consumer runs it once), never not at all.
        let headers = due_header(after);
        let published = self.publish_with("", &queue, &delivery.message, env, headers);
        if let Err(e) = published.await {
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

/// The header of an entry waiting longer than the longest delay queue: when
/// it is due (ms since the epoch). It goes round the delay queues until then.
pub(super) const DUE_HEADER: &str = "x-due-ms";

/// [`DUE_HEADER`] for a wait longer than the longest delay queue; none
/// otherwise.
fn due_header(after: Duration) -> FieldTable {
    let mut headers = FieldTable::default();
    if after > Duration::from_millis(1 << MAX_DELAY) {
        let after = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        let due = now_ms().saturating_add(after);
        headers.insert(
            DUE_HEADER.into(),
            AMQPValue::LongLongInt(i64::try_from(due).unwrap_or(i64::MAX)),
        );
    }
    headers
}

impl<S: Store> AmqpQueue<S> {
    /// Sends an entry that left its delay queue before it was due (its wait
    /// was longer than the longest delay queue) round again, for what is
    /// left of its wait, its attempts and error unchanged; `true` if it went.
    pub(super) async fn not_due_yet(
        &self,
        got: &lapin::message::Delivery,
        message: &Message,
        generation: u64,
    ) -> Result<bool, QueueError> {
        let p = &got.properties;
        let now = now_ms();
        let Some(due) = header_u64(p, DUE_HEADER).filter(|due| *due > now) else {
            return Ok(false);
        };
        let left = Duration::from_millis(due - now);
        let error = header_text(p, LAST_ERROR_HEADER);
        let history = header_text(p, HISTORY_HEADER);
        let env = Envelope {
            id: p
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            attempts: header_u64(p, ATTEMPTS_HEADER)
                .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            error: Some(&error),
            enqueued_ms: header_u64(p, ENQUEUED_HEADER).unwrap_or(now),
            dead_at: None,
            history: Some(&history),
        };
        let mut headers = FieldTable::default();
        headers.insert(
            DUE_HEADER.into(),
            AMQPValue::LongLongInt(i64::try_from(due).unwrap_or(i64::MAX)),
        );
        let queue = self.delay_queue(delay_bucket(left));
        self.publish_with("", &queue, message, env, headers).await?;
        self.settled(generation, got.acker.ack(BasicAckOptions::default()))
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
