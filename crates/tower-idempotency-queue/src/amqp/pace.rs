//! Pacing across gateways: a lane's delivery slots and turns are claims in
//! the store every gateway on the broker shares.

use super::super::records::now_ms;
use super::super::QueueError;
use super::{err, AmqpQueue};
use std::time::Duration;
use tower_idempotency::store::{Claim, OwnerToken, Store};
use tower_idempotency::Fingerprint;

/// The claim of a turn that ends at `ends` (ms since the epoch): the time
/// goes in its fingerprint, so that another instance that finds the turn
/// taken knows how long to wait.
fn turn_ending(ends: u64) -> Fingerprint {
    let mut fp = [0u8; 16];
    fp[..8].copy_from_slice(TURN_TAG);
    fp[8..].copy_from_slice(&ends.to_le_bytes());
    Fingerprint::from_bytes(fp)
}

/// When the turn claimed with `fp` ends, if [`turn_ending`] made it.
fn turn_end(fp: Fingerprint) -> Option<u64> {
    let fp = fp.to_bytes();
    let (tag, ends) = fp.split_at(8);
    (tag == TURN_TAG).then(|| u64::from_le_bytes(ends.try_into().unwrap_or_default()))
}

const TURN_TAG: &[u8; 8] = b"turn-end";

impl<S: Store> AmqpQueue<S> {
    pub(super) async fn slot_take(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        let store = &self.inner.store;
        for i in 0..limit {
            let key = format!("amqp:{}:slot:{lane}:{i}", self.inner.name);
            let token = OwnerToken::new();
            let fp = Fingerprint::of(b"slot");
            if let Claim::Acquired(_) = store.claim(&key, fp, token, lease).await.map_err(err)? {
                let t = token.as_u128();
                let slot = (t >> 64) as u64 ^ t as u64;
                self.inner
                    .slots
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(slot, (key, token));
                return Ok(Some(slot));
            }
        }
        Ok(None)
    }

    pub(super) async fn slot_renew(
        &self,
        _lane: &str,
        slot: u64,
        lease: Duration,
    ) -> Result<(), QueueError> {
        let held = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&slot)
            .cloned();
        if let Some((key, token)) = held {
            self.inner
                .store
                .renew(&key, token, lease)
                .await
                .map_err(err)?;
        }
        Ok(())
    }

    pub(super) async fn slot_give(&self, _lane: &str, slot: u64) -> Result<(), QueueError> {
        let held = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        if let Some((key, token)) = held {
            self.inner.store.release(&key, token).await.map_err(err)?;
        }
        Ok(())
    }

    pub(super) async fn turn_take(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        let key = format!("amqp:{}:turn:{lane}", self.inner.name);
        let interval = interval.max(Duration::from_millis(1));
        let now = now_ms();
        let ends = now.saturating_add(u64::try_from(interval.as_millis()).unwrap_or(u64::MAX));
        let got = self
            .inner
            .store
            .claim(&key, turn_ending(ends), OwnerToken::new(), interval)
            .await
            .map_err(err)?;
        // Taken: it runs out one interval from now, which is the next turn.
        // Held by another: wait until it ends (its claim says when), not a
        // poll of the store every fraction of the interval.
        Ok(match got {
            Claim::Acquired(_) => None,
            Claim::InFlight { fingerprint, .. } => Some(match turn_end(fingerprint) {
                Some(end) => Duration::from_millis(end.saturating_sub(now))
                    .clamp(Duration::from_millis(1), interval),
                // Another version's turn: its end unknown.
                None => (interval / 4).max(Duration::from_millis(1)),
            }),
            _ => Some(interval),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_turn_says_when_it_ends() {
        let ends = 1_796_606_819_295;
        assert_eq!(turn_end(turn_ending(ends)), Some(ends));
        // Another version's turn (its fingerprint says nothing of its end).
        assert_eq!(turn_end(Fingerprint::of(b"turn")), None);
    }
}
