//! [`JetStreamQueue`]: the queue on a NATS JetStream server the user runs.

mod connection;
mod dead;
mod lease;
mod markers;
mod pace;

pub use connection::JetStreamQueueBuilder;

use super::attempts::History;
use super::{
    DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError, QueueStats, Reseal,
    SharedPacing,
};
use async_nats::jetstream::{self, consumer, kv, stream, AckKind};
use async_nats::{HeaderMap, HeaderValue};
use futures_util::StreamExt;
use markers::{hashed, DELIVERED};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Headers of an entry.
const H_MARKER: &str = "Idem-Marker";
const H_ENQUEUED: &str = "Idem-Enqueued";
/// Attempts made before this message was published (a postponed entry).
const H_BASE: &str = "Idem-Attempts";
/// Not due before (ms): a postponed entry's first delivery is put back.
const H_DUE: &str = "Idem-Due";
/// The failed attempts (see `attempts::History`: one line of printable
/// ASCII, at most about 50 KiB), carried by each copy a retry publishes.
const H_HISTORY: &str = "Idem-Attempt-History";
/// Headers of a dead letter.
const H_ERROR: &str = "Idem-Error";
const H_DEAD_AT: &str = "Idem-Dead-At";

/// A queue on a NATS JetStream server, shared by every gateway that names
/// it.
///
/// ```no_run
/// use tower_idempotency_queue::{JetStreamQueue, Queue};
/// # async fn f() -> Result<(), tower_idempotency_queue::QueueError> {
/// let queue = JetStreamQueue::connect("nats://127.0.0.1:4222", "gateway").await?;
/// println!("{:?}", queue.stats().await?);
/// # Ok(()) }
/// ```
///
/// # What is where
///
/// For a queue named `gw` (any name; characters other than letters, digits,
/// `-` and `_` become `_`):
///
/// - the stream `IDEM_gw` (subject `idem.gw.q`, work-queue retention, file
///   storage) holds the entries: one message per queued notification,
///   published with a `Nats-Msg-Id` and answered by the server's PubAck
///   only once the message is stored (and replicated to a quorum of the
///   stream's replicas);
/// - the durable pull consumer `workers` on it (explicit ack) is shared by
///   every gateway on the queue: each message is handed to one of them at a
///   time, its ack wait renewed (`+WPI`) while the delivery runs; a failed
///   delivery is published again with its failed attempts in a header
///   (`Idem-Attempt-History`), due after the backoff, and acknowledged; one
///   that failed `max_attempts` times is copied to the dead letters and
///   `term`inated;
/// - the stream `IDEM_gw_DEAD` (subject `idem.gw.dead`) holds the dead
///   letters, with their attempts, last error and failed attempts in
///   headers;
///   [`replay`](Queue::replay) publishes one back into the queue and then
///   deletes it from the dead letters;
///   [`replay`](Queue::replay) and [`delete_dead`](Queue::delete_dead)
///   first claim the letter with a create-only write to the `KEYS`
///   bucket (`dead-SEQ-TIME`), so that a letter is replayed or deleted,
///   never both: whichever claims it first has it, the other finds no such
///   letter;
/// - the key-value bucket `IDEM_gw_KEYS` holds one marker per key (a hash
///   of it): its fingerprint and whether its entry is being queued, queued,
///   dead-lettered or delivered. Markers expire one window after their last
///   change;
/// - the bucket `IDEM_gw_PACE` holds the delivery slots and turns that pace
///   a lane across every gateway on the queue.
///
/// # Why no acknowledged notification is lost or doubled
///
/// Deduplication is decided by the marker, not by JetStream's duplicate
/// window. The first copy of a key creates the marker (a compare-and-set:
/// one copy wins however many race) as *being queued*, with a fresh message
/// id, then publishes the entry with that id and waits for the PubAck, then
/// marks it *queued*. [`ingest`](Queue::ingest) returns `Queued` only after
/// the PubAck, so the success reply is sent only for a stored entry.
///
/// A copy that finds the marker *queued*, *dead-lettered* or *delivered* is
/// a duplicate of a stored entry. One that finds it *being queued* (the
/// first copy still publishing, or it failed, or its process died between
/// the PubAck and the marker) publishes its own copy **under the marker's
/// message id** and waits for the PubAck itself: it is acknowledged only
/// once an entry is stored, whoever stored it. The two publishes carry one
/// message id, so within the stream's duplicate window (two minutes) the
/// server stores one of them. Only when a process died between the PubAck
/// and the marker and no copy came for longer than that window can a second
/// entry of the key be stored; the consumer in front of the handler (which
/// every worker has) then runs it once. A publish that failed leaves the
/// marker *being queued*, never *queued*: the sender got a failure reply
/// and retries, and its retry publishes again.
///
/// Settling an entry writes its marker first (delivered, dead-lettered),
/// then acknowledges or terminates the message: a crash between the two
/// redelivers the entry, and the consumer finds its key done. A dead letter
/// and a replay are published before the message they replace is
/// terminated or deleted, each under a message id derived from the
/// original's sequence, so a repeated move is one message. A replay is
/// counted once: only the call that deleted the dead letter returns `true`.
/// A replay or a delete that was cut short (a failed publish, a process that
/// died) keeps its claim and leaves the letter: the next call of the same
/// kind finishes it, and a call of the other kind finds no such letter.
/// A replay marks its key queued with a compare-and-set over the
/// dead-lettered marker only: a worker that delivered the replayed entry
/// first (and marked the key delivered) is never written over.
///
/// What can be lost is what the server loses: run JetStream with file
/// storage (the default here) and, in a cluster, streams of 3 replicas
/// ([`JetStreamQueueBuilder::replicas`]), so that a PubAck means a quorum
/// holds the entry. A server writes each message to its files before its
/// PubAck, so a killed server process loses nothing; it syncs them to the
/// disk only periodically (every two minutes by default), so a single
/// server's power cut can lose the last writes (later server versions take
/// `sync_interval: always` in their `jetstream` block for a sync per write).
///
/// # Limits
///
/// - Give every gateway of a queue the same [lease](super::Worker::lease):
///   the consumer's ack wait is one setting on the server, set by the queue's
///   [`lease`](JetStreamQueueBuilder::lease) (30 s by default) when it is created or
///   opened.
/// - JetStream accepts a late settlement (`ack`, `nak`, `term`, `+WPI`) of
///   a message it already handed to another worker, without saying so. The
///   queue therefore keeps each lease's deadline by its own clock: the ack
///   wait from before the fetch (or the last renewal), less a tenth for the
///   way to the server. Past it, [`ack`](Queue::ack), [`retry`](Queue::retry),
///   [`postpone`](Queue::postpone), [`dead_letter`](Queue::dead_letter) and
///   [`renew`](Queue::renew) send nothing and return `false` (the lease was
///   lost), even when the server had not handed the message out yet: it
///   is then delivered again, and the consumer in front of the handler finds
///   its key done.
/// - A key's marker lives one [window](JetStreamQueueBuilder::window) after
///   its last change: an entry still queued or dead-lettered longer than
///   that no longer holds its later copies off (a copy is then queued
///   again; the consumer in front of the handler still runs the key once).
/// - Order groups ([`Message::order`]) are not enforced (as on Redis
///   Streams): use the embedded queue where events of one transaction must
///   be delivered in order.
/// - Pacing across gateways ([`take_slot`](SharedPacing::take_slot),
///   [`take_turn`](SharedPacing::take_turn)) keeps its leases and turns in the
///   `PACE` bucket with compare-and-set writes, timed by each gateway's
///   clock: the gateways' clocks must agree to well within a lease (NTP).
#[derive(Clone)]
pub struct JetStreamQueue {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    name: String,
    subject: String,
    dead_subject: String,
    queue: stream::Stream,
    dead: stream::Stream,
    consumer: consumer::PullConsumer,
    keys: kv::Store,
    pace: kv::Store,
    /// What a delivery's lease number stands for: the reply subject its
    /// settlement goes to, and its stream sequence.
    held: Mutex<HashMap<u64, Held>>,
    next_lease: AtomicU64,
    /// The consumer's ack wait: how long the server lets a delivery go
    /// unrenewed before it hands the message to another worker.
    ack_wait: Duration,
}

