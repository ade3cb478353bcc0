//! [`AmqpQueue`]: the acknowledge-then-deliver queue on the RabbitMQ a team
//! already runs.
//!
//! By idea: `connection` (the link to the broker, the queues it declares,
//! publishing with confirms), `entry` (what an entry carries besides its
//! message), `feed` (the consumer entries are pushed to), `records` (the
//! key records that say "already queued"), `delay` (retries waiting out
//! their backoff), `dead` (dead letters, replay and delete), `dead_log`
//! (the stream of dead letters and the index read from it), `upgrade` (the
//! dead letters of an earlier version), `pace` (pacing across gateways),
//! `stats` (what the broker counts).

mod connection;
mod dead;
mod dead_log;
mod delay;
mod entry;
mod feed;
mod pace;
mod records;
mod stats;
mod upgrade;

use self::entry::{
    header_text, header_u64, Envelope, ATTEMPTS_HEADER, ENQUEUED_HEADER, HISTORY_HEADER,
};
use self::records::DELIVERED;
use super::attempts::History;
use super::{
    DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError, QueueStats, Reseal,
    SharedPacing,
};
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tower_idempotency::store::{OwnerToken, Store};

crate::common::backend_errors!("amqp queue");

use crate::common::{ms_of, now_ms, time_of};

/// A delivery this instance holds unacknowledged.
struct Held {
    acker: lapin::Acker,
    generation: u64,
    deadline: Instant,
    enqueued: SystemTime,
}

struct Inner<S> {
    uri: String,
    name: String,
    store: S,
    window: Duration,
    /// The connection handed out, while it is usable.
    live: Mutex<Option<connection::Link>>,
    /// Taken by whoever connects.
    link: tokio::sync::Mutex<connection::Slot>,
    /// The newest connection (its generation) found broken: it is not
    /// handed out again.
    stalled: AtomicU64,
    generations: AtomicU64,
    held: Mutex<HashMap<u64, Held>>,
    next_lease: AtomicU64,
    /// Slot id → (record key, owner).
    slots: Mutex<HashMap<u64, (String, OwnerToken)>>,
    /// Per lane: where the next look at its shared slots starts, and until
    /// when they are known all taken.
    slot_scans: Mutex<HashMap<String, pace::SlotScan>>,
    /// Entries this instance put in a delay queue: id → when due. The
    /// broker moves an entry back into the queue once due, and counts it in
    /// neither while it moves: `stats` counts it meanwhile (until it is
    /// fetched again, or for `delay::IN_TRANSIT` past its due time).
    backing_off: Mutex<HashMap<String, Instant>>,
    /// The consumer entries are pushed to.
    feed: tokio::sync::Mutex<Option<feed::Feed>>,
    /// The dead letters not settled, read from the dead-letter log.
    dead_log: dead_log::DeadLog,
}

