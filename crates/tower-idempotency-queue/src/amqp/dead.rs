//! Dead letters: the dead-letter exchange, burying an entry in the
//! dead-letter log, listing the letters, and a replay or a delete of one,
//! each claimed once.

use super::super::attempts::{dead_letter, History};
use super::super::{DeadLetter, Delivery, EntryId, Message, QueueError, QueueErrorKind, Reseal};
use super::connection::EXCHANGE_LIMIT;
use super::entry::{
    header_text, header_u64, Envelope, ATTEMPTS_HEADER, DEAD_AT_HEADER, HISTORY_HEADER,
    LAST_ERROR_HEADER,
};
use super::records::{DEAD, QUEUED};
use super::{err, fail, fresh_id, ms_of, now_ms, AmqpQueue};
use lapin::options::BasicAckOptions;
use lapin::types::FieldTable;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower_idempotency::store::{Claim, OwnerToken, Store};
use tower_idempotency::Fingerprint;

/// How long a replay or a delete holds its claim on a letter while it
/// works (one that dies meanwhile leaves the letter to the next after
/// that).
const SETTLE_LEASE: Duration = Duration::from_secs(60);

/// What a claim on a letter is for.
#[derive(Clone, Copy)]
enum Settle {
    Replay,
    Delete,
}

/// The dead letter at `offset` of the log, as the broker delivered it.
pub(super) fn letter_at(offset: u64, d: &lapin::message::Delivery) -> DeadLetter {
    let p = &d.properties;
    let id = offset.to_string();
    let history = header_text(p, HISTORY_HEADER);
    dead_letter(
        EntryId::new(&*id),
        Message::decode(&d.data).unwrap_or_else(|| Message::undecodable(&id, &d.data)),
        header_u64(p, ATTEMPTS_HEADER).map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        header_text(p, LAST_ERROR_HEADER),
        UNIX_EPOCH + Duration::from_millis(header_u64(p, DEAD_AT_HEADER).unwrap_or(0)),
        Some(&history),
    )
}

/// The offset a letter's id names, if it names one.
fn offset_of(id: &EntryId) -> Option<u64> {
    id.as_str().parse().ok()
}

impl<S: Store> AmqpQueue<S> {
    pub(super) fn dlx(&self) -> String {
        format!("{}.dlx", self.inner.name)
    }

    pub(super) async fn dead_letter_now(
        &self,
        delivery: &Delivery,
        error: &str,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        let m = &delivery.message;
        let history = History::record(
            delivery.history.as_deref(),
            delivery.attempt,
            SystemTime::now(),
            error,
        );
        // The record first: a copy arriving once the entry is dead must
        // find it dead (a duplicate), not queued.
        self.set_state(&m.key, m.fingerprint, DEAD).await;
        let env = Envelope {
            id: delivery.id.to_string(),
            attempts: delivery.attempt,
            error: Some(error),
            enqueued_ms: ms_of(held.enqueued),
            dead_at: Some(now_ms()),
            history: Some(&history),
        };
        // Read back before the call returns (when the log's reader runs):
        // what this instance lists and counts next has the letter.
        let reading = self.follow_dead_log().await.is_ok();
        let awaited = self.awaited();
        let mut headers = FieldTable::default();
        Self::token_header(&mut headers, &awaited);
        let published = self
            .publish_with(&self.dlx(), &self.inner.name, m, env, headers)
            .await;
        if let Err(e) = published {
            let _ = self.read_back(awaited, Duration::ZERO).await;
            self.give_back_one(held.generation, &held.acker).await;
            return Err(e);
        }
        let acked =
            (self.settled(held.generation, held.acker.ack(BasicAckOptions::default()))).await;
        let limit = if reading && acked.is_ok() {
            EXCHANGE_LIMIT
        } else {
            Duration::ZERO
        };
        // Buried whatever the reader does: it reads the letter later.
        let _ = self.read_back(awaited, limit).await;
        acked.map(|()| true)
    }

    pub(super) async fn dead_letters_now(
        &self,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        self.catch_up().await?;
        Ok(self.indexed_after(None, limit))
    }

    /// A page of dead letters by id (the letter's offset in the log: the
    /// order they died), after `after`.
    pub(super) async fn dead_page_now(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let after = match after {
            None => None,
            Some(a) => Some(offset_of(a).ok_or_else(|| {
                fail(
                    QueueErrorKind::Invalid,
                    "not a dead letter id of this queue",
                )
            })?),
        };
        self.catch_up().await?;
        Ok(self.indexed_after(after, limit))
    }

    pub(super) async fn find_dead_now(
        &self,
        id: &EntryId,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let Some(offset) = offset_of(id) else {
            return Ok(None);
        };
        self.catch_up().await?;
        Ok(self.indexed(offset))
    }

