//! Dead letters: the dead-letter exchange and its queue, reading them
//! without taking them, and replay moving them back into the queue.

use super::super::attempts::{dead_letter, History};
use super::super::{DeadLetter, Delivery, EntryId, Message, QueueError, Reseal};
use super::connection::string;
use super::entry::{
    header_text, header_u64, Envelope, ATTEMPTS_HEADER, DEAD_AT_HEADER, HISTORY_HEADER,
    LAST_ERROR_HEADER,
};
use super::records::{DEAD, QUEUED};
use super::{fresh_id, ms_of, now_ms, AmqpQueue};
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Channel;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower_idempotency::store::Store;

/// Dead letters taken (unacknowledged) on a channel of their own.
pub(super) struct Peeked {
    ch: Channel,
    taken: Vec<lapin::message::Delivery>,
    /// The connection the channel is on.
    generation: u64,
}

impl<S: Store> AmqpQueue<S> {
    pub(super) fn dlx(&self) -> String {
        format!("{}.dlx", self.inner.name)
    }

    pub(super) fn dead_queue(&self) -> String {
        format!("{}.dead", self.inner.name)
    }

    /// Takes up to `max` dead letters on a channel of their own, unacked
    /// (closing the channel gives back those not acknowledged).
    pub(super) async fn peek_dead(&self, max: usize) -> Result<Peeked, QueueError> {
        let link = self.link().await?;
        let generation = link.generation;
        let ch = self
            .bounded(generation, "a new channel", link.conn.create_channel())
            .await?;
        let mut taken = Vec::new();
        while taken.len() < max {
            let get = ch.basic_get(string(self.dead_queue()), BasicGetOptions::default());
            match self.bounded(generation, "a get", get).await? {
                Some(m) => taken.push(m.delivery),
                None => break,
            }
        }
        Ok(Peeked {
            ch,
            taken,
            generation,
        })
    }

    pub(super) fn dead_letter_of(d: &lapin::message::Delivery) -> DeadLetter {
        let p = &d.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
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

    /// Moves the dead letters `pick` chooses back into the queue (each
    /// message as `reseal` makes it); how many.
    pub(super) async fn replay_where(
        &self,
        pick: impl Fn(&DeadLetter) -> bool,
        reseal: &Reseal,
    ) -> Result<usize, QueueError> {
        let peeked = self.peek_dead(usize::MAX).await?;
        let mut n = 0;
        let result = async {
            for d in &peeked.taken {
                let letter = Self::dead_letter_of(d);
                if !pick(&letter) {
                    continue;
                }
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
                self.publish("", &self.inner.name, message, env).await?;
                self.settled(peeked.generation, d.acker.ack(BasicAckOptions::default()))
                    .await?;
                self.set_state(&letter.message.key, letter.message.fingerprint, QUEUED)
                    .await;
                n += 1;
            }
            Ok::<_, QueueError>(())
        }
        .await;
        // The others go back to the dead letters.
        self.give_back(&peeked).await;
        result.map(|()| n)
    }

    /// Hands the dead letters a peek took back to the dead queue, and
    /// returns once they are counted there again. Closing the channel
    /// alone requeues them too, but the broker does it on its own time: a
    /// count read on another channel right after could miss them. A nack
    /// and then a passive declare on the same channel reach the queue in
    /// that order, so once the declare is answered they are back.
    pub(super) async fn give_back(&self, peeked: &Peeked) {
        let Peeked {
            ch,
            taken,
            generation,
        } = peeked;
        for d in taken {
            if d.acker.usable() {
                self.give_back_one(*generation, &d.acker).await;
            }
        }
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = ch.queue_declare(string(self.dead_queue()), passive, FieldTable::default());
        let _ = self.bounded(*generation, "a declare", declared).await;
        let closing = ch.close(200, "done".into());
        let _ = self
            .bounded(*generation, "a channel's close", closing)
            .await;
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
        if let Err(e) = self.publish(&self.dlx(), &self.inner.name, m, env).await {
            self.give_back_one(held.generation, &held.acker).await;
            return Err(e);
        }
        self.settled(held.generation, held.acker.ack(BasicAckOptions::default()))
            .await?;
        Ok(true)
    }

    pub(super) async fn dead_letters_now(
        &self,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let peeked = self.peek_dead(usize::MAX).await?;
        self.give_back(&peeked).await;
        let mut letters: Vec<DeadLetter> = peeked.taken.iter().map(Self::dead_letter_of).collect();
        letters.sort_by_key(|d| d.dead_at);
        letters.truncate(limit);
        Ok(letters)
    }

    /// A page of dead letters by id, after `after`.
    pub(super) async fn dead_page_now(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let peeked = self.peek_dead(usize::MAX).await?;
        self.give_back(&peeked).await;
        let mut letters: Vec<DeadLetter> = (peeked.taken.iter().map(Self::dead_letter_of))
            .filter(|d| after.is_none_or(|a| d.id > *a))
            .collect();
        letters.sort_by(|a, b| a.id.cmp(&b.id));
        letters.truncate(limit);
        Ok(letters)
    }

    /// Takes the dead letter `id` out of the dead queue for good and
    /// forgets its key's record (while it still says dead-lettered), so
    /// that a later copy is queued again.
    pub(super) async fn delete_dead_now(
        &self,
        id: &EntryId,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let peeked = self.peek_dead(usize::MAX).await?;
        let result = async {
            let Some(d) = peeked
                .taken
                .iter()
                .find(|d| &Self::dead_letter_of(d).id == id)
            else {
                return Ok(None);
            };
            let letter = Self::dead_letter_of(d);
            self.settled(peeked.generation, d.acker.ack(BasicAckOptions::default()))
                .await?;
            self.forget_dead_record(&letter.message.key).await?;
            Ok(Some(letter))
        }
        .await;
        self.give_back(&peeked).await;
        result
    }
}
