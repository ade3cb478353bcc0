//! [`AmqpQueue`]: the acknowledge-then-deliver queue on the RabbitMQ a team
//! already runs.

use super::{DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError, QueueStats};
use crate::store::{Claim, CompletedRecord, Forgotten, OwnerToken, Store, StoredResponse};
use crate::Fingerprint;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long an ingest's claim on a key lasts while it publishes.
const INGEST_LEASE: Duration = Duration::from_secs(10);

/// The delay queues: 2^MIN_DELAY ..= 2^MAX_DELAY milliseconds.
const MIN_DELAY: u32 = 4;
const MAX_DELAY: u32 = 20;

/// The record's state, as the status of its stored response.
const QUEUED: StatusCode = StatusCode::ACCEPTED;
const DELIVERED: StatusCode = StatusCode::OK;
const DEAD: StatusCode = StatusCode::GONE;

fn err(e: impl fmt::Display) -> QueueError {
    QueueError::new(format!("amqp queue: {e}"))
}

/// An acknowledgement's answer as a result: lapin answers `Ok(false)`, not
/// an error, when the channel closed under the delivery (the broker hands
/// it out again), and that is no acknowledgement.
fn settled(answer: lapin::Result<bool>) -> Result<(), QueueError> {
    match answer {
        Ok(true) => Ok(()),
        Ok(false) => Err(err("the channel closed before the broker was told")),
        Err(e) => Err(err(e)),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ms_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The delay queue that holds an entry due after `after`: the next power of
/// two of milliseconds (so never due earlier than asked), within bounds.
fn delay_bucket(after: Duration) -> u64 {
    let ms = after.as_millis().max(1) as u64;
    let exp = (64 - (ms - 1).leading_zeros()).clamp(MIN_DELAY, MAX_DELAY);
    1 << exp
}

/// One connection and its channels.
#[derive(Clone)]
struct Link {
    conn: Arc<Connection>,
    /// Publishes in confirm mode.
    publish: Channel,
    /// Takes entries (`basic.get`) and acknowledges them.
    take: Channel,
    /// Which connection this is: a delivery taken on another one can no
    /// longer be acknowledged (the broker gave it back when that closed).
    generation: u64,
}

impl Link {
    fn usable(&self) -> bool {
        self.conn.status().connected()
            && self.publish.status().connected()
            && self.take.status().connected()
    }
}

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
    link: tokio::sync::Mutex<Option<Link>>,
    generations: AtomicU64,
    held: Mutex<HashMap<u64, Held>>,
    next_lease: AtomicU64,
    /// Slot id → (record key, owner).
    slots: Mutex<HashMap<u64, (String, OwnerToken)>>,
    /// Entries this instance put in a delay queue: id → when due. The
    /// broker moves an entry back into the queue once due, and counts it in
    /// neither while it moves: `stats` counts it meanwhile (until it is
    /// fetched again, or for [`IN_TRANSIT`] past its due time).
    backing_off: Mutex<HashMap<String, Instant>>,
}

/// How long after its due time an entry that left its delay queue is
/// counted in the depth, unless fetched again before.
const IN_TRANSIT: Duration = Duration::from_secs(5);

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
/// - `NAME.dlx`, a durable direct exchange, and `NAME.dead`, the quorum
///   queue of dead letters bound to it.
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
/// [`ConsumerLayer`](crate::consumer::ConsumerLayer) or the gateway's dedup
/// layer in front of it, as for every queue (an entry is redelivered
/// whenever a worker dies before acknowledging it anyway).
///
/// The record follows the entry: delivered (kept one window from delivery,
/// so that late copies stay duplicates), dead-lettered (copies stay
/// duplicates until it is replayed), queued again. A state change rewrites
/// the record (forget, claim, complete); a copy arriving within that one
/// store round trip may queue the key a second time, which again the
/// consumer runs once.
///
/// # Across gateways
///
/// Gateways pointing at one broker share its queues. Pacing
/// (`deliver_concurrency`, `deliver_rate`) holds across them through the
/// same store: a lane's `N` delivery slots are `N` claims with a lease
/// (a dead gateway's slot comes back when its lease runs out), a lane's
/// turn is a claim that runs out one interval later. With a store of one
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
/// A delivery holds its message unacknowledged on this instance's channel:
/// a gateway that dies (or loses its connection) hands it back at once,
/// without waiting for a lease. An entry whose lease runs out while this
/// instance still holds it (a worker that stopped renewing it) is returned
/// to the queue at the next fetch. Keep the broker's `consumer_timeout`
/// (30 minutes by default) above the longest delivery.
///
/// # Why lapin
///
/// [lapin](https://docs.rs/lapin) is the AMQP 0-9-1 client the Rust
/// ecosystem uses for RabbitMQ (the one its documentation lists): it
/// implements publisher confirms, `amqps://` over rustls, and runs on tokio.
/// ```no_run
/// use tower_idempotency::queue::{AmqpQueue, Queue};
/// use tower_idempotency::store::RedisStore;
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

fn string(v: impl Into<String>) -> ShortString {
    ShortString::from(v.into())
}

fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    p.headers().as_ref()?.inner().get(name)
}