/// A queue on RabbitMQ: quorum queues, persistent messages, publisher
/// confirms, dead letters through a dead-letter exchange; "already queued"
/// kept in an idempotency [`Store`].
///
/// # On the broker
///
/// For a queue named `NAME` (one per gateway route group), declared on
/// every connect (declaring again is harmless):
///
/// - `NAME`: a durable **quorum** queue (replicated by Raft over the
///   cluster's nodes) holding the entries due now. Its dead-letter exchange
///   is `NAME.dlx`, so whatever the broker itself dead-letters (a delivery
///   limit set by policy, say) lands in the dead letters, never dropped.
/// - `NAME.delay.MS` for `MS` = 16, 32, …, 2²⁰ milliseconds: quorum queues
///   whose messages wait out a retry's backoff (`x-message-ttl`) and are
///   dead-lettered back into `NAME` at-least-once. A backoff is rounded up
///   to the next of these (never due earlier than asked).
/// - `NAME.dlx`, a durable direct exchange, and `NAME.dead-log`, the
///   **stream** of dead letters bound to it.
///
/// # Dead letters
///
/// A dead letter, and each replay or delete of one, is a record appended
/// to the stream `NAME.dead-log` (RabbitMQ 3.9 or later, no plugin: an
/// append-only log read by offset with `basic.consume`); a letter's id is
/// its offset. Each instance reads the stream once, then follows it, and
/// keeps the letters not replayed or deleted in memory (bodies included):
/// a page ([`dead_page`](Queue::dead_page)), a letter shown, replayed or
/// deleted costs one small mark written and read back (the call then sees
/// every record any instance appended before it began) and what it
/// returns, never every letter, and calls at once never hide a letter from
/// each other. A queue read by taking its messages (as a quorum queue is)
/// could offer neither; a stream keeps the letters durable and replicated
/// as the quorum queues do. A replay or a delete first claims the letter in
/// the [`Store`] (one atomic claim, kept for the window): of a replay and a
/// delete, or two replays, at once on any instances, one has it. A replay
/// queues the entry before it records the replay, so one cut short
/// between the two leaves the letter for the next replay (a duplicate in
/// the broker at worst, never a lost letter). Set no retention on the
/// stream: it would drop letters still dead. Letters an earlier version
/// kept in the quorum queue `NAME.dead` are moved into the stream when the
/// queue is opened, each once.
///
/// Every message is persistent (delivery mode 2) and published with
/// **publisher confirms**: a write has happened only once the broker
/// confirmed it (for a quorum queue: once a majority of its replicas wrote
/// it to disk). The attempts made and the last error travel in the headers
/// `x-attempts` and `x-last-error`, the key in `x-idempotency-key`, the time
/// it was first queued in `x-enqueued-ms`; the body is the queued message.
///
/// # Who says "already queued"
///
/// The broker is not asked to deduplicate (RabbitMQ has no atomic "publish
/// unless a message with this key was seen" across a window). The key
/// record lives in an idempotency [`Store`], the one the gateway already
/// keeps its records in, under `amqp:NAME:KEY`. Writes happen in an order
/// that can neither lose nor double an acknowledged notification:
///
/// 1. the key is **claimed** in the store (atomic: of 7 copies arriving at
///    once, one owns the key; the others wait for its outcome);
/// 2. the owner **publishes** and waits for the broker's confirm;
/// 3. only then the claim is **completed** ("queued", with the
///    fingerprint). A copy answers `Duplicate` only from a completed
///    record, so a duplicate's success reply is never given for an entry the
///    broker did not confirm.
///
/// A publish that fails releases the claim: nothing was acknowledged, and
/// the sender's retry publishes again. A gateway killed between the confirm
/// and the completion leaves a claim that runs out after its lease (10 s);
/// the next copy then publishes a second entry of the same key. That is a
/// duplicate *in the broker*, never a lost notification, and the delivery
/// side runs the handler once: put a
/// [`ConsumerLayer`](tower_idempotency::consumer::ConsumerLayer) or the gateway's dedup
/// layer in front of it, as for every queue (an entry is redelivered
/// whenever a worker dies before acknowledging it anyway).
///
/// The record follows the entry: delivered (kept one window from delivery,
/// so that late copies stay duplicates), dead-lettered (copies stay
/// duplicates until it is replayed), queued again. Each change is one
/// [`Store::replace`], atomic on the memory, Redis and SQL stores (and a
/// [`TieredStore`](tower_idempotency::store::TieredStore) of them): a copy arriving
/// meanwhile finds the old state or the new one, a duplicate either way. A
/// store of your own that keeps the trait's default `replace` (forget,
/// claim, complete) leaves one store round trip in which a copy may queue
/// the key a second time, which the consumer runs once.
///
/// # Across gateways
///
/// Gateways pointing at one broker share its queues. Pacing
/// (`deliver_concurrency`, `deliver_rate`) holds across them through the
/// same store: a lane's `N` delivery slots are `N` claims with a lease
/// (a dead gateway's slot comes back when its lease runs out), a lane's
/// turn is a claim that runs out one interval later (and says when, so
/// that a gateway that finds it taken waits until then). None of these
/// claims starts a watch in the store
/// ([`Store::claim_unwatched`]). While a lane's slots are all taken, a
/// gateway looks at them again after 50 ms, doubling to 200 ms while they
/// stay taken (at once when it gives one back itself), however many of its
/// deliveries wait: at most `N` claims a look. With a store of one
/// instance (the memory store) each gateway paces alone, and so does
/// deduplication at ingest: give every gateway the same Redis or SQL store.
///
/// # What the broker does not say
///
/// [`stats`](Queue::stats) counts the messages ready in `NAME` and in the
/// delay queues (from the broker) plus those this instance is delivering
/// or moved to a delay queue and that are on their way back;
/// entries another gateway is delivering are not counted, and the age of the
/// oldest entry is that of the oldest this instance is delivering (AMQP
/// cannot look at a queue's head without taking it). Order groups
/// ([`Message::order`]) are not enforced.
///
/// # Taking entries
///
/// The broker pushes entries to one consumer per instance (`basic.consume`,
/// manual acknowledgements) whose prefetch (`basic.qos`) is the most the
/// worker asked for in one fetch: no more entries are unacknowledged on
/// this instance than its worker's lanes can hold together, and a fetch
/// takes what was pushed without a round trip per entry. A delivered
/// entry then costs its acknowledgement and one store call (its record
/// becomes "delivered").
///
/// Whatever this instance holds unacknowledged, fetched or only pushed, a
/// gateway that dies (or loses its connection, or drops the queue) hands
/// back at once, without waiting for a lease. An entry whose lease runs out
/// while this instance still holds it (a worker that stopped renewing it)
/// is returned to the queue at the next fetch, and so is one pushed but not
/// fetched within a lease. Keep the broker's `consumer_timeout` (30 minutes
/// by default) above the longest delivery.
///
/// # A broker that stops answering
///
/// Every exchange with the broker (a publish and its confirm, an
/// acknowledgement, a declare, a prefetch) is answered within 5 seconds or
/// fails, and connecting within 10. A broker that hangs with its connection
/// open (stopped, stuck on a full disk, behind a link that drops packets)
/// therefore costs an ingest a failure reply after 5 to 10 s, not a request
/// held until it comes back, and a delivery or a fetch a retry. The
/// connection that did not answer is dropped, and the next call connects
/// again; for a second after a connect failed, callers get its error at
/// once instead of each waiting for a connect of its own. A
/// publish the broker took but did not confirm in time may leave a second
/// entry of its key once the sender retries: a duplicate in the broker,
/// never a lost notification, run once like any other.
///
/// # Why lapin
///
/// [lapin](https://docs.rs/lapin) is the AMQP 0-9-1 client the Rust
/// ecosystem uses for RabbitMQ (the one its documentation lists): it
/// implements publisher confirms, `amqps://` over rustls, and runs on tokio.
/// ```no_run
/// use tower_idempotency_queue::{AmqpQueue, Queue};
/// use tower_idempotency_redis::RedisStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::standalone("redis://127.0.0.1/").await?;
/// let queue = AmqpQueue::open("amqp://gateway:secret@127.0.0.1:5672/%2f", "gateway", store).await?;
/// println!("{:?}", queue.stats().await?);
/// # Ok(()) }
/// ```
pub struct AmqpQueue<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for AmqpQueue<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<S> fmt::Debug for AmqpQueue<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpQueue")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl<S: Store> AmqpQueue<S> {
    /// Connects to the broker at `uri` (`amqp://USER:PASS@HOST:PORT/VHOST`,
    /// or `amqps://`), declares the queue `name` (see the layout above), and
    /// keeps its key records in `store`.
    pub async fn open(uri: &str, name: &str, store: S) -> Result<Self, QueueError> {
        let queue = Self {
            inner: Arc::new(Inner {
                uri: uri.to_owned(),
                name: name.to_owned(),
                store,
                window: Duration::from_secs(25 * 3600),
                live: Mutex::new(None),
                link: tokio::sync::Mutex::default(),
                stalled: AtomicU64::new(0),
                generations: AtomicU64::new(0),
                held: Mutex::new(HashMap::new()),
                next_lease: AtomicU64::new(1),
                slots: Mutex::new(HashMap::new()),
                slot_scans: Mutex::new(HashMap::new()),
                backing_off: Mutex::new(HashMap::new()),
                feed: tokio::sync::Mutex::new(None),
                dead_log: dead_log::DeadLog::default(),
            }),
        };
        queue.link().await?;
        queue.move_old_dead_letters().await?;
        Ok(queue)
    }

    /// How long a delivered key is remembered. Defaults to 25 hours.
    /// Call it before cloning the queue.
    pub fn window(mut self, window: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.window = window;
        }
        self
    }

    /// The queue's name on the broker.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Takes back the deliveries whose lease ran out while this instance
    /// held them: the broker hands them out again.
    async fn requeue_expired(&self) {
        let now = Instant::now();
        let expired: Vec<Held> = {
            let mut held = self.inner.held.lock().unwrap_or_else(|e| e.into_inner());
            let ids: Vec<u64> = held
                .iter()
                .filter(|(_, h)| h.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| held.remove(id)).collect()
        };
        for h in expired {
            self.give_back_one(h.generation, &h.acker).await;
        }
    }

    /// Removes a held delivery: its acker, if this instance still holds it
    /// on the live connection.
    async fn release_held(&self, delivery: &Delivery) -> Option<Held> {
        let held = self
            .inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&delivery.lease)?;
        let live = self.link().await.ok()?;
        (live.generation == held.generation).then_some(held)
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    }
}