#[derive(Clone)]
struct Held {
    reply: String,
    sequence: u64,
    /// Until when the lease surely holds by this process's clock: from a
    /// time before the server started (or renewed) its ack wait, less a
    /// tenth of it for the settlement's way to the server.
    until: Instant,
}

impl fmt::Debug for JetStreamQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamQueue")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

crate::common::backend_errors!("jetstream queue");

/// A NATS error met doing `what`, kept as the source.
fn err_in(
    what: impl fmt::Display,
    e: impl std::error::Error + Send + Sync + 'static,
) -> QueueError {
    QueueError::backend(format_args!("jetstream queue: {what}"), e)
}

/// A NATS error the client hands out boxed, kept as the source.
fn err_boxed(e: Box<dyn std::error::Error + Send + Sync + 'static>) -> QueueError {
    QueueError::backend_boxed("jetstream queue", e)
}

use crate::common::{ms_of, now_ms, time_of};

fn unique() -> String {
    format!(
        "{:032x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    )
}

fn header_u64(headers: Option<&HeaderMap>, name: &str) -> Option<u64> {
    headers?.get(name)?.as_str().parse().ok()
}

fn header_text(headers: Option<&HeaderMap>, name: &str) -> String {
    headers
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default()
}

/// A header value without line breaks (the protocol is line-based).
fn one_line(text: &str) -> String {
    let t: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    t.chars().take(1024).collect()
}

impl JetStreamQueue {
    /// Publishes an entry and waits for the server's PubAck.
    async fn publish(
        &self,
        subject: &str,
        id: &str,
        headers: HeaderMap,
        payload: Vec<u8>,
    ) -> Result<jetstream::publish::PublishAck, QueueError> {
        let publish = jetstream::message::PublishMessage::build()
            .payload(payload.into())
            .headers(headers)
            .message_id(id);
        self.inner
            .js
            .send_publish(subject.to_owned(), publish)
            .await
            .map_err(err)?
            .await
            .map_err(err)
    }

    fn entry_headers(marker: &str, enqueued: u64, base: u32) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(H_MARKER, marker);
        h.insert(H_ENQUEUED, HeaderValue::from(enqueued));
        if base > 0 {
            h.insert(H_BASE, HeaderValue::from(u64::from(base)));
        }
        h
    }
}

