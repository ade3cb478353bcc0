//! Dead letters: burying an entry in the `DEAD` stream, listing them, and
//! replaying them into the queue once.

use super::markers::DEAD;
use super::{err, hashed, header_text, header_u64, ms_of, now_ms, one_line, time_of};
use super::{DeadLetter, Delivery, EntryId, JetStreamQueue, Message, QueueError};
use super::{H_BASE, H_DEAD_AT, H_ERROR, H_HISTORY, H_MARKER};
use crate::attempts::{dead_letter, History};
use async_nats::jetstream::{stream, AckKind};
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
        match self.inner.dead.get_raw_message(seq).await {
            Ok(m) => Ok(Some(letter_of(&m))),
            Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(err(e)),
        }
    }

    /// Deletes the dead letter `id` and its key's marker (while it says
    /// dead-lettered): a later copy is queued again.
    pub(super) async fn delete_letter(
        &self,
        id: &EntryId,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let Some(letter) = self.find_letter(id).await? else {
            return Ok(None);
        };
        let Ok(seq) = id.as_str().parse::<u64>() else {
            return Ok(None);
        };
        match self.inner.dead.delete_message(seq).await {
            Ok(true) => {}
            // Replayed or deleted meanwhile by another call.
            Ok(false) | Err(_) => return Ok(None),
        }
        self.forget_dead_marker(&hashed(&letter.message.key))
            .await?;
        Ok(Some(letter))
    }

    pub(super) async fn replay_letter(&self, id: &EntryId) -> Result<bool, QueueError> {
        let Ok(seq) = id.as_str().parse::<u64>() else {
            return Ok(false);
        };
        let m = match self.inner.dead.get_raw_message(seq).await {
            Ok(m) => m,
            Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => return Ok(false),
            Err(e) => return Err(err(e)),
        };
        let marker = header_text(Some(&m.headers), H_MARKER);
        let h = Self::entry_headers(&marker, now_ms(), 0);
        self.publish(
            &self.inner.subject,
            &format!("r-{seq}"),
            h,
            m.payload.to_vec(),
        )
        .await?;
        if let Some(message) = Message::decode(&m.payload) {
            self.mark_replayed(&marker, &message).await?;
        }
        match self.inner.dead.delete_message(seq).await {
            Ok(deleted) => Ok(deleted),
            // Deleted meanwhile by another replay (whose publish carried
            // the same id: one entry).
            Err(_) => Ok(false),
        }
    }

    pub(super) async fn replay_every(&self) -> Result<usize, QueueError> {
        let mut n = 0;
        loop {
            let batch = self.list_dead(256).await?;
            if batch.is_empty() {
                return Ok(n);
            }
            for letter in batch {
                n += usize::from(self.replay_letter(&letter.id).await?);
            }
        }
    }
}

/// A message of the dead-letter stream as a dead letter.
fn letter_of(m: &async_nats::jetstream::message::StreamMessage) -> DeadLetter {
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
