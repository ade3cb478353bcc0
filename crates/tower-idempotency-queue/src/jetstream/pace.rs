//! Pacing across gateways: delivery slots and turns in the `PACE` bucket,
//! each change a compare-and-set.

use super::markers::hashed;
use super::{err, now_ms, JetStreamQueue, QueueError};
use async_nats::jetstream::kv;
use bytes::Bytes;
use std::time::Duration;

/// Pacing state in the `PACE` bucket: a list of `(slot, until ms)` or one
/// time (ms).
pub(super) fn encode_slots(slots: &[(u64, u64)]) -> Bytes {
    let mut out = Vec::with_capacity(slots.len() * 16);
    for (s, t) in slots {
        out.extend_from_slice(&s.to_le_bytes());
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.into()
}

pub(super) fn decode_slots(b: &[u8]) -> Vec<(u64, u64)> {
    b.chunks_exact(16)
        .map(|c| {
            (
                u64::from_le_bytes(c[..8].try_into().unwrap_or_default()),
                u64::from_le_bytes(c[8..].try_into().unwrap_or_default()),
            )
        })
        .collect()
}

/// How many times a compare-and-set on the `PACE` bucket is tried.
pub(super) const CAS_TRIES: usize = 16;

impl JetStreamQueue {
    /// The current value and revision of a pacing key (`None`: absent).
    async fn pace_entry(&self, key: &str) -> Result<Option<(Bytes, u64)>, QueueError> {
        Ok(self
            .inner
            .pace
            .entry(key)
            .await
            .map_err(err)?
            .filter(|e| e.operation == kv::Operation::Put)
            .map(|e| (e.value, e.revision)))
    }

    /// Writes `value` if the key is still at `revision` (`None`: absent).
    async fn pace_cas(&self, key: &str, value: Bytes, revision: Option<u64>) -> bool {
        match revision {
            Some(r) => self.inner.pace.update(key, value, r).await.is_ok(),
            None => self.inner.pace.create(key, value).await.is_ok(),
        }
    }

    /// Changes the slots of `lane` with `change` (compare-and-set, retried);
    /// what `change` returned, or `None` if every try conflicted.
    async fn with_slots<T>(
        &self,
        lane: &str,
        mut change: impl FnMut(&mut Vec<(u64, u64)>, u64) -> (bool, T),
    ) -> Result<Option<T>, QueueError> {
        let key = format!("slots.{}", hashed(lane));
        for _ in 0..CAS_TRIES {
            let now = now_ms();
            let cur = self.pace_entry(&key).await?;
            let mut slots = cur
                .as_ref()
                .map(|(v, _)| decode_slots(v))
                .unwrap_or_default();
            slots.retain(|&(_, until)| until > now);
            let (write, out) = change(&mut slots, now);
            if !write {
                return Ok(Some(out));
            }
            if self
                .pace_cas(&key, encode_slots(&slots), cur.map(|(_, r)| r))
                .await
            {
                return Ok(Some(out));
            }
            tokio::time::sleep(Duration::from_millis(1 + now % 7)).await;
        }
        Ok(None)
    }
}

impl JetStreamQueue {
    pub(super) async fn take_pace_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        let t = tower_idempotency::store::OwnerToken::new().as_u128();
        let slot = (t >> 64) as u64 ^ t as u64;
        let lease = lease.as_millis().max(1) as u64;
        let got = self
            .with_slots(lane, |slots, now| {
                if slots.len() >= limit {
                    return (false, None);
                }
                slots.push((slot, now + lease));
                (true, Some(slot))
            })
            .await?;
        Ok(got.flatten())
    }

    pub(super) async fn renew_pace_slot(
        &self,
        lane: &str,
        slot: u64,
        lease: Duration,
    ) -> Result<(), QueueError> {
        let lease = lease.as_millis().max(1) as u64;
        self.with_slots(lane, |slots, now| {
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some(s) => {
                    s.1 = now + lease;
                    (true, ())
                }
                None => (false, ()),
            }
        })
        .await?;
        Ok(())
    }

    pub(super) async fn give_pace_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        self.with_slots(lane, |slots, _| {
            let before = slots.len();
            slots.retain(|(s, _)| *s != slot);
            (slots.len() != before, ())
        })
        .await?;
        Ok(())
    }

    pub(super) async fn take_pace_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        let key = format!("turn.{}", hashed(lane));
        let interval = interval.as_millis().max(1) as u64;
        for _ in 0..CAS_TRIES {
            let now = now_ms();
            let cur = self.pace_entry(&key).await?;
            let next = cur
                .as_ref()
                .and_then(|(v, _)| v.get(..8)?.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            if next > now {
                return Ok(Some(Duration::from_millis(next - now)));
            }
            let value = Bytes::copy_from_slice(&(now + interval).to_le_bytes());
            if self.pace_cas(&key, value, cur.map(|(_, r)| r)).await {
                return Ok(None);
            }
        }
        Ok(Some(Duration::from_millis(interval)))
    }
}