fn fresh_id() -> String {
    format!("{:032x}", OwnerToken::new().as_u128())
}

impl<S: Store> Queue for AmqpQueue<S> {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        let token = OwnerToken::new();
        if let Some(seen) = self.claim_key(&message, token).await? {
            return Ok(seen);
        }
        let id = fresh_id();
        let env = Envelope {
            id: id.clone(),
            attempts: 0,
            error: None,
            enqueued_ms: now_ms(),
            dead_at: None,
            history: None,
        };
        if let Err(e) = self.publish("", &self.inner.name, &message, env).await {
            self.release_key(&message, token).await;
            return Err(e);
        }
        self.queued(&message, token).await;
        Ok(Ingested::Queued(EntryId::new(id)))
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        self.requeue_expired().await;
        let link = self.link().await?;
        let mut out = Vec::new();
        for got in self.take(&link, max, lease).await? {
            let p = &got.properties;
            let id = p
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(fresh_id);
            // This attempt: the failures recorded, plus every time the
            // broker handed this message out before (a dead worker's).
            // Headers anyone who can publish may set: added saturating (an
            // attempt past what fits is the last one, dead-lettered).
            let handed = header_u64(p, "x-delivery-count").unwrap_or(u64::from(got.redelivered));
            let attempt = header_u64(p, ATTEMPTS_HEADER)
                .unwrap_or(0)
                .saturating_add(1)
                .saturating_add(handed);
            let enqueued = time_of(header_u64(p, ENQUEUED_HEADER).unwrap_or_else(now_ms));
            let Some(message) = Message::decode(&got.data) else {
                // Not a message this version wrote: set aside with its
                // reason, and the others delivered.
                let why = "undecodable entry: not a message this version can read";
                crate::log_warn!(entry = %id, "{why}; dead-lettered");
                let raw = Message::undecodable(&id, &got.data);
                let stored = header_text(p, HISTORY_HEADER);
                let history = History::record(
                    Some(&stored),
                    attempt.min(u64::from(u32::MAX)) as u32,
                    SystemTime::now(),
                    why,
                );
                let env = Envelope {
                    id: id.clone(),
                    attempts: attempt.min(u64::from(u32::MAX)) as u32,
                    error: Some(why),
                    enqueued_ms: ms_of(enqueued),
                    dead_at: Some(now_ms()),
                    history: Some(&history),
                };
                self.publish(&self.dlx(), &self.inner.name, &raw, env)
                    .await?;
                self.settled(link.generation, got.acker.ack(BasicAckOptions::default()))
                    .await?;
                continue;
            };
            // A wait longer than the longest delay queue: round again.
            if self.not_due_yet(&got, &message, link.generation).await? {
                continue;
            }
            self.inner
                .backing_off
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            let lease_id = self.inner.next_lease.fetch_add(1, Ordering::Relaxed);
            self.inner
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    lease_id,
                    Held {
                        acker: got.acker.clone(),
                        generation: link.generation,
                        deadline: Instant::now() + lease,
                        enqueued,
                    },
                );
            out.push(Delivery {
                id: EntryId::new(id),
                message,
                attempt: attempt.min(u64::from(u32::MAX)) as u32,
                enqueued_at: enqueued,
                lease: lease_id,
                history: Some(header_text(p, HISTORY_HEADER).into())
                    .filter(|h: &Arc<str>| !h.is_empty()),
            });
        }
        Ok(out)
    }

    async fn renew(&self, delivery: &Delivery, lease: Duration) -> Result<bool, QueueError> {
        let generation = self.link().await.ok().map(|l| l.generation);
        let mut held = self.inner.held.lock().unwrap_or_else(|e| e.into_inner());
        match held.get_mut(&delivery.lease) {
            Some(h) if Some(h.generation) == generation => {
                h.deadline = Instant::now() + lease;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        let acked = held.acker.ack(BasicAckOptions::default());
        if self.settled(held.generation, acked).await.is_err() {
            // The connection broke: the broker hands the entry out again.
            return Ok(false);
        }
        let m = &delivery.message;
        self.set_state(&m.key, m.fingerprint, DELIVERED).await;
        Ok(true)
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        let history = History::record(
            delivery.history.as_deref(),
            delivery.attempt,
            SystemTime::now(),
            error,
        );
        self.back_off(delivery, after, delivery.attempt, error, Some(&history))
            .await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        let history = delivery.history.as_deref();
        self.back_off(
            delivery,
            after,
            delivery.attempt.saturating_sub(1),
            error,
            history,
        )
        .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        self.dead_letter_now(delivery, error).await
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        self.dead_letters_now(limit).await
    }

    async fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        self.dead_page_now(after, limit).await
    }

    async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        self.find_dead_now(id).await
    }

    async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        self.delete_dead_now(id).await
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        self.replay_one(id, &|_| None).await
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        self.replay_every(&|_| None).await
    }

    async fn replay_with(&self, id: &EntryId, reseal: &Reseal) -> Result<bool, QueueError> {
        self.replay_one(id, reseal).await
    }

    async fn replay_all_with(&self, reseal: &Reseal) -> Result<usize, QueueError> {
        self.replay_every(reseal).await
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        self.stats_now().await
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
        self.forget_now(key).await
    }
}

/// Slots and turns are claims in the store every gateway shares; no
/// breaker is shared (each worker's own judges alone).
impl<S: Store> SharedPacing for AmqpQueue<S> {
    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        self.slot_take(lane, limit, lease).await
    }

    async fn renew_slot(&self, lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
        self.slot_renew(lane, slot, lease).await
    }

    async fn give_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        self.slot_give(lane, slot).await
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        self.turn_take(lane, interval).await
    }

    crate::worker::shared::no_shared_breaker!();
}
