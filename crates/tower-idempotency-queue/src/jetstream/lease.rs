//! Leases: what each delivery's settlement goes to, until when it holds,
//! and the settlements (ack, nak, term, in progress) that wait for the
//! server's answer.

use super::{
    err, fail, hashed, ms_of, now_ms, Delivery, Held, JetStreamQueue, QueueError, H_BASE, H_DUE,
    H_HISTORY,
};
use crate::QueueErrorKind;
use async_nats::jetstream::AckKind;
use async_nats::HeaderValue;
use bytes::Bytes;
use std::time::{Duration, Instant};

/// How long a settlement (ack, nak, term, progress) waits for the server's
/// answer.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long before the server's ack wait ends a lease is given up, and
/// how long a settlement waits for the server's answer: the same, so that a
/// settlement (a late Nak or Term, say) never reaches the server after it
/// handed the message to another worker. A tenth of the ack wait, or
/// [`SETTLE_TIMEOUT`] if that is longer (up to half the ack wait; the
/// worker renews every third).
fn settle_margin(ack_wait: Duration) -> Duration {
    (ack_wait / 10).max(SETTLE_TIMEOUT.min(ack_wait / 2))
}

impl JetStreamQueue {
    /// Sends `kind` to the delivery's reply subject and waits for the
    /// server's answer. `false` if this queue did not hand the delivery out.
    pub(super) async fn settle(
        &self,
        delivery: &Delivery,
        kind: AckKind,
        done: bool,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.held(delivery) else {
            return Ok(false);
        };
        let sent = Instant::now();
        self.settle_reply(&held.reply, kind).await?;
        let mut map = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        if done {
            map.remove(&delivery.lease);
        } else if let Some(h) = map.get_mut(&delivery.lease) {
            // In progress: the server restarted the ack wait after `sent`.
            h.until = h.until.max(self.lease_until(sent));
        }
        Ok(true)
    }

    /// Until when a lease the server started (or renewed) after `since`
    /// surely holds: a settlement sent until then is answered, or given
    /// up, before the server's ack wait ends (see [`settle_margin`]).
    pub(super) fn lease_until(&self, since: Instant) -> Instant {
        let wait = self.inner.ack_wait;
        since + wait - settle_margin(wait)
    }

    pub(super) async fn settle_reply(&self, reply: &str, kind: AckKind) -> Result<(), QueueError> {
        let payload: Bytes = kind.into();
        tokio::time::timeout(
            settle_margin(self.inner.ack_wait),
            self.inner.client.request(reply.to_owned(), payload),
        )
        .await
        .map_err(|_| {
            fail(
                QueueErrorKind::Timeout,
                "the server did not answer the settlement",
            )
        })?
        .map_err(err)?;
        Ok(())
    }

    /// The delivery's lease, if this queue handed it out and it still
    /// holds. One that ran out is forgotten: the server may have handed the
    /// message to another worker (JetStream accepts a late settlement
    /// without saying so), so nothing is sent for it any more.
    pub(super) fn held(&self, delivery: &Delivery) -> Option<Held> {
        let mut map = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        let held = map.get(&delivery.lease)?;
        if Instant::now() >= held.until {
            map.remove(&delivery.lease);
            return None;
        }
        Some(held.clone())
    }

    /// Moves a held entry to the back of the queue, due after `after`, with
    /// `base` attempts counted (its attempt is not counted again).
    pub(super) async fn requeue(
        &self,
        delivery: &Delivery,
        after: Duration,
        base: u32,
        history: Option<&str>,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.held(delivery) else {
            return Ok(false);
        };
        let marker = hashed(&delivery.message.key);
        let mut h = Self::entry_headers(&marker, ms_of(delivery.enqueued_at), base);
        h.insert(H_BASE, HeaderValue::from(u64::from(base)));
        h.insert(
            H_DUE,
            HeaderValue::from(
                now_ms().saturating_add(u64::try_from(after.as_millis()).unwrap_or(u64::MAX)),
            ),
        );
        if let Some(history) = history.filter(|h| !h.is_empty()) {
            h.insert(H_HISTORY, history);
        }
        let id = format!("p-{}-{}", held.sequence, delivery.attempt);
        self.publish(&self.inner.subject, &id, h, delivery.message.encode())
            .await?;
        self.settle(delivery, AckKind::Ack, true).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_margin_covers_the_settlement_timeout() {
        for secs in [1, 2, 5, 10, 30, 60, 300] {
            let wait = Duration::from_secs(secs);
            let margin = settle_margin(wait);
            // What a settlement may wait is what the lease keeps before the
            // server's ack wait ends, and renewals (every third) fit.
            assert!(margin >= (wait / 10), "{wait:?}");
            assert!(margin <= wait / 2, "{wait:?}");
            assert!(margin >= SETTLE_TIMEOUT.min(wait / 2), "{wait:?}");
        }
        assert_eq!(settle_margin(Duration::from_secs(30)), SETTLE_TIMEOUT);
        assert_eq!(
            settle_margin(Duration::from_secs(300)),
            Duration::from_secs(30)
        );
    }
}
