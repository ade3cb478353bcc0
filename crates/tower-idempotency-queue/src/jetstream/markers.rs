//! The key markers: one record per key in the `KEYS` bucket that decides
//! whether a copy is queued, a duplicate or a mismatch, and what a key's
//! entry became (delivered, dead-lettered, replayed, forgotten).

use super::{err, fail, now_ms, unique, Ingested, JetStreamQueue, Message, QueueError};
use super::{pace::CAS_TRIES, EntryId};
use crate::QueueErrorKind;
use async_nats::jetstream::kv;
use bytes::Bytes;
use sha2::{Digest, Sha256};

/// The marker's states.
pub(super) const PENDING: u8 = b'p';
pub(super) const QUEUED: u8 = b'q';
pub(super) const DEAD: u8 = b'x';
pub(super) const DELIVERED: u8 = b'd';

/// A key-value key for any text (keys allow few characters).
pub(super) fn hashed(text: &str) -> String {
    let d = Sha256::digest(text.as_bytes());
    d.iter().take(20).map(|b| format!("{b:02x}")).collect()
}

/// A marker: state, fingerprint, when (ms), message id.
pub(super) struct Marker {
    pub(super) state: u8,
    pub(super) fingerprint: [u8; 16],
    pub(super) id: String,
}

impl Marker {
    pub(super) fn encode(state: u8, fingerprint: [u8; 16], id: &str) -> Bytes {
        let mut out = Vec::with_capacity(1 + 16 + 8 + id.len());
        out.push(state);
        out.extend_from_slice(&fingerprint);
        out.extend_from_slice(&now_ms().to_le_bytes());
        out.extend_from_slice(id.as_bytes());
        out.into()
    }

    pub(super) fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 25 {
            return None;
        }
        Some(Self {
            state: b[0],
            fingerprint: b[1..17].try_into().ok()?,
            id: String::from_utf8(b[25..].to_vec()).ok()?,
        })
    }
}

impl JetStreamQueue {
    /// Writes the marker of `key` as `state`, keeping its fingerprint and id.
    pub(super) async fn mark(
        &self,
        marker: &str,
        state: u8,
        message: &Message,
    ) -> Result<(), QueueError> {
        let fp = message.fingerprint.to_bytes();
        self.inner
            .keys
            .put(marker, Marker::encode(state, fp, ""))
            .await
            .map_err(err)?;
        Ok(())
    }

    /// Marks a replayed key queued again: only over its dead-lettered marker
    /// (or none), in one compare-and-set write. A worker may already have
    /// delivered the replayed entry and marked the key delivered; that is
    /// never written over (the key would stay "queued" with nothing
    /// queued).
    pub(super) async fn mark_replayed(
        &self,
        marker: &str,
        message: &Message,
    ) -> Result<(), QueueError> {
        let value = Marker::encode(QUEUED, message.fingerprint.to_bytes(), "");
        for _ in 0..CAS_TRIES {
            let entry = self.inner.keys.entry(marker).await.map_err(err)?;
            let written = match entry.filter(|e| e.operation == kv::Operation::Put) {
                Some(e) => {
                    if Marker::decode(&e.value).map(|m| m.state) != Some(DEAD) {
                        return Ok(());
                    }
                    self.inner
                        .keys
                        .update(marker, value.clone(), e.revision)
                        .await
                        .is_ok()
                }
                None => self.inner.keys.create(marker, value.clone()).await.is_ok(),
            };
            if written {
                return Ok(());
            }
        }
        Err(fail(
            QueueErrorKind::Conflict,
            "the key's marker kept changing",
        ))
    }

    pub(super) async fn ingest_keyed(&self, message: Message) -> Result<Ingested, QueueError> {
        let marker = hashed(&message.key);
        let fp = message.fingerprint.to_bytes();
        for _ in 0..8 {
            let id = unique();
            match self
                .inner
                .keys
                .create(&marker, Marker::encode(PENDING, fp, &id))
                .await
            {
                Ok(revision) => {
                    let h = Self::entry_headers(&marker, now_ms(), 0);
                    // A failed publish leaves the marker pending: the
                    // sender's retry publishes again, under the same id.
                    let ack = self
                        .publish(&self.inner.subject, &id, h, message.encode())
                        .await?;
                    let _ = self
                        .inner
                        .keys
                        .update(&marker, Marker::encode(QUEUED, fp, &id), revision)
                        .await;
                    return Ok(Ingested::Queued(EntryId::new(ack.sequence.to_string())));
                }
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    let Some(entry) = self.inner.keys.entry(&marker).await.map_err(err)? else {
                        continue;
                    };
                    if entry.operation != kv::Operation::Put {
                        continue;
                    }
                    let Some(cur) = Marker::decode(&entry.value) else {
                        return Err(fail(QueueErrorKind::Corrupt, "unreadable key marker"));
                    };
                    if cur.fingerprint != fp {
                        return Ok(Ingested::Mismatch);
                    }
                    if cur.state != PENDING {
                        return Ok(Ingested::Duplicate);
                    }
                    // Being queued by another copy (or its publish failed):
                    // stored once under its id, and acknowledged only when
                    // the server confirms.
                    let h = Self::entry_headers(&marker, now_ms(), 0);
                    let ack = self
                        .publish(&self.inner.subject, &cur.id, h, message.encode())
                        .await?;
                    let _ = self
                        .inner
                        .keys
                        .update(&marker, Marker::encode(QUEUED, fp, &cur.id), entry.revision)
                        .await;
                    return Ok(if ack.duplicate {
                        Ingested::Duplicate
                    } else {
                        Ingested::Queued(EntryId::new(ack.sequence.to_string()))
                    });
                }
                Err(e) => return Err(err(e)),
            }
        }
        Err(fail(
            QueueErrorKind::Conflict,
            "the key's marker kept changing",
        ))
    }

    /// Deletes the marker `marker` if it says dead-lettered.
    pub(super) async fn forget_dead_marker(&self, marker: &str) -> Result<(), QueueError> {
        let Some(entry) = self.inner.keys.entry(marker).await.map_err(err)? else {
            return Ok(());
        };
        if entry.operation == kv::Operation::Put
            && Marker::decode(&entry.value).map(|m| m.state) == Some(DEAD)
        {
            // Changed meanwhile (a replay of a copy): kept.
            let _ = (self.inner.keys)
                .delete_expect_revision(marker, Some(entry.revision))
                .await;
        }
        Ok(())
    }

    pub(super) async fn forget_key(&self, key: &str) -> Result<bool, QueueError> {
        let marker = hashed(key);
        let Some(entry) = self.inner.keys.entry(&marker).await.map_err(err)? else {
            return Ok(false);
        };
        if entry.operation != kv::Operation::Put {
            return Ok(false);
        }
        match Marker::decode(&entry.value).map(|m| m.state) {
            Some(DELIVERED) => {
                self.inner
                    .keys
                    .delete_expect_revision(&marker, Some(entry.revision))
                    .await
                    .map_err(err)?;
                Ok(true)
            }
            _ => Err(QueueError::new(
                QueueErrorKind::Conflict,
                "still queued: delivered when due (or dead-lettered: replay it from the dead letters instead)",
            )),
        }
    }
}
