//! Dead letters: burying an entry in the `DEAD` stream, listing them, and
//! replaying them into the queue once.

use super::markers::DEAD;
use super::{err, hashed, header_text, header_u64, ms_of, now_ms, one_line, time_of};
use super::{DeadLetter, Delivery, EntryId, JetStreamQueue, Message, QueueError, Reseal};
use super::{H_BASE, H_DEAD_AT, H_ERROR, H_HISTORY, H_MARKER};
use crate::attempts::{dead_letter, History};
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{kv, stream, AckKind};
use async_nats::HeaderValue;
use std::time::SystemTime;

impl JetStreamQueue {
    /// Publishes a dead letter for `sequence` (idempotently) and terminates
    /// the message behind `reply`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn bury(
        &self,
        reply: &str,
        sequence: u64,
        marker: &str,
        payload: Vec<u8>,
        attempts: u32,
        enqueued: u64,
        error: &str,
        history: Option<&str>,
    ) -> Result<(), QueueError> {
        let mut h = Self::entry_headers(marker, enqueued, attempts);
        h.insert(H_BASE, HeaderValue::from(u64::from(attempts)));
        h.insert(H_ERROR, one_line(error).as_str());
        let history = History::record(history, attempts, SystemTime::now(), error);
        h.insert(H_HISTORY, history.as_str());
        h.insert(H_DEAD_AT, HeaderValue::from(now_ms()));
        let id = format!("d-{sequence}");
        self.publish(&self.inner.dead_subject, &id, h, payload)
            .await?;
        self.settle_reply(reply, AckKind::Term).await
    }

    pub(super) async fn bury_delivery(
        &self,
        delivery: &Delivery,
        error: &str,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.held(delivery) else {
            return Ok(false);
        };
        let marker = hashed(&delivery.message.key);
        self.mark(&marker, DEAD, &delivery.message).await?;
        self.bury(
            &held.reply,
            held.sequence,
            &marker,
            delivery.message.encode(),
            delivery.attempt,
            ms_of(delivery.enqueued_at),
            error,
            delivery.history.as_deref(),
        )
        .await?;
        self.inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&delivery.lease);
        Ok(true)
    }

    pub(super) async fn list_dead(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        self.list_dead_from(1, limit.max(1)).await
    }

    /// The sequence a page after `after` starts at: `None` when nothing can
    /// follow it.
    pub(super) fn dead_start(&self, after: Option<&EntryId>) -> Option<u64> {
        match after {
            None => Some(1),
            // An id that is no sequence comes before all.
            Some(a) => a
                .as_str()
                .parse::<u64>()
                .map_or(Some(1), |s| s.checked_add(1)),
        }
    }

    /// At most `limit` dead letters from the sequence `seq` on.
    pub(super) async fn list_dead_from(
        &self,
        mut seq: u64,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let mut out = Vec::new();
        while out.len() < limit {
            let got = self
                .inner
                .dead
                .raw_message_builder()
                .sequence(seq)
                .next_by_subject(self.inner.dead_subject.clone())
                .send()
                .await;
            let m = match got {
                Ok(m) => m,
                Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => break,
                Err(e) => return Err(err(e)),
            };
            seq = m.sequence + 1;
            out.push(letter_of(&m));
        }
        Ok(out)
    }

    pub(super) async fn find_letter(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        let Ok(seq) = id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        Ok(self.dead_message(seq).await?.as_ref().map(letter_of))
    }

    /// Deletes the dead letter `id` and its key's marker (while it says
    /// dead-lettered): a later copy is queued again. `None` when there is
    /// no such letter, or a replay has it.
    pub(super) async fn delete_letter(
        &self,
        id: &EntryId,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let Ok(seq) = id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        let Some(m) = self.dead_message(seq).await? else {
            return Ok(None);
        };
        if !self.claim(&m, CLAIM_DELETE).await? {
            return Ok(None);
        }
        match self.inner.dead.delete_message(seq).await {
            Ok(true) => {}
            // Deleted meanwhile by another delete.
            Ok(false) | Err(_) => return Ok(None),
        }
        let letter = letter_of(&m);
        self.forget_dead_marker(&hashed(&letter.message.key))
            .await?;
        Ok(Some(letter))
    }

    /// Publishes the dead letter `id` back into the queue, then deletes it.
    /// `false` when there is no such letter, or a delete has it.
    pub(super) async fn replay_letter(
        &self,
        id: &EntryId,
        reseal: &Reseal,
    ) -> Result<bool, QueueError> {
        let Ok(seq) = id.as_str().parse::<u64>() else {
            return Ok(false);
        };
        let Some(m) = self.dead_message(seq).await? else {
            return Ok(false);
        };
        if !self.claim(&m, CLAIM_REPLAY).await? {
            return Ok(false);
        }
        // A failure from here on leaves the letter (and the claim): the
        // next replay of it finishes, under the same message id.
        let marker = header_text(Some(&m.headers), H_MARKER);
        let h = Self::entry_headers(&marker, now_ms(), 0);
        let message = Message::decode(&m.payload);
        let payload = match message.as_ref().and_then(reseal) {
            Some(resealed) => resealed.encode(),
            None => m.payload.to_vec(),
        };
        self.publish(&self.inner.subject, &format!("r-{seq}"), h, payload)
            .await?;
        if let Some(message) = message {
            self.mark_replayed(&marker, &message).await?;
        }
        match self.inner.dead.delete_message(seq).await {
            Ok(deleted) => Ok(deleted),
            // Deleted meanwhile by another replay (whose publish carried
            // the same id: one entry).
            Err(_) => Ok(false),
        }
    }

    /// The message of the dead-letter stream at `seq`, if there is one.
    async fn dead_message(&self, seq: u64) -> Result<Option<StreamMessage>, QueueError> {
        match self.inner.dead.get_raw_message(seq).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(err(e)),
        }
    }

    /// Claims the dead letter `m` for a replay or a delete, with one
    /// create-only write to the `KEYS` bucket: whichever comes first has it
    /// for good, and the other is refused (`false`). A claim is never given
    /// back: a call of the same kind that was cut short (a failed publish,
    /// a process that died) is finished by the next one.
    async fn claim(&self, m: &StreamMessage, kind: u8) -> Result<bool, QueueError> {
        // The time it was stored too: the sequences of a dead-letter
        // stream made again start over.
        let key = format!("dead-{}-{}", m.sequence, m.time.unix_timestamp_nanos());
        match self.inner.keys.create(&key, vec![kind].into()).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let held = self.inner.keys.get(&key).await.map_err(err)?;
                Ok(held.is_some_and(|v| v.first() == Some(&kind)))
            }
            Err(e) => Err(err(e)),
        }
    }
}

/// What a dead letter's claim says has it.
const CLAIM_REPLAY: u8 = b'r';
const CLAIM_DELETE: u8 = b'd';

/// A message of the dead-letter stream as a dead letter.
fn letter_of(m: &StreamMessage) -> DeadLetter {
    let headers = Some(&m.headers);
    let id = m.sequence.to_string();
    let history = header_text(headers, H_HISTORY);
    dead_letter(
        EntryId::new(&*id),
        Message::decode(&m.payload).unwrap_or_else(|| Message::undecodable(&id, &m.payload)),
        header_u64(headers, H_BASE).map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        header_text(headers, H_ERROR),
        time_of(header_u64(headers, H_DEAD_AT).unwrap_or(0)),
        Some(&history),
    )
}