impl Queue for JetStreamQueue {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        self.ingest_keyed(message).await
    }

    async fn fetch(&self, max: usize, _lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        // The server starts each message's ack wait after this request.
        let asked = Instant::now();
        let mut batch = self
            .inner
            .consumer
            .fetch()
            .max_messages(max.max(1))
            .messages()
            .await
            .map_err(err)?;
        let mut out = Vec::new();
        let now = now_ms();
        while let Some(m) = batch.next().await {
            let m = m.map_err(err_boxed)?;
            let Some(reply) = m.reply.as_ref().map(|r| r.to_string()) else {
                continue;
            };
            let (sequence, delivered, published) = match m.info() {
                Ok(i) => (
                    i.stream_sequence,
                    u32::try_from(i.delivered.max(1)).unwrap_or(u32::MAX),
                    (i.published.unix_timestamp_nanos() / 1_000_000).max(0) as u64,
                ),
                Err(e) => return Err(err_boxed(e)),
            };
            let headers = m.headers.as_ref();
            // A count past what fits is the last attempt, not a wrapped one.
            let base =
                header_u64(headers, H_BASE).map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
            let enqueued = header_u64(headers, H_ENQUEUED).unwrap_or(published);
            let mut attempt = base.saturating_add(delivered);
            if let Some(due) = header_u64(headers, H_DUE) {
                // A postponed entry: its first delivery only puts it back
                // until it is due, and does not count.
                attempt = attempt.saturating_sub(1).max(base.saturating_add(1));
                if due > now && delivered == 1 {
                    self.settle_reply(&reply, AckKind::Nak(Some(Duration::from_millis(due - now))))
                        .await?;
                    continue;
                }
            }
            let Some(message) = Message::decode(&m.payload) else {
                let why = "undecodable entry: not a message this version can read";
                crate::log_warn!(entry = sequence, "{why}; dead-lettered");
                let marker = header_text(headers, H_MARKER);
                let history = header_text(headers, H_HISTORY);
                self.bury(
                    &reply,
                    sequence,
                    &marker,
                    m.payload.to_vec(),
                    attempt,
                    enqueued,
                    why,
                    Some(&history),
                )
                .await?;
                continue;
            };
            let lease = self.inner.next_lease.fetch_add(1, Ordering::Relaxed);
            self.inner
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    lease,
                    Held {
                        reply,
                        sequence,
                        until: self.lease_until(asked),
                    },
                );
            out.push(Delivery {
                id: EntryId::new(sequence.to_string()),
                message,
                attempt,
                enqueued_at: time_of(enqueued),
                lease,
                history: Some(header_text(headers, H_HISTORY).into())
                    .filter(|h: &Arc<str>| !h.is_empty()),
            });
        }
        Ok(out)
    }

    async fn renew(&self, delivery: &Delivery, _lease: Duration) -> Result<bool, QueueError> {
        self.settle(delivery, AckKind::Progress, false).await
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        if self.held(delivery).is_none() {
            return Ok(false);
        }
        self.mark(&hashed(&delivery.message.key), DELIVERED, &delivery.message)
            .await?;
        self.settle(delivery, AckKind::Ack, true).await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        // A copy with this attempt recorded (a nak would keep the
        // message's headers as they are), as a postponed entry is put back.
        let history = History::record(
            delivery.history.as_deref(),
            delivery.attempt,
            SystemTime::now(),
            error,
        );
        self.requeue(delivery, after, delivery.attempt, Some(&history))
            .await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        _error: &str,
    ) -> Result<bool, QueueError> {
        let history = delivery.history.as_deref();
        self.requeue(delivery, after, delivery.attempt.saturating_sub(1), history)
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        self.bury_delivery(delivery, error).await
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        self.list_dead(limit).await
    }

    async fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let Some(start) = self.dead_start(after) else {
            return Ok(Vec::new());
        };
        self.list_dead_from(start, limit).await
    }

    async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        self.find_letter(id).await
    }

    async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        self.delete_letter(id).await
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        self.replay_letter(id, &|_| None).await
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        crate::seal::replay_each(self, &|_| None).await
    }

    async fn replay_with(&self, id: &EntryId, reseal: &Reseal) -> Result<bool, QueueError> {
        self.replay_letter(id, reseal).await
    }

    async fn replay_all_with(&self, reseal: &Reseal) -> Result<usize, QueueError> {
        crate::seal::replay_each(self, reseal).await
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let queue = self.inner.queue.get_info().await.map_err(err)?;
        let dead = self.inner.dead.get_info().await.map_err(err)?;
        let first = (queue.state.first_timestamp.unix_timestamp_nanos() / 1_000_000).max(0);
        let oldest = (queue.state.messages > 0).then_some(first as u64);
        Ok(super::stats::counted(
            queue.state.messages,
            dead.state.messages,
            oldest,
        ))
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
        self.forget_key(key).await
    }
}