fn header_u64(p: &BasicProperties, name: &str) -> Option<u64> {
    match header(p, name)? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}

fn header_text(p: &BasicProperties, name: &str) -> String {
    match header(p, name) {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => String::new(),
    }
}

/// What a publish carries besides the message.
struct Envelope<'a> {
    id: String,
    attempts: u32,
    error: Option<&'a str>,
    enqueued_ms: u64,
    dead_at: Option<u64>,
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
                link: tokio::sync::Mutex::new(None),
                generations: AtomicU64::new(0),
                held: Mutex::new(HashMap::new()),
                next_lease: AtomicU64::new(1),
                slots: Mutex::new(HashMap::new()),
                backing_off: Mutex::new(HashMap::new()),
            }),
        };
        queue.link().await?;
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

    fn record_key(&self, key: &str) -> String {
        format!("amqp:{}:{key}", self.inner.name)
    }

    fn delay_queue(&self, ms: u64) -> String {
        format!("{}.delay.{ms}", self.inner.name)
    }

    fn dlx(&self) -> String {
        format!("{}.dlx", self.inner.name)
    }

    fn dead_queue(&self) -> String {
        format!("{}.dead", self.inner.name)
    }

    /// The live connection, connecting (and declaring the queues) when
    /// there is none or it broke.
    async fn link(&self) -> Result<Link, QueueError> {
        let mut slot = self.inner.link.lock().await;
        if let Some(link) = slot.as_ref().filter(|l| l.usable()) {
            return Ok(link.clone());
        }
        if let Some(old) = slot.take() {
            let _ = old.conn.close(200, "reconnecting".into()).await;
        }
        let conn = Connection::connect(&self.inner.uri, ConnectionProperties::default())
            .await
            .map_err(err)?;
        let publish = conn.create_channel().await.map_err(err)?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(err)?;
        let take = conn.create_channel().await.map_err(err)?;
        self.declare(&publish).await?;
        let link = Link {
            conn: Arc::new(conn),
            publish,
            take,
            generation: self.inner.generations.fetch_add(1, Ordering::Relaxed) + 1,
        };
        // What the old connection held, the broker handed out again.
        self.inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, h| h.generation == link.generation);
        *slot = Some(link.clone());
        Ok(link)
    }

    /// Forgets a broken connection, so that the next call connects again.
    async fn broken(&self, link: &Link) {
        let mut slot = self.inner.link.lock().await;
        if slot
            .as_ref()
            .is_some_and(|l| l.generation == link.generation)
        {
            *slot = None;
        }
    }

    async fn declare(&self, ch: &Channel) -> Result<(), QueueError> {
        let name = &self.inner.name;
        ch.exchange_declare(
            string(self.dlx()),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(err)?;
        ch.queue_declare(string(self.dead_queue()), durable(), quorum())
            .await
            .map_err(err)?;
        ch.queue_bind(
            string(self.dead_queue()),
            string(self.dlx()),
            string(name.clone()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(err)?;
        let mut main = quorum();
        main.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(self.dlx())),
        );
        ch.queue_declare(string(name.clone()), durable(), main)
            .await
            .map_err(err)?;
        for exp in MIN_DELAY..=MAX_DELAY {
            let ms = 1u64 << exp;
            let mut args = quorum();
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms as i64));
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(LongString::from("")),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(LongString::from(name.as_str())),
            );
            // Moved back into the queue at-least-once (a duplicate at
            // worst, which the consumer runs once), never dropped.
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString(LongString::from("at-least-once")),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString(LongString::from("reject-publish")),
            );
            ch.queue_declare(string(self.delay_queue(ms)), durable(), args)
                .await
                .map_err(err)?;
        }
        Ok(())
    }

    /// Publishes `message` to `exchange`/`routing_key` and waits for the
    /// broker's confirm.
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        env: Envelope<'_>,
    ) -> Result<(), QueueError> {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-attempts".into(),
            AMQPValue::LongLongInt(i64::from(env.attempts)),
        );
        headers.insert(
            "x-enqueued-ms".into(),
            AMQPValue::LongLongInt(env.enqueued_ms as i64),
        );
        headers.insert(
            "x-idempotency-key".into(),
            AMQPValue::LongString(LongString::from(message.key.as_str())),
        );
        if let Some(e) = env.error {
            headers.insert(
                "x-last-error".into(),
                AMQPValue::LongString(LongString::from(e)),
            );
        }
        if let Some(at) = env.dead_at {
            headers.insert("x-dead-at-ms".into(), AMQPValue::LongLongInt(at as i64));
        }
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(string(env.id))
            .with_timestamp(env.enqueued_ms / 1000)
            .with_headers(headers);
        let link = self.link().await?;
        let sent = async {
            link.publish
                .basic_publish(
                    string(exchange),
                    string(routing_key),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.encode(),
                    props,
                )
                .await?
                .await
        }
        .await;
        match sent {
            Ok(lapin::Confirmation::Ack(None)) => Ok(()),
            Ok(lapin::Confirmation::Ack(Some(_))) => Err(err(format!(
                "the broker could not route the entry to `{routing_key}`"
            ))),
            Ok(other) => Err(err(format!(
                "the broker did not confirm the entry: {other:?}"
            ))),
            Err(e) => {
                self.broken(&link).await;
                Err(err(e))
            }
        }
    }

    /// The stored record of a key in state `status`.
    fn record(fingerprint: Fingerprint, status: StatusCode) -> Arc<CompletedRecord> {
        Arc::new(CompletedRecord {
            fingerprint,
            response: StoredResponse {
                status,
                headers: HeaderMap::new(),
                body: Bytes::new(),
                trailers: None,
                body_omitted: false,
            },
        })
    }

    /// Rewrites the key's record to `status`, kept for `window`. A failure
    /// is logged and leaves the record as it was: an entry whose record
    /// stays "queued" is still deduplicated, `forget` then refuses it.
    async fn set_state(&self, key: &str, fingerprint: Fingerprint, status: StatusCode) {
        let rk = self.record_key(key);
        let store = &self.inner.store;
        let result = async {
            store.forget(&rk).await?;
            let token = OwnerToken::new();
            if let Claim::Acquired(_) = store.claim(&rk, fingerprint, token, INGEST_LEASE).await? {
                let record = Self::record(fingerprint, status);
                store
                    .complete(&rk, token, record, self.inner.window)
                    .await?;
            }
            Ok::<_, crate::store::StoreError>(())
        }
        .await;
        if let Err(_e) = result {
            crate::outcome::log_warn!(key = %key, error = %_e, "amqp queue: the key's record was not updated");
        }
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
            let _ = h
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await;
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

    /// Publishes `delivery`'s message to a delay queue with `attempts`
    /// recorded, then acknowledges the delivery.
    async fn back_off(
        &self,
        delivery: &Delivery,
        after: Duration,
        attempts: u32,
        error: &str,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        let bucket = delay_bucket(after);
        let queue = self.delay_queue(bucket);
        let env = Envelope {
            id: delivery.id.to_string(),
            attempts,
            error: Some(error),
            enqueued_ms: ms_of(held.enqueued),
            dead_at: None,
        };
        // The copy first: a crash between the two leaves the entry twice
        // (the consumer runs it once), never not at all.
        if let Err(e) = self.publish("", &queue, &delivery.message, env).await {
            let _ = held.acker.nack(requeue()).await;
            return Err(e);
        }
        self.inner
            .backing_off
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                delivery.id.to_string(),
                Instant::now() + Duration::from_millis(bucket),
            );
        settled(held.acker.ack(BasicAckOptions::default()).await)?;
        Ok(true)
    }

    /// Takes up to `max` dead letters on a channel of their own, unacked
    /// (closing the channel gives back those not acknowledged).
    async fn peek_dead(
        &self,
        max: usize,
    ) -> Result<(Channel, Vec<lapin::message::Delivery>), QueueError> {
        let link = self.link().await?;
        let ch = link.conn.create_channel().await.map_err(err)?;
        let mut out = Vec::new();
        while out.len() < max {
            match ch
                .basic_get(string(self.dead_queue()), BasicGetOptions::default())
                .await
                .map_err(err)?
            {
                Some(m) => out.push(m.delivery),
                None => break,
            }
        }
        Ok((ch, out))
    }

    fn dead_letter_of(d: &lapin::message::Delivery) -> DeadLetter {
        let p = &d.properties;
        let id = p
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
        DeadLetter {
            message: Message::decode(&d.data).unwrap_or_else(|| Message::undecodable(&id, &d.data)),
            id: EntryId::new(id),
            attempts: header_u64(p, "x-attempts").unwrap_or(0) as u32,
            error: header_text(p, "x-last-error"),
            dead_at: UNIX_EPOCH + Duration::from_millis(header_u64(p, "x-dead-at-ms").unwrap_or(0)),
        }
    }

    /// Moves the dead letters `pick` chooses back into the queue; how many.
    async fn replay_where(&self, pick: impl Fn(&DeadLetter) -> bool) -> Result<usize, QueueError> {
        let (ch, taken) = self.peek_dead(usize::MAX).await?;
        let mut n = 0;
        let result = async {
            for d in &taken {
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
                };
                self.publish("", &self.inner.name, &letter.message, env)
                    .await?;
                settled(d.acker.ack(BasicAckOptions::default()).await)?;
                self.set_state(&letter.message.key, letter.message.fingerprint, QUEUED)
                    .await;
                n += 1;
            }
            Ok::<_, QueueError>(())
        }
        .await;
        // The others go back to the dead letters.
        self.give_back(&ch, &taken).await;
        result.map(|()| n)
    }

    /// Hands the dead letters a peek took back to the dead queue, and
    /// returns once they are counted there again. Closing the channel
    /// alone requeues them too, but the broker does it on its own time: a
    /// count read on another channel right after could miss them. A nack
    /// and then a passive declare on the same channel reach the queue in
    /// that order, so once the declare is answered they are back.
    async fn give_back(&self, ch: &Channel, taken: &[lapin::message::Delivery]) {
        for d in taken {
            if d.acker.usable() {
                let _ = d.acker.nack(requeue()).await;
            }
        }
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let _ = ch
            .queue_declare(string(self.dead_queue()), passive, FieldTable::default())
            .await;
        let _ = ch.close(200, "done".into()).await;
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
        let rk = self.record_key(&message.key);
        let fp = message.fingerprint;
        let store = &self.inner.store;
        let token = OwnerToken::new();
        let deadline = Instant::now() + INGEST_LEASE + Duration::from_secs(1);
        loop {
            match store
                .claim(&rk, fp, token, INGEST_LEASE)
                .await
                .map_err(err)?
            {
                Claim::Completed(rec) if rec.fingerprint == fp => return Ok(Ingested::Duplicate),
                Claim::Completed(_) => return Ok(Ingested::Mismatch),
                Claim::InFlight { fingerprint, .. } if fingerprint != fp => {
                    return Ok(Ingested::Mismatch)
                }
                Claim::InFlight { watch, .. } => {
                    // Another copy is publishing: its outcome decides.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(err("another copy of this key is still being queued"));
                    }
                    let _ = tokio::time::timeout(left, watch.changed()).await;
                }
                Claim::Acquired(_) => break,
            }
        }
        let id = fresh_id();
        let env = Envelope {
            id: id.clone(),
            attempts: 0,
            error: None,
            enqueued_ms: now_ms(),
            dead_at: None,
        };
        if let Err(e) = self.publish("", &self.inner.name, &message, env).await {
            let _ = store.release(&rk, token).await;
            return Err(e);
        }
        // Confirmed: the entry is durable whatever happens to the record
        // (a record not completed runs out, and a later copy queues the key
        // again: a duplicate the consumer runs once).
        let record = Self::record(fp, QUEUED);
        if let Err(_e) = store.complete(&rk, token, record, self.inner.window).await {
            crate::outcome::log_warn!(key = %message.key, error = %_e, "amqp queue: queued, but the key's record was not completed");
        }
        Ok(Ingested::Queued(EntryId::new(id)))
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        self.requeue_expired().await;
        let link = self.link().await?;
        let mut out = Vec::new();
        while out.len() < max.max(1) {
            let got = match link
                .take
                .basic_get(string(self.inner.name.clone()), BasicGetOptions::default())
                .await
            {
                Ok(Some(got)) => got.delivery,
                Ok(None) => break,
                Err(e) => {
                    self.broken(&link).await;
                    if out.is_empty() {
                        return Err(err(e));
                    }
                    break;
                }
            };
            let p = &got.properties;
            let id = p
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(fresh_id);
            // This attempt: the failures recorded, plus every time the
            // broker handed this message out before (a dead worker's).
            let handed = header_u64(p, "x-delivery-count").unwrap_or(u64::from(got.redelivered));
            let attempt = header_u64(p, "x-attempts").unwrap_or(0) + 1 + handed;
            let enqueued = UNIX_EPOCH
                + Duration::from_millis(header_u64(p, "x-enqueued-ms").unwrap_or_else(now_ms));
            let Some(message) = Message::decode(&got.data) else {
                // Not a message this version wrote: set aside with its
                // reason, and the others delivered.
                let why = "undecodable entry: not a message this version can read";
                crate::outcome::log_warn!(entry = %id, "{why}; dead-lettered");
                let raw = Message::undecodable(&id, &got.data);
                let env = Envelope {
                    id: id.clone(),
                    attempts: attempt.min(u64::from(u32::MAX)) as u32,
                    error: Some(why),
                    enqueued_ms: ms_of(enqueued),
                    dead_at: Some(now_ms()),
                };
                self.publish(&self.dlx(), &self.inner.name, &raw, env)
                    .await?;
                settled(got.acker.ack(BasicAckOptions::default()).await)?;
                continue;
            };
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

    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        let store = &self.inner.store;
        for i in 0..limit {
            let key = format!("amqp:{}:slot:{lane}:{i}", self.inner.name);
            let token = OwnerToken::new();
            let fp = Fingerprint::of(b"slot");
            if let Claim::Acquired(_) = store.claim(&key, fp, token, lease).await.map_err(err)? {
                let t = token.as_u128();
                let slot = (t >> 64) as u64 ^ t as u64;
                self.inner
                    .slots
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(slot, (key, token));
                return Ok(Some(slot));
            }
        }
        Ok(None)
    }

    async fn renew_slot(&self, _lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
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

    async fn give_slot(&self, _lane: &str, slot: u64) -> Result<(), QueueError> {
        let held = self
            .inner
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        if let Some((key, token)) = held {
            self.inner.store.release(&key, token).await.map_err(err)?;
        }
        Ok(())
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        let key = format!("amqp:{}:turn:{lane}", self.inner.name);
        let interval = interval.max(Duration::from_millis(1));
        let got = self
            .inner
            .store
            .claim(&key, Fingerprint::of(b"turn"), OwnerToken::new(), interval)
            .await
            .map_err(err)?;
        // Taken: it runs out one interval from now, which is the next turn.
        Ok(match got {
            Claim::Acquired(_) => None,
            _ => Some((interval / 4).max(Duration::from_millis(1))),
        })
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        if settled(held.acker.ack(BasicAckOptions::default()).await).is_err() {
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
        self.back_off(delivery, after, delivery.attempt, error)
            .await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        self.back_off(delivery, after, delivery.attempt.saturating_sub(1), error)
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        let Some(held) = self.release_held(delivery).await else {
            return Ok(false);
        };
        let m = &delivery.message;
        // The record first: a copy arriving once the entry is dead must
        // find it dead (a duplicate), not queued.
        self.set_state(&m.key, m.fingerprint, DEAD).await;
        let env = Envelope {
            id: delivery.id.to_string(),
            attempts: delivery.attempt,
            error: Some(error),
            enqueued_ms: ms_of(held.enqueued),
            dead_at: Some(now_ms()),
        };
        if let Err(e) = self.publish(&self.dlx(), &self.inner.name, m, env).await {
            let _ = held.acker.nack(requeue()).await;
            return Err(e);
        }
        settled(held.acker.ack(BasicAckOptions::default()).await)?;
        Ok(true)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let (ch, taken) = self.peek_dead(usize::MAX).await?;
        self.give_back(&ch, &taken).await;
        let mut letters: Vec<DeadLetter> = taken.iter().map(Self::dead_letter_of).collect();
        letters.sort_by_key(|d| d.dead_at);
        letters.truncate(limit);
        Ok(letters)
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        Ok(self.replay_where(|d| &d.id == id).await? > 0)
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        self.replay_where(|_| true).await
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let link = self.link().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let ch = &link.publish;
        let count = |name: String| async move {
            ch.queue_declare(string(name), passive, FieldTable::default())
                .await
                .map(|q| u64::from(q.message_count()))
        };
        let result = async {
            let mut depth = count(self.inner.name.clone()).await?;
            for exp in MIN_DELAY..=MAX_DELAY {
                depth += count(self.delay_queue(1 << exp)).await?;
            }
            let dead = count(self.dead_queue()).await?;
            Ok::<_, lapin::Error>((depth, dead))
        }
        .await;
        let (ready, dead) = match result {
            Ok(v) => v,
            Err(e) => {
                self.broken(&link).await;
                return Err(err(e));
            }
        };
        // This instance's retries not fetched again yet: in a delay queue,
        // in the queue, or moving between the two, where the broker counts
        // them in neither. The broker's count is at least theirs unless
        // some are moving.
        let retried = {
            let now = Instant::now();
            let mut backing = self
                .inner
                .backing_off
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            backing.retain(|_, due| *due + IN_TRANSIT > now);
            backing.len() as u64
        };
        let held = self.inner.held.lock().unwrap_or_else(|e| e.into_inner());
        let now = SystemTime::now();
        let oldest = held
            .values()
            .map(|h| now.duration_since(h.enqueued).unwrap_or_default())
            .max();
        Ok(QueueStats {
            depth: ready.max(retried) + held.len() as u64,
            oldest,
            dead,
            ..QueueStats::default()
        })
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
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
                "still queued: a copy is being queued now",
            )),
            Claim::Completed(rec) if rec.response.status == DELIVERED => {
                match store.forget(&rk).await.map_err(err)? {
                    Forgotten::Deleted => Ok(true),
                    Forgotten::Absent => Ok(false),
                    _ => Err(QueueError::new("still queued: a copy is being queued now")),
                }
            }
            Claim::Completed(rec) if rec.response.status == DEAD => Err(QueueError::new(
                "dead-lettered: replay it from the dead letters instead",
            )),
            Claim::Completed(_) => Err(QueueError::new(
                "still queued: delivered when due (or dead-lettered: replay it from the dead letters instead)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backoff_waits_in_the_next_delay_queue_up() {
        assert_eq!(delay_bucket(Duration::from_millis(1)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(16)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(17)), 32);
        assert_eq!(delay_bucket(Duration::from_secs(1)), 1024);
        assert_eq!(delay_bucket(Duration::from_secs(3600)), 1 << MAX_DELAY);
    }
}
