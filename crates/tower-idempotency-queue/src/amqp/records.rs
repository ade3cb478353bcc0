//! Who says "already queued": the key records kept in the idempotency
//! [`Store`], which follow an entry from queued to delivered or dead.

use super::super::{Ingested, Message, QueueError};
use super::{err, fail, AmqpQueue};
use crate::QueueErrorKind;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_idempotency::store::{
    Claim, CompletedRecord, Forgotten, OwnerToken, Store, StoredResponse,
};
use tower_idempotency::Fingerprint;

/// How long an ingest's claim on a key lasts while it publishes.
pub(super) const INGEST_LEASE: Duration = Duration::from_secs(10);

/// The record's state, as the status of its stored response.
pub(super) const QUEUED: StatusCode = StatusCode::ACCEPTED;
pub(super) const DELIVERED: StatusCode = StatusCode::OK;
pub(super) const DEAD: StatusCode = StatusCode::GONE;
/// A claim answered with a variant this version does not know.
const UNKNOWN_CLAIM: &str = "the store answered a claim this version does not know";

impl<S: Store> AmqpQueue<S> {
    pub(super) fn record_key(&self, key: &str) -> String {
        format!("amqp:{}:{key}", self.inner.name)
    }

    /// The stored record of a key in state `status`.
    pub(super) fn record(fingerprint: Fingerprint, status: StatusCode) -> Arc<CompletedRecord> {
        Arc::new(CompletedRecord::new(
            fingerprint,
            StoredResponse::new(status, HeaderMap::new(), Bytes::new()),
        ))
    }

    /// Changes the key's record to `status`, kept for `window` from now,
    /// in one store call ([`Store::replace`]): a copy arriving meanwhile
    /// finds the old state or the new one, never the key free. A key without
    /// a record (its window ran out while the entry waited) gets one, claimed
    /// first: a copy queued meanwhile keeps its own. A failure is logged and
    /// leaves the record as it was: an entry whose record stays "queued" is
    /// still deduplicated, `forget` then refuses it.
    pub(super) async fn set_state(&self, key: &str, fingerprint: Fingerprint, status: StatusCode) {
        let rk = self.record_key(key);
        let store = &self.inner.store;
        let record = Self::record(fingerprint, status);
        let result = async {
            if store
                .replace(&rk, record.clone(), self.inner.window)
                .await?
            {
                return Ok(());
            }
            let token = OwnerToken::new();
            if let Claim::Acquired(_) = store.claim(&rk, fingerprint, token, INGEST_LEASE).await? {
                store
                    .complete(&rk, token, record, self.inner.window)
                    .await?;
            }
            Ok::<_, tower_idempotency::store::StoreError>(())
        }
        .await;
        if let Err(_e) = result {
            crate::log_warn!(key = %key, error = %_e, "amqp queue: the key's record was not updated");
        }
    }

    /// Forgets the record of `key` if it says dead-lettered (a deleted
    /// dead letter's): a later copy is queued again.
    pub(super) async fn forget_dead_record(&self, key: &str) -> Result<(), QueueError> {
        let rk = self.record_key(key);
        let store = &self.inner.store;
        let token = OwnerToken::new();
        match store
            .claim(&rk, Fingerprint::of(b"forget"), token, INGEST_LEASE)
            .await
            .map_err(err)?
        {
            Claim::Acquired(_) => {
                store.release(&rk, token).await.map_err(err)?;
            }
            Claim::Completed(rec) if rec.response.status == DEAD => {
                store.forget(&rk).await.map_err(err)?;
            }
            _ => {}
        }
        Ok(())
    }

    pub(super) async fn forget_now(&self, key: &str) -> Result<bool, QueueError> {
        let rk = self.record_key(key);
        let store = &self.inner.store;
        let token = OwnerToken::new();
        match store
            .claim(&rk, Fingerprint::of(b"forget"), token, INGEST_LEASE)
            .await
            .map_err(err)?
        {
            Claim::Acquired(_) => {
                store.release(&rk, token).await.map_err(err)?;
                Ok(false)
            }
            Claim::InFlight { .. } => Err(QueueError::new(
                QueueErrorKind::Conflict,
                "still queued: a copy is being queued now",
            )),
            Claim::Completed(rec) if rec.response.status == DELIVERED => {
                match store.forget(&rk).await.map_err(err)? {
                    Forgotten::Deleted => Ok(true),
                    Forgotten::Absent => Ok(false),
                    _ => Err(QueueError::new(
                        QueueErrorKind::Conflict,
                        "still queued: a copy is being queued now",
                    )),
                }
            }
            Claim::Completed(rec) if rec.response.status == DEAD => Err(QueueError::new(
                QueueErrorKind::Conflict,
                "dead-lettered: replay it from the dead letters instead",
            )),
            Claim::Completed(_) => Err(QueueError::new(
                QueueErrorKind::Conflict,
                "still queued: delivered when due (or dead-lettered: replay it from the dead letters instead)",
            )),
            _ => Err(fail(QueueErrorKind::Corrupt, UNKNOWN_CLAIM)),
        }
    }

    /// Claims `message`'s key for `token`, waiting for a copy being queued
    /// meanwhile: `None` once claimed (the caller publishes), or what a copy
    /// found (already queued, or another request under the key).
    pub(super) async fn claim_key(
        &self,
        message: &Message,
        token: OwnerToken,
    ) -> Result<Option<Ingested>, QueueError> {
        let rk = self.record_key(&message.key);
        let fp = message.fingerprint;
        let store = &self.inner.store;
        let deadline = Instant::now() + INGEST_LEASE + Duration::from_secs(1);
        loop {
            match store
                .claim(&rk, fp, token, INGEST_LEASE)
                .await
                .map_err(err)?
            {
                Claim::Completed(rec) if rec.fingerprint == fp => {
                    return Ok(Some(Ingested::Duplicate))
                }
                Claim::Completed(_) => return Ok(Some(Ingested::Mismatch)),
                Claim::InFlight { fingerprint, .. } if fingerprint != fp => {
                    return Ok(Some(Ingested::Mismatch))
                }
                Claim::InFlight { watch, .. } => {
                    // Another copy is publishing: its outcome decides.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(fail(
                            QueueErrorKind::Timeout,
                            "another copy of this key is still being queued",
                        ));
                    }
                    let _ = tokio::time::timeout(left, watch.changed()).await;
                }
                Claim::Acquired(_) => return Ok(None),
                _ => return Err(fail(QueueErrorKind::Corrupt, UNKNOWN_CLAIM)),
            }
        }
    }

    /// A publish failed: the claim goes, nothing was acknowledged.
    pub(super) async fn release_key(&self, message: &Message, token: OwnerToken) {
        let rk = self.record_key(&message.key);
        let _ = self.inner.store.release(&rk, token).await;
    }

    /// The broker confirmed `message`: its claim becomes "queued".
    pub(super) async fn queued(&self, message: &Message, token: OwnerToken) {
        let rk = self.record_key(&message.key);
        let (store, fp) = (&self.inner.store, message.fingerprint);
        // Confirmed: the entry is durable whatever happens to the record
        // (a record not completed runs out, and a later copy queues the key
        // again: a duplicate the consumer runs once).
        let record = Self::record(fp, QUEUED);
        if let Err(_e) = store.complete(&rk, token, record, self.inner.window).await {
            crate::log_warn!(key = %message.key, error = %_e, "amqp queue: queued, but the key's record was not completed");
        }
    }
}
