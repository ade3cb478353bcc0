//! [`JetStreamQueue`]: the queue on a NATS JetStream server the user runs.

use super::{DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError, QueueStats};
use async_nats::jetstream::{self, consumer, kv, stream, AckKind};
use async_nats::{HeaderMap, HeaderValue};
use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The consumer every gateway of a queue shares.
const CONSUMER: &str = "workers";

/// The stream's duplicate window: two publishes with one message id within
/// it store one message.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// How long a settlement (ack, nak, term, progress) waits for the server's
/// answer.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Headers of an entry.
const H_MARKER: &str = "Idem-Marker";
const H_ENQUEUED: &str = "Idem-Enqueued";
/// Attempts made before this message was published (a postponed entry).
const H_BASE: &str = "Idem-Attempts";
/// Not due before (ms): a postponed entry's first delivery is put back.
const H_DUE: &str = "Idem-Due";
/// Headers of a dead letter.
const H_ERROR: &str = "Idem-Error";
const H_DEAD_AT: &str = "Idem-Dead-At";

/// The marker's states.
const PENDING: u8 = b'p';
const QUEUED: u8 = b'q';
const DEAD: u8 = b'x';
const DELIVERED: u8 = b'd';

/// A queue on a NATS JetStream server, shared by every gateway that names
/// it.
///
/// ```no_run
/// use tower_idempotency::queue::{JetStreamQueue, Queue};
/// # async fn f() -> Result<(), tower_idempotency::queue::QueueError> {
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
///   delivery is `nak`ed with the backoff as its delay; one that failed
///   `max_attempts` times is copied to the dead letters and `term`inated;
/// - the stream `IDEM_gw_DEAD` (subject `idem.gw.dead`) holds the dead
///   letters, with their attempts and last error in headers;
///   [`replay`](Queue::replay) publishes one back into the queue and then
///   deletes it from the dead letters;
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
/// - A worker whose lease ran out (its entry handed to another) cannot be
///   told so: JetStream accepts its late acknowledgement. The consumer in
///   front of the handler keeps the handler from running twice.
/// - A key's marker lives one [window](JetStreamQueueBuilder::window) after
///   its last change: an entry still queued or dead-lettered longer than
///   that no longer holds its later copies off (a copy is then queued
///   again; the consumer in front of the handler still runs the key once).
/// - Order groups ([`Message::order`]) are not enforced (as on Redis
///   Streams): use the embedded queue where events of one transaction must
///   be delivered in order.
/// - Pacing across gateways ([`take_slot`](Queue::take_slot),
///   [`take_turn`](Queue::take_turn)) keeps its leases and turns in the
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

fn err(e: impl fmt::Display) -> QueueError {
    QueueError::new(format!("jetstream queue: {e}"))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn time_of(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn unique() -> String {
    format!("{:032x}", crate::store::OwnerToken::new().as_u128())
}

/// A name JetStream accepts in stream, bucket and subject names.
fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "default".to_owned()
    } else {
        s
    }
}