    /// Deletes the dead letter `id` for good and forgets its key's record
    /// (while it still says dead-lettered), so that a later copy is queued
    /// again. `None` when there is no such letter, or a replay has it.
    pub(super) async fn delete_dead_now(
        &self,
        id: &EntryId,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let Some(offset) = offset_of(id) else {
            return Ok(None);
        };
        self.catch_up().await?;
        let Some((letter, claim)) = self.claim_letter(offset, Settle::Delete).await? else {
            return Ok(None);
        };
        let done = async {
            self.settle_letter(offset).await?;
            self.forget_dead_record(&letter.message.key).await
        }
        .await;
        self.claim_done(claim, done.is_ok()).await;
        done.map(|()| Some(letter))
    }

    /// Replays the dead letter `id` as `reseal` makes it: `false` when
    /// there is no such letter, or another call has it.
    pub(super) async fn replay_one(
        &self,
        id: &EntryId,
        reseal: &Reseal,
    ) -> Result<bool, QueueError> {
        let Some(offset) = offset_of(id) else {
            return Ok(false);
        };
        self.catch_up().await?;
        self.replay_letter(offset, reseal).await
    }

    /// Replays every dead letter there was when it was called (on any
    /// instance), each as `reseal` makes it; how many. A letter that dies
    /// again meanwhile (a new letter) waits for the next call.
    pub(super) async fn replay_every(&self, reseal: &Reseal) -> Result<usize, QueueError> {
        self.catch_up().await?;
        let end = self.read_up_to();
        let (mut n, mut after) = (0, None);
        loop {
            // A page at a time: the index is not held over a publish.
            let page: Vec<u64> = (self.indexed_after(after, 100).iter())
                .filter_map(|l| offset_of(&l.id))
                .filter(|o| *o < end)
                .collect();
            let Some(&last) = page.last() else {
                return Ok(n);
            };
            after = Some(last);
            for offset in page {
                n += usize::from(self.replay_letter(offset, reseal).await?);
            }
        }
    }

    /// Moves the letter at `offset` back into the queue, once.
    async fn replay_letter(&self, offset: u64, reseal: &Reseal) -> Result<bool, QueueError> {
        let Some((letter, claim)) = self.claim_letter(offset, Settle::Replay).await? else {
            return Ok(false);
        };
        let done = async {
            let env = Envelope {
                id: fresh_id(),
                attempts: 0,
                error: None,
                enqueued_ms: now_ms(),
                dead_at: None,
                history: None,
            };
            let message = reseal(&letter.message);
            let message = message.as_ref().unwrap_or(&letter.message);
            // Queued before it is settled: cut short between the two, the
            // letter stays and the next replay queues it again (a duplicate
            // the consumer runs once), never lost.
            self.publish("", &self.inner.name, message, env).await?;
            self.settle_letter(offset).await?;
            self.set_state(&letter.message.key, letter.message.fingerprint, QUEUED)
                .await;
            Ok::<_, QueueError>(())
        }
        .await;
        self.claim_done(claim, done.is_ok()).await;
        done.map(|()| true)
    }

    /// Claims the letter at `offset` for a replay or a delete, in one
    /// atomic claim in the store: of a replay and a delete (or two
    /// replays) at once, on any instances, one has it and the others are
    /// refused (`None`). Also `None` when the letter is not in the index
    /// (never there, or settled).
    async fn claim_letter(
        &self,
        offset: u64,
        what: Settle,
    ) -> Result<Option<(DeadLetter, (String, OwnerToken))>, QueueError> {
        let Some(letter) = self.indexed(offset) else {
            return Ok(None);
        };
        // When it died too: the offsets of a log made again start over.
        // Beside the key records (`amqp:NAME:KEY`), never one of them.
        let key = format!(
            "amqp-dead:{}:{offset}:{}",
            self.inner.name,
            ms_of(letter.dead_at)
        );
        let token = OwnerToken::new();
        let fp = Fingerprint::of(match what {
            Settle::Replay => b"replay".as_slice(),
            Settle::Delete => b"delete".as_slice(),
        });
        let store = &self.inner.store;
        match store
            .claim(&key, fp, token, SETTLE_LEASE)
            .await
            .map_err(err)?
        {
            Claim::Acquired(_) => {}
            _ => return Ok(None),
        }
        // Settled meanwhile (read by this instance's reader) by a call
        // whose claim has run out since.
        let Some(letter) = self.indexed(offset) else {
            let _ = store.release(&key, token).await;
            return Ok(None);
        };
        Ok(Some((letter, (key, token))))
    }

    /// Ends a claim from [`claim_letter`](Self::claim_letter): kept for
    /// the window once the letter is settled (a late call is refused by
    /// it as by the log), given back when it failed (the next call tries
    /// again).
    async fn claim_done(&self, (key, token): (String, OwnerToken), settled: bool) {
        let store = &self.inner.store;
        if settled {
            let record = Self::record(Fingerprint::of(b"settled"), DEAD);
            let _ = store.complete(&key, token, record, self.inner.window).await;
        } else {
            let _ = store.release(&key, token).await;
        }
    }
}
