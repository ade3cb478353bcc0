//! Pacing across gateways: a lane's delivery slots and turns are claims in
//! the store every gateway on the broker shares.

use super::super::QueueError;
use super::{err, AmqpQueue};
use crate::common::now_ms;
use std::collections::HashSet;
use std::time::{Duration, Instant};
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

/// How long a lane's shared slots, all found taken, are not looked at
/// again at first.
const RESCAN: Duration = Duration::from_millis(50);

/// The longest they are not looked at again, while they stay taken.
const RESCAN_MAX: Duration = Duration::from_millis(200);

/// Where the next look at a lane's shared slots starts, and until when
/// they are known all taken.
#[derive(Debug, Default)]
pub(super) struct SlotScan {
    next: usize,
    full_until: Option<Instant>,
    /// Looks in a row that found every slot taken.
    full_looks: u32,
}

impl<S: Store> AmqpQueue<S> {
    /// Takes one of the lane's `limit` slots: tries each slot this
    /// instance does not hold, from the one after the last it took. When
    /// every slot is taken, the lane's slots are not looked at again (by any
    /// delivery of this instance) for a while: [`RESCAN`], doubling while
    /// they stay full up to [`RESCAN_MAX`], or until this instance gives
    /// one back. So a waiting lane costs the store at most `limit` claims
    /// per look, however many deliveries wait.
    pub(super) async fn slot_take(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        if limit == 0 {
            return Ok(None);
        }
        let now = Instant::now();
        let start = {
            let mut scans = self
                .inner
                .slot_scans
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let scan = scans.entry(lane.to_owned()).or_default();
            if scan.full_until.is_some_and(|until| now < until) {
                return Ok(None);
            }
            scan.next
        };
        let prefix = format!("amqp:{}:slot:{lane}:", self.inner.name);
        let own: HashSet<String> = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|(key, _)| key.starts_with(&prefix))
            .map(|(key, _)| key.clone())
            .collect();
        let store = &self.inner.store;
        for j in 0..limit {
            let i = start.wrapping_add(j) % limit;
            let key = format!("{prefix}{i}");
            if own.contains(&key) {
                continue;
            }
            let token = OwnerToken::new();
            let fp = Fingerprint::of(b"slot");
            // Nobody waits on a slot: its claim starts no watch.
            let got = store.claim_unwatched(&key, fp, token, lease).await;
            if let Claim::Acquired(_) = got.map_err(err)? {
                let t = token.as_u128();
                let slot = (t >> 64) as u64 ^ t as u64;
                self.inner
                    .slots
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(slot, (key, token));
                let mut scans = self
                    .inner
                    .slot_scans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                *scans.entry(lane.to_owned()).or_default() = SlotScan {
                    next: i.wrapping_add(1) % limit,
                    ..SlotScan::default()
                };
                return Ok(Some(slot));
            }
        }
        let mut scans = self
            .inner
            .slot_scans
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let scan = scans.entry(lane.to_owned()).or_default();
        let wait = RESCAN
            .saturating_mul(1 << scan.full_looks.min(8))
            .min(RESCAN_MAX);
        scan.full_looks = scan.full_looks.saturating_add(1);
        scan.full_until = Some(Instant::now() + wait);
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

    pub(super) async fn slot_give(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        let held = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        if let Some((key, token)) = held {
            self.inner.store.release(&key, token).await.map_err(err)?;
            // A slot is free: the next delivery of the lane looks at once.
            self.inner
                .slot_scans
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(lane);
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
            .claim_unwatched(&key, turn_ending(ends), OwnerToken::new(), interval)
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
