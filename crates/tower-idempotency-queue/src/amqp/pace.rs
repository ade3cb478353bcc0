//! Pacing across gateways: a lane's delivery slots and turns are claims in
//! the store every gateway on the broker shares.

use super::super::QueueError;
use super::{err, AmqpQueue};
use std::time::Duration;
use tower_idempotency::store::{Claim, OwnerToken, Store};
use tower_idempotency::Fingerprint;

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
        let got = self
            .inner
            .store
            .claim(&key, Fingerprint::of(b"turn"), OwnerToken::new(), interval)
            .await
            .map_err(err)?;
        // Taken: it runs out one interval from now, which is the next turn.
        Ok(match got {
            Claim::Acquired(_) => None,
            _ => Some((interval / 4).max(Duration::from_millis(1))),
        })
    }
}