/// A URL's percent-escaped userinfo, decoded (`p%40ss` -> `p@ss`).
fn unescape(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A key-value key for any text (keys allow few characters).
fn hashed(text: &str) -> String {
    let d = Sha256::digest(text.as_bytes());
    d.iter().take(20).map(|b| format!("{b:02x}")).collect()
}

/// A marker: state, fingerprint, when (ms), message id.
struct Marker {
    state: u8,
    fingerprint: [u8; 16],
    id: String,
}

impl Marker {
    fn encode(state: u8, fingerprint: [u8; 16], id: &str) -> Bytes {
        let mut out = Vec::with_capacity(1 + 16 + 8 + id.len());
        out.push(state);
        out.extend_from_slice(&fingerprint);
        out.extend_from_slice(&now_ms().to_le_bytes());
        out.extend_from_slice(id.as_bytes());
        out.into()
    }

    fn decode(b: &[u8]) -> Option<Self> {
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

/// How a [`JetStreamQueue`] is created: [`JetStreamQueue::builder`].
#[derive(Debug, Clone)]
pub struct JetStreamQueueBuilder {
    name: String,
    window: Duration,
    lease: Duration,
    replicas: usize,
}

impl JetStreamQueueBuilder {
    /// How long a delivered key is remembered (its marker's age limit).
    /// Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// The consumer's ack wait: an entry whose worker stopped renewing it
    /// (died) is handed out again after it. Give it the workers' lease.
    /// Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// Replicas of the streams and buckets when they are created (in a
    /// JetStream cluster: 3, so that a PubAck means a quorum holds the
    /// entry). Defaults to 1. Streams that exist keep their settings.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Connects to `url` (`nats://HOST:PORT`, `nats://USER:PASS@HOST:PORT`,
    /// `tls://…`) and opens the queue.
    pub async fn connect(self, url: &str) -> Result<JetStreamQueue, QueueError> {
        let addr: async_nats::ServerAddr = url
            .parse()
            .map_err(|_| err("not a nats://HOST:PORT address"))?;
        // The client does not read credentials from the address itself.
        let mut options = async_nats::ConnectOptions::new().name("tower-idempotency");
        match (addr.username(), addr.password()) {
            (Some(user), Some(pass)) => {
                options = options.user_and_password(unescape(user), unescape(pass));
            }
            (Some(token), None) => options = options.token(unescape(token)),
            _ => {}
        }
        let client = options.connect(addr).await.map_err(err)?;
        self.open(client).await
    }

    /// Opens (or creates) the queue over a client you connected (TLS,
    /// credentials, NKeys).
    pub async fn open(self, client: async_nats::Client) -> Result<JetStreamQueue, QueueError> {
        let js = jetstream::new(client.clone());
        let base = sanitize(&self.name);
        let subject = format!("idem.{base}.q");
        let dead_subject = format!("idem.{base}.dead");
        let queue = js
            .get_or_create_stream(stream::Config {
                name: format!("IDEM_{base}"),
                subjects: vec![subject.clone()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                num_replicas: self.replicas,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(|e| err(format!("the stream IDEM_{base}: {e}")))?;
        let dead = js
            .get_or_create_stream(stream::Config {
                name: format!("IDEM_{base}_DEAD"),
                subjects: vec![dead_subject.clone()],
                storage: stream::StorageType::File,
                num_replicas: self.replicas,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(|e| err(format!("the stream IDEM_{base}_DEAD: {e}")))?;
        let config = consumer::pull::Config {
            durable_name: Some(CONSUMER.to_owned()),
            filter_subject: subject.clone(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: self.lease,
            max_deliver: -1,
            // Entries backing off (nak with a delay) stay pending: no
            // limit, so that a backlog of failures never blocks new ones.
            max_ack_pending: -1,
            ..Default::default()
        };
        let consumer: consumer::PullConsumer = match queue.get_consumer(CONSUMER).await {
            Ok(c) => {
                let c: consumer::PullConsumer = c;
                if c.cached_info().config.ack_wait != self.lease {
                    // The same durable again with the new ack wait (an
                    // update, on servers that allow it).
                    queue.create_consumer(config).await.map_err(|e| {
                        err(format!("the consumer's ack wait is not this lease: {e}"))
                    })?
                } else {
                    c
                }
            }
            Err(_) => queue
                .get_or_create_consumer(CONSUMER, config)
                .await
                .map_err(|e| err(format!("the consumer {CONSUMER}: {e}")))?,
        };
        let keys = bucket(&js, format!("IDEM_{base}_KEYS"), self.window, self.replicas).await?;
        let pace = bucket(
            &js,
            format!("IDEM_{base}_PACE"),
            Duration::ZERO,
            self.replicas,
        )
        .await?;
        Ok(JetStreamQueue {
            inner: Arc::new(Inner {
                client,
                js,
                name: self.name,
                subject,
                dead_subject,
                queue,
                dead,
                consumer,
                keys,
                pace,
                held: Mutex::new(HashMap::new()),
                next_lease: AtomicU64::new(1),
                ack_wait: self.lease,
            }),
        })
    }
}

/// Opens (or creates) a key-value bucket. Its stream is created here as
/// the client's `create_key_value` would (that call first reads the
/// account's info, which some servers answer in a form the client cannot
/// read).
async fn bucket(
    js: &jetstream::Context,
    name: String,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, QueueError> {
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: stream::StorageType::File,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| err(format!("the bucket {name}: {e}")))?;
    js.get_key_value(name.clone())
        .await
        .map_err(|e| err(format!("the bucket {name}: {e}")))
}

impl JetStreamQueue {
    /// A builder for the queue `name` (window, lease, replicas).
    pub fn builder(name: &str) -> JetStreamQueueBuilder {
        JetStreamQueueBuilder {
            name: name.to_owned(),
            window: Duration::from_secs(25 * 3600),
            lease: Duration::from_secs(30),
            replicas: 1,
        }
    }

    /// Connects to `url` and opens (or creates) the queue `name` with the
    /// defaults of [`builder`](Self::builder).
    pub async fn connect(url: &str, name: &str) -> Result<Self, QueueError> {
        Self::builder(name).connect(url).await
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

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

    /// Writes the marker of `key` as `state`, keeping its fingerprint and id.
    async fn mark(&self, marker: &str, state: u8, message: &Message) -> Result<(), QueueError> {
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
    async fn mark_replayed(&self, marker: &str, message: &Message) -> Result<(), QueueError> {
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
        Err(err("the key's marker kept changing"))
    }

    /// Sends `kind` to the delivery's reply subject and waits for the
    /// server's answer. `false` if this queue did not hand the delivery out.
    async fn settle(
        &self,
        delivery: &Delivery,
        kind: AckKind,
        done: bool,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.held(delivery) else {
            return Ok(false);
        };
        let sent = Instant::now();
        self.settle_reply(&held.reply, kind).await?;
        let mut map = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        if done {
            map.remove(&delivery.lease);
        } else if let Some(h) = map.get_mut(&delivery.lease) {
            // In progress: the server restarted the ack wait after `sent`.
            h.until = h.until.max(self.lease_until(sent));
        }
        Ok(true)
    }

    /// Until when a lease the server started (or renewed) after `since`
    /// surely holds.
    fn lease_until(&self, since: Instant) -> Instant {
        let wait = self.inner.ack_wait;
        since + wait - wait / 10
    }

    async fn settle_reply(&self, reply: &str, kind: AckKind) -> Result<(), QueueError> {
        let payload: Bytes = kind.into();
        tokio::time::timeout(
            SETTLE_TIMEOUT,
            self.inner.client.request(reply.to_owned(), payload),
        )
        .await
        .map_err(|_| err("the server did not answer the settlement"))?
        .map_err(err)?;
        Ok(())
    }

    /// The delivery's lease, if this queue handed it out and it still
    /// holds. One that ran out is forgotten: the server may have handed the
    /// message to another worker (JetStream accepts a late settlement
    /// without saying so), so nothing is sent for it any more.
    fn held(&self, delivery: &Delivery) -> Option<Held> {
        let mut map = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        let held = map.get(&delivery.lease)?;
        if Instant::now() >= held.until {
            map.remove(&delivery.lease);
            return None;
        }
        Some(held.clone())
    }

    /// Publishes a dead letter for `sequence` (idempotently) and terminates
    /// the message behind `reply`.
    #[allow(clippy::too_many_arguments)]
    async fn bury(
        &self,
        reply: &str,
        sequence: u64,
        marker: &str,
        payload: Vec<u8>,
        attempts: u32,
        enqueued: u64,
        error: &str,
    ) -> Result<(), QueueError> {
        let mut h = Self::entry_headers(marker, enqueued, attempts);
        h.insert(H_BASE, HeaderValue::from(u64::from(attempts)));
        h.insert(H_ERROR, one_line(error).as_str());
        h.insert(H_DEAD_AT, HeaderValue::from(now_ms()));
        let id = format!("d-{sequence}");
        self.publish(&self.inner.dead_subject, &id, h, payload)
            .await?;
        self.settle_reply(reply, AckKind::Term).await
    }

    /// Moves a held entry to the back of the queue, due after `after`, with
    /// `base` attempts counted (its attempt is not counted again).
    async fn requeue(
        &self,
        delivery: &Delivery,
        after: Duration,
        base: u32,
    ) -> Result<bool, QueueError> {
        let Some(held) = self.held(delivery) else {
            return Ok(false);
        };
        let marker = hashed(&delivery.message.key);
        let mut h = Self::entry_headers(&marker, ms_of(delivery.enqueued_at), base);
        h.insert(H_BASE, HeaderValue::from(u64::from(base)));
        h.insert(
            H_DUE,
            HeaderValue::from(now_ms() + after.as_millis() as u64),
        );
        let id = format!("p-{}-{}", held.sequence, delivery.attempt);
        self.publish(&self.inner.subject, &id, h, delivery.message.encode())
            .await?;
        self.settle(delivery, AckKind::Ack, true).await
    }
}

fn ms_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Pacing state in the `PACE` bucket: a list of `(slot, until ms)` or one
/// time (ms).
fn encode_slots(slots: &[(u64, u64)]) -> Bytes {
    let mut out = Vec::with_capacity(slots.len() * 16);
    for (s, t) in slots {
        out.extend_from_slice(&s.to_le_bytes());
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.into()
}

fn decode_slots(b: &[u8]) -> Vec<(u64, u64)> {
    b.chunks_exact(16)
        .map(|c| {
            (
                u64::from_le_bytes(c[..8].try_into().unwrap_or_default()),
                u64::from_le_bytes(c[8..].try_into().unwrap_or_default()),
            )
        })
        .collect()
}

/// How many times a compare-and-set on the `PACE` bucket is tried.
const CAS_TRIES: usize = 16;

impl JetStreamQueue {
    /// The current value and revision of a pacing key (`None`: absent).
    async fn pace_entry(&self, key: &str) -> Result<Option<(Bytes, u64)>, QueueError> {
        Ok(self
            .inner
            .pace
            .entry(key)
            .await
            .map_err(err)?
            .filter(|e| e.operation == kv::Operation::Put)
            .map(|e| (e.value, e.revision)))
    }

    /// Writes `value` if the key is still at `revision` (`None`: absent).
    async fn pace_cas(&self, key: &str, value: Bytes, revision: Option<u64>) -> bool {
        match revision {
            Some(r) => self.inner.pace.update(key, value, r).await.is_ok(),
            None => self.inner.pace.create(key, value).await.is_ok(),
        }
    }

    /// Changes the slots of `lane` with `change` (compare-and-set, retried);
    /// what `change` returned, or `None` if every try conflicted.
    async fn with_slots<T>(
        &self,
        lane: &str,
        mut change: impl FnMut(&mut Vec<(u64, u64)>, u64) -> (bool, T),
    ) -> Result<Option<T>, QueueError> {
        let key = format!("slots.{}", hashed(lane));
        for _ in 0..CAS_TRIES {
            let now = now_ms();
            let cur = self.pace_entry(&key).await?;
            let mut slots = cur
                .as_ref()
                .map(|(v, _)| decode_slots(v))
                .unwrap_or_default();
            slots.retain(|&(_, until)| until > now);
            let (write, out) = change(&mut slots, now);
            if !write {
                return Ok(Some(out));
            }
            if self
                .pace_cas(&key, encode_slots(&slots), cur.map(|(_, r)| r))
                .await
            {
                return Ok(Some(out));
            }
            tokio::time::sleep(Duration::from_millis(1 + now % 7)).await;
        }
        Ok(None)
    }
}

impl Queue for JetStreamQueue {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
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
                        return Err(err("unreadable key marker"));
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
        Err(err("the key's marker kept changing"))
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
            let m = m.map_err(err)?;
            let Some(reply) = m.reply.as_ref().map(|r| r.to_string()) else {
                continue;
            };
            let (sequence, delivered, published) = match m.info() {
                Ok(i) => (
                    i.stream_sequence,
                    i.delivered.max(1) as u32,
                    (i.published.unix_timestamp_nanos() / 1_000_000).max(0) as u64,
                ),
                Err(e) => return Err(err(e)),
            };
            let headers = m.headers.as_ref();
            let base = header_u64(headers, H_BASE).unwrap_or(0) as u32;
            let enqueued = header_u64(headers, H_ENQUEUED).unwrap_or(published);
            let mut attempt = base.saturating_add(delivered);
            if let Some(due) = header_u64(headers, H_DUE) {
                // A postponed entry: its first delivery only puts it back
                // until it is due, and does not count.
                attempt = attempt.saturating_sub(1).max(base + 1);
                if due > now && delivered == 1 {
                    self.settle_reply(&reply, AckKind::Nak(Some(Duration::from_millis(due - now))))
                        .await?;
                    continue;
                }
            }
            let Some(message) = Message::decode(&m.payload) else {
                let why = "undecodable entry: not a message this version can read";
                crate::outcome::log_warn!(entry = sequence, "{why}; dead-lettered");
                let marker = header_text(headers, H_MARKER);
                self.bury(
                    &reply,
                    sequence,
                    &marker,
                    m.payload.to_vec(),
                    attempt,
                    enqueued,
                    why,
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
            });
        }
        Ok(out)
    }

    async fn renew(&self, delivery: &Delivery, _lease: Duration) -> Result<bool, QueueError> {
        self.settle(delivery, AckKind::Progress, false).await
    }

    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        let t = crate::store::OwnerToken::new().as_u128();
        let slot = (t >> 64) as u64 ^ t as u64;
        let lease = lease.as_millis().max(1) as u64;
        let got = self
            .with_slots(lane, |slots, now| {
                if slots.len() >= limit {
                    return (false, None);
                }
                slots.push((slot, now + lease));
                (true, Some(slot))
            })
            .await?;
        Ok(got.flatten())
    }

    async fn renew_slot(&self, lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
        let lease = lease.as_millis().max(1) as u64;
        self.with_slots(lane, |slots, now| {
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some(s) => {
                    s.1 = now + lease;
                    (true, ())
                }
                None => (false, ()),
            }
        })
        .await?;
        Ok(())
    }

    async fn give_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        self.with_slots(lane, |slots, _| {
            let before = slots.len();
            slots.retain(|(s, _)| *s != slot);
            (slots.len() != before, ())
        })
        .await?;
        Ok(())
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        let key = format!("turn.{}", hashed(lane));
        let interval = interval.as_millis().max(1) as u64;
        for _ in 0..CAS_TRIES {
            let now = now_ms();
            let cur = self.pace_entry(&key).await?;
            let next = cur
                .as_ref()
                .and_then(|(v, _)| v.get(..8)?.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            if next > now {
                return Ok(Some(Duration::from_millis(next - now)));
            }
            let value = Bytes::copy_from_slice(&(now + interval).to_le_bytes());
            if self.pace_cas(&key, value, cur.map(|(_, r)| r)).await {
                return Ok(None);
            }
        }
        Ok(Some(Duration::from_millis(interval)))
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
        _error: &str,
    ) -> Result<bool, QueueError> {
        self.settle(delivery, AckKind::Nak(Some(after)), true).await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        _error: &str,
    ) -> Result<bool, QueueError> {
        self.requeue(delivery, after, delivery.attempt.saturating_sub(1))
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
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
        )
        .await?;
        self.inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&delivery.lease);
        Ok(true)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let mut out = Vec::new();
        let mut seq = 1;
        while out.len() < limit.max(1) {
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
            let headers = Some(&m.headers);
            let id = m.sequence.to_string();
            out.push(DeadLetter {
                message: Message::decode(&m.payload)
                    .unwrap_or_else(|| Message::undecodable(&id, &m.payload)),
                id: EntryId::new(id),
                attempts: header_u64(headers, H_BASE).unwrap_or(0) as u32,
                error: header_text(headers, H_ERROR),
                dead_at: time_of(header_u64(headers, H_DEAD_AT).unwrap_or(0)),
            });
        }
        Ok(out)
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
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

    async fn replay_all(&self) -> Result<usize, QueueError> {
        let mut n = 0;
        loop {
            let batch = self.dead_letters(256).await?;
            if batch.is_empty() {
                return Ok(n);
            }
            for letter in batch {
                n += usize::from(self.replay(&letter.id).await?);
            }
        }
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let queue = self.inner.queue.get_info().await.map_err(err)?;
        let dead = self.inner.dead.get_info().await.map_err(err)?;
        let oldest = (queue.state.messages > 0).then(|| {
            let first = (queue.state.first_timestamp.unix_timestamp_nanos() / 1_000_000).max(0);
            Duration::from_millis(now_ms().saturating_sub(first as u64))
        });
        Ok(QueueStats {
            depth: queue.state.messages,
            oldest,
            dead: dead.state.messages,
            ..QueueStats::default()
        })
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
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
                "still queued: delivered when due (or dead-lettered: replay it from the dead letters instead)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