/// Slots and turns live in the `PACE` bucket; no breaker is shared (each
/// worker's own judges alone).
impl SharedPacing for JetStreamQueue {
    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        self.take_pace_slot(lane, limit, lease).await
    }

    async fn renew_slot(&self, lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
        self.renew_pace_slot(lane, slot, lease).await
    }

    async fn give_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        self.give_pace_slot(lane, slot).await
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        self.take_pace_turn(lane, interval).await
    }

    crate::worker::shared::no_shared_breaker!();
}

#[cfg(test)]
mod tests {
    use super::connection::{sanitize, unescape};
    use super::markers::{hashed, Marker, QUEUED};
    use super::pace::{decode_slots, encode_slots};

    #[test]
    fn names_and_credentials() {
        assert_eq!(sanitize("gate.way *>"), "gate_way___");
        assert_eq!(sanitize(""), "default");
        assert_eq!(unescape("p%40ss%3Aw%zz%4"), "p@ss:w%zz%4");
        assert_eq!(hashed("wx:1").len(), 40);
        let m = Marker::decode(&Marker::encode(QUEUED, [7; 16], "id-1")).unwrap();
        assert_eq!(
            (m.state, m.fingerprint, m.id.as_str()),
            (QUEUED, [7; 16], "id-1")
        );
        assert!(Marker::decode(b"short").is_none());
        let slots = [(1, 2), (u64::MAX, 9)];
        assert_eq!(decode_slots(&encode_slots(&slots)), slots);
    }
}
