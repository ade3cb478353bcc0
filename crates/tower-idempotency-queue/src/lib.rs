//! Acknowledge once it is durable, deliver later: durable queues of
//! notifications, deduplicated at ingest, delivered with retries, and a
//! dead-letter queue from which nothing is lost.
//!
//! A gateway that answers the channel's success reply only after
//! [`Queue::ingest`] returned promises only what is true: the notification
//! is stored and will be delivered. (An early answer without a durable write,
//! such as "reply within 5 s, whatever happens", is a false acknowledgement:
//! a crash loses the notification and the channel never sends it again.) A
//! [`Worker`] then delivers each entry to a tower service, retries failures
//! with exponential backoff, and moves an entry that failed `max_attempts`
//! times to the dead letters, from which [`Queue::replay`] puts it back once.
//! Put a [`ConsumerLayer`](tower_idempotency::consumer::ConsumerLayer) (or the HTTP
//! [dedup layer](tower_idempotency::dedup)) in front of the handler: a queue redelivers
//! an entry whose worker died before acknowledging it, and the consumer
//! makes sure the handler does not run twice.
//!
//! Backends: [`RedbQueue`], a file on one node that survives `kill -9`
//! (the default for one instance); `RedisStreamsQueue` (feature `redis`)
//! for many instances; `AmqpQueue` (feature `amqp`) on the RabbitMQ you
//! already run; `JetStreamQueue` (feature `nats`) on the NATS JetStream
//! server you already run; [`MemoryQueue`] for tests only.
//! Wrap a queue that others can write to in [`Sealed`]: its entries then
//! carry a MAC under a [`QueueKey`] its instances share, and an entry whose
//! MAC does not hold is dead-lettered as [`UNAUTHENTICATED`], never delivered.
//!
//! A backend implements [`Queue`]: what the once-and-only-once promise rests
//! on, and all a [`Worker`] needs. Pacing and a circuit breaker across the
//! instances on one queue are [`SharedPacing`], a trait of its own that the
//! shared backends implement (Redis Streams, RabbitMQ, JetStream) and the
//! embedded ones do not; a worker uses it only when built with
//! [`Worker::shared_pacing`], and otherwise paces alone. A call that fails
//! answers a [`QueueError`], whose [`QueueErrorKind`] says what to do about
//! it.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use tower::service_fn;
//! use tower_idempotency_queue::{Ingested, Message, MemoryQueue, Queue, Worker};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let queue = MemoryQueue::new();
//! let fp = Fingerprint::of(b"paid 100");
//! for copy in 0..7 {
//!     let got = queue.ingest(Message::new("wx:4200001", fp, "{...}")).await.unwrap();
//!     assert_eq!(matches!(got, Ingested::Queued(_)), copy == 0);
//! }
//! let runs = Arc::new(AtomicUsize::new(0));
//! let counter = runs.clone();
//! let mut worker = Worker::new(queue.clone(), service_fn(move |_m: Message| {
//!     counter.fetch_add(1, Ordering::SeqCst);
//!     async { Ok::<_, std::io::Error>(()) }
//! }));
//! assert_eq!(worker.run_once().await.unwrap().delivered, 1);
//! assert_eq!(runs.load(Ordering::SeqCst), 1);
//! assert_eq!(queue.stats().await.unwrap().depth, 0);
//! # }
//! ```
//!
//! The [`consumer`] module has the same once-per-key guarantee for a
//! subscription of the brokers users already run: `AmqpConsumer` (feature
//! `amqp`) and `JetStreamConsumer` (feature `nats`).
//!
//! # Feature flags
//!
//! | feature | what it adds |
//! |---|---|
//! | `redis` | `RedisStreamsQueue`: one Redis stream shared by every instance |
//! | `amqp` | `AmqpQueue` on a RabbitMQ quorum queue, and `consumer::AmqpConsumer` |
//! | `nats` | `JetStreamQueue` on NATS JetStream, and `consumer::JetStreamConsumer` |
//! | `metrics` | the queue's `idempotency_queue_*` series through the `metrics` facade |
//! | `tracing` | warnings and a `deliver` span per queued delivery (target `tower_idempotency`), carrying the route, the key's hash and the attempt |
//! | `otel` | with `tracing`, each delivery's span linked to the span that queued it (its stored `traceparent`) |
//! | `testing` | `testing`: the conformance suite every queue passes, for the tests of a backend of your own |
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

#[cfg(feature = "amqp")]
mod amqp;
mod attempts;
mod common;
pub mod consumer;
mod either;
mod embedded;
mod error;
#[cfg(feature = "nats")]
mod jetstream;
mod message;
mod metrics;
#[cfg(feature = "redis")]
mod redis;
mod seal;
mod span;
mod stats;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod worker;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use self::amqp::AmqpQueue;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::RedisStreamsQueue;
pub use attempts::{Attempt, MAX_ATTEMPTS_KEPT, MAX_ERROR_LEN};
pub use embedded::{InMemory, MemoryQueue, OnDisk, RedbQueue};
pub use error::{QueueError, QueueErrorKind};
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use jetstream::{JetStreamQueue, JetStreamQueueBuilder};
pub use message::{copy_key, destination_key, original_key, Message};
pub use seal::{
    QueueKey, Reseal, Sealed, DEFAULT_MAX_AGE, EXPIRED, MIN_SECRET_LEN, UNAUTHENTICATED,
};
pub use worker::breaker::{BreakerRule, BreakerState};
pub use worker::pace::{Pace, Rate};
pub use worker::park::Park;
pub use worker::settle::WorkerRound;
pub use worker::Worker;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The id of a queue entry (a number for the embedded queue, a stream id
/// for Redis).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryId(String);

impl EntryId {
    /// An id as printed by [`Display`](fmt::Display) (for example read from
    /// a command line).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What [`Queue::ingest`] did. Every variant but `Mismatch` means the
/// notification is durably stored: answer the sender's success reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ingested {
    /// Stored as a new entry.
    Queued(EntryId),
    /// A message with this key was already queued, delivered within the
    /// window, or dead-lettered: nothing new was stored.
    Duplicate,
    /// A message with this key but another fingerprint was seen: nothing was
    /// stored. Answer a failure (possible tampering).
    Mismatch,
}

/// An entry handed to a worker, leased to it until it acknowledges,
/// retries or dead-letters it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery {
    /// The entry.
    pub id: EntryId,
    /// What was queued.
    pub message: Message,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// When the entry was queued.
    pub enqueued_at: SystemTime,
    /// Identifies this lease: a worker whose lease ran out (and whose entry
    /// was handed to another) can no longer acknowledge it.
    pub(crate) lease: u64,
    /// The failed attempts before this one, as the queue stored them
    /// (queues that carry them with the entry; see `attempts::History`).
    pub(crate) history: Option<Arc<str>>,
}

impl Delivery {
    /// The delivery of entry `id` (its `attempt`th, from 1), handed out
    /// under `lease`: for a queue backend of your own. `lease` identifies
    /// this hand-out (a number the queue picks anew each time it hands the
    /// entry out), so that the queue can refuse to [`ack`](Queue::ack),
    /// [`retry`](Queue::retry) or [`renew`](Queue::renew) for a worker
    /// whose lease ran out and whose entry went to another.
    pub fn new(
        id: EntryId,
        message: Message,
        attempt: u32,
        enqueued_at: SystemTime,
        lease: u64,
    ) -> Self {
        Self {
            id,
            message,
            attempt,
            enqueued_at,
            lease,
            history: None,
        }
    }

    /// The lease this delivery was handed out under (see [`new`](Self::new)).
    pub fn lease(&self) -> u64 {
        self.lease
    }
}

/// An entry that failed too often, kept until it is replayed.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its id in the dead letters (what [`Queue::replay`] takes).
    pub id: EntryId,
    /// What was queued.
    pub message: Message,
    /// How many attempts were made.
    pub attempts: u32,
    /// The last failure.
    pub error: String,
    /// When it was dead-lettered.
    pub dead_at: SystemTime,
    /// Its failed attempts, oldest first: the first one and the latest
    /// (at most [`MAX_ATTEMPTS_KEPT`] in all, each error cut to
    /// [`MAX_ERROR_LEN`] bytes). A letter stored without them (by an
    /// earlier version) shows its last error as its one attempt, when it
    /// died.
    pub history: Vec<Attempt>,
    /// Attempts made but not in [`history`](Self::history) (those between
    /// the first and the latest kept, or made before attempts were kept).
    pub attempts_not_kept: u32,
}

impl DeadLetter {
    /// The letter `id` of `message`, dead at `dead_at` after `attempts`
    /// attempts, the last of which failed with `error`; none of its
    /// attempts kept (see [`with_history`](Self::with_history)).
    pub fn new(
        id: EntryId,
        message: Message,
        attempts: u32,
        error: impl Into<String>,
        dead_at: SystemTime,
    ) -> Self {
        Self {
            id,
            message,
            attempts,
            error: error.into(),
            dead_at,
            history: Vec::new(),
            attempts_not_kept: attempts,
        }
    }

    /// With the attempts it kept, oldest first; those it did not keep
    /// counted in [`attempts_not_kept`](Self::attempts_not_kept).
    #[must_use]
    pub fn with_history(mut self, history: Vec<Attempt>) -> Self {
        let kept = u32::try_from(history.len()).unwrap_or(u32::MAX);
        self.attempts_not_kept = self.attempts.saturating_sub(kept);
        self.history = history;
        self
    }
}

/// A snapshot of a queue, for metrics and operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// Entries not yet delivered (waiting, backing off, or being delivered).
    pub depth: u64,
    /// How long the oldest undelivered entry has waited.
    pub oldest: Option<Duration>,
    /// Entries in the dead letters.
    pub dead: u64,
    /// Whether the queue can store new entries now: `Some(false)` while its
    /// disk is full or failing, or while it keeps its reserve of free space
    /// (see [`RedbQueue::reserve`]); `None` from a queue that does not say.
    pub writable: Option<bool>,
    /// Writes that failed on the queue's storage (I/O errors) since it was
    /// opened.
    pub write_errors: u64,
}

/// A durable queue of notifications: everything the once-and-only-once
/// promise rests on, and nothing else.
///
/// Cheap to clone. A backend implements this trait alone to be delivered
/// by a [`Worker`]; pacing across instances is [`SharedPacing`], a trait of
/// its own that a backend implements or not.
///
/// What correctness rests on, and what an implementation must guarantee:
///
/// - [`ingest`](Self::ingest) is atomic (one entry per key, however many
///   copies arrive at once) and durable before it returns: the caller
///   acknowledges the sender on its word.
/// - [`fetch`](Self::fetch) leases entries: an entry leased to one worker is
///   not handed to another before its lease runs out (or is
///   [renewed](Self::renew)), and an entry of an order group is not handed
///   out while an earlier entry of that group is undelivered.
/// - [`ack`](Self::ack), [`retry`](Self::retry), [`postpone`](Self::postpone)
///   and [`dead_letter`](Self::dead_letter) act only for the lease that
///   holds the entry (`false` otherwise), so a worker whose lease ran out
///   cannot settle an entry handed to another.
/// - The dead letters ([`dead_letter`](Self::dead_letter),
///   [`dead_letters`](Self::dead_letters), [`dead_page`](Self::dead_page),
///   [`find_dead`](Self::find_dead), [`delete_dead`](Self::delete_dead),
///   [`replay`](Self::replay), [`replay_all`](Self::replay_all)) lose
///   nothing: an entry moves between the queue and the dead letters
///   atomically, and a replayed dead letter is queued exactly once.
/// - [`stats`](Self::stats) and [`forget`](Self::forget) tell the truth: a
///   queue that cannot forget a key says so instead of keeping it.
///
/// The methods with a default body are those whose default is correct for
/// any queue: [`dead_page`](Self::dead_page) and
/// [`find_dead`](Self::find_dead) read [`dead_letters`](Self::dead_letters)
/// (slower), [`postpone`](Self::postpone) is a [`retry`](Self::retry) (the
/// attempt counts), [`delete_dead`](Self::delete_dead) and
/// [`forget`](Self::forget) answer an
/// [`Unsupported`](QueueErrorKind::Unsupported) error; nothing is quietly
/// skipped.
pub trait Queue: Clone + Send + Sync + 'static {
    /// Stores `message` unless its key was seen (queued, delivered within
    /// the window, or dead-lettered). Returns once the entry is durable.
    fn ingest(&self, message: Message)
        -> impl Future<Output = Result<Ingested, QueueError>> + Send;

    /// Stores `message` once per destination: an entry of its own for each
    /// ([`Message::destination`]: its key scoped by the destination), so
    /// that each destination is delivered, retried and dead-lettered on its
    /// own, exactly once. The worker's service reads the entry's
    /// [`destination`](Message::destination) to know where to deliver it.
    ///
    /// Answers `Queued` (the first entry stored) when some destination's
    /// entry is new, `Duplicate` when every one was seen (or there is no
    /// destination: nothing to store), `Mismatch` when a destination's
    /// entry was seen with another fingerprint; all but `Mismatch` mean
    /// every destination's entry is durable. An error may leave some
    /// entries stored: ingesting the message again stores the others (the
    /// stored ones answer `Duplicate`), so answer the sender a failure and
    /// let it retry.
    ///
    /// ```
    /// use tower_idempotency::Fingerprint;
    /// use tower_idempotency_queue::{Ingested, MemoryQueue, Message, Queue};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let queue = MemoryQueue::new();
    /// let m = Message::new("evt_1", Fingerprint::of(b"paid"), "{}");
    /// let got = queue.ingest_each(m.clone(), ["orders", "ledger"]).await.unwrap();
    /// assert!(matches!(got, Ingested::Queued(_)));
    /// assert_eq!(queue.stats().await.unwrap().depth, 2);
    /// let again = queue.ingest_each(m, ["orders", "ledger"]).await.unwrap();
    /// assert_eq!(again, Ingested::Duplicate);
    /// # }
    /// ```
    fn ingest_each<D: Into<String>>(
        &self,
        message: Message,
        destinations: impl IntoIterator<Item = D>,
    ) -> impl Future<Output = Result<Ingested, QueueError>> + Send {
        let entries: Vec<Message> = destinations
            .into_iter()
            .map(|d| message.clone().destination(d))
            .collect();
        let queue = self.clone();
        async move {
            let stored =
                futures_util::future::join_all(entries.into_iter().map(|m| queue.ingest(m))).await;
            let mut answer = Ingested::Duplicate;
            for got in stored {
                answer = match (got?, answer) {
                    (_, Ingested::Mismatch) | (Ingested::Mismatch, _) => Ingested::Mismatch,
                    (_, queued @ Ingested::Queued(_)) => queued,
                    (got, _) => got,
                };
            }
            Ok(answer)
        }
    }

    /// Leases up to `max` entries that are due (new, past their backoff, or
    /// whose previous lease ran out) for `lease`.
    fn fetch(
        &self,
        max: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Delivery>, QueueError>> + Send;

    /// The delivery is still running (or waiting for its turn): its lease
    /// runs `lease` from now, so that the entry is not handed out again
    /// meanwhile (nor does that count as an attempt). `false` if the lease
    /// was lost. A [`Worker`] calls it every third of its lease, so that a
    /// delivery may run longer than the lease.
    fn renew(
        &self,
        delivery: &Delivery,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send;

    /// The entry was delivered: removes it. `false` if the lease was lost
    /// (the entry was handed to another worker).
    fn ack(&self, delivery: &Delivery) -> impl Future<Output = Result<bool, QueueError>> + Send;

    /// The delivery failed: the entry is due again after `after`. `false`
    /// if the lease was lost.
    fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send;

    /// The delivery was not made for a reason that is not the entry's (no
    /// route delivers its path now): the entry is due again after `after`,
    /// and this attempt does not count towards the dead letters. `false` if
    /// the lease was lost. Defaults to [`retry`](Self::retry) (the attempt
    /// counts).
    fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.retry(delivery, after, error)
    }

    /// Moves the entry to the dead letters. `false` if the lease was lost.
    fn dead_letter(
        &self,
        delivery: &Delivery,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send;

    /// Up to `limit` dead letters, oldest first.
    fn dead_letters(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, QueueError>> + Send;

    /// A page of at most `limit` dead letters: those after `after` (the
    /// last id of the previous page; `None` from the start) in the queue's
    /// own order of dead letters, which stays the same while letters are
    /// replayed or deleted (the embedded queue: by id; Redis Streams and
    /// NATS JetStream: by the time they died; RabbitMQ: by id). Defaults
    /// to reading every dead letter with
    /// [`dead_letters`](Self::dead_letters) and skipping to `after`.
    fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, QueueError>> + Send {
        let after = after.cloned();
        async move {
            let all = self.dead_letters(usize::MAX).await?;
            let start = match &after {
                None => 0,
                Some(a) => all
                    .iter()
                    .position(|d| &d.id == a)
                    .map_or(all.len(), |i| i + 1),
            };
            Ok(all.into_iter().skip(start).take(limit).collect())
        }
    }

    /// The dead letter `id`, if there is one. Defaults to looking through
    /// [`dead_letters`](Self::dead_letters).
    fn find_dead(
        &self,
        id: &EntryId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, QueueError>> + Send {
        let id = id.clone();
        async move {
            let all = self.dead_letters(usize::MAX).await?;
            Ok(all.into_iter().find(|d| d.id == id))
        }
    }

    /// Deletes the dead letter `id` for good, and forgets its key's marker,
    /// so that a later copy of that notification is queued again instead of
    /// being a duplicate. Returns the deleted letter, or `None` if there is
    /// no such dead letter (replayed or deleted meanwhile). Defaults to an
    /// error: a queue that cannot delete says so.
    fn delete_dead(
        &self,
        id: &EntryId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, QueueError>> + Send {
        let _ = id;
        std::future::ready(Err(QueueError::new(
            QueueErrorKind::Unsupported,
            "this queue cannot delete dead letters",
        )))
    }

    /// Moves one dead letter back into the queue, due at once, with its
    /// attempts reset. `false` if there is no such dead letter (already
    /// replayed, for example): a dead letter is queued again at most once.
    fn replay(&self, id: &EntryId) -> impl Future<Output = Result<bool, QueueError>> + Send;

    /// Replays every dead letter; returns how many.
    fn replay_all(&self) -> impl Future<Output = Result<usize, QueueError>> + Send;

    /// [`replay`](Self::replay), the letter's message queued as `reseal`
    /// makes it (`None`: as it is): a [`Sealed`] queue replays through it
    /// with a fresh seal. Defaults to an error: a queue that cannot say
    /// so.
    fn replay_with(
        &self,
        id: &EntryId,
        reseal: &Reseal,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        let _ = (id, reseal);
        std::future::ready(Err(QueueError::new(
            QueueErrorKind::Unsupported,
            "this queue cannot replay a dead letter with a fresh seal",
        )))
    }

    /// [`replay_all`](Self::replay_all), each message queued as `reseal`
    /// makes it (see [`replay_with`](Self::replay_with)). Defaults to an
    /// error.
    fn replay_all_with(
        &self,
        reseal: &Reseal,
    ) -> impl Future<Output = Result<usize, QueueError>> + Send {
        let _ = reseal;
        std::future::ready(Err(QueueError::new(
            QueueErrorKind::Unsupported,
            "this queue cannot replay dead letters with a fresh seal",
        )))
    }

    /// Depth, age of the oldest entry, dead letters.
    fn stats(&self) -> impl Future<Output = Result<QueueStats, QueueError>> + Send;

    /// Forgets that `key` was delivered, so that its next copy is queued
    /// and delivered again (an operator's "run this one again"). `true` if a
    /// delivered key was forgotten, `false` if the queue holds nothing for
    /// `key` (never seen, or its window ended). An entry of `key` still
    /// queued, being delivered or dead-lettered is an error, and nothing is
    /// forgotten: it is delivered when due (or replayed from the dead
    /// letters), and a copy arriving meanwhile must stay a duplicate.
    ///
    /// Defaults to an error: a queue that cannot forget says so rather than
    /// keep the key while its caller is told it was forgotten.
    fn forget(&self, key: &str) -> impl Future<Output = Result<bool, QueueError>> + Send {
        let _ = key;
        std::future::ready(Err(QueueError::new(
            QueueErrorKind::Unsupported,
            "this queue cannot forget keys",
        )))
    }
}

/// Pacing and a circuit breaker shared by every worker on one queue, so
/// that a route's concurrency, rate and judgement of its upstream hold
/// across instances: the coordination a queue that many instances share can
/// offer, beside the storage of [`Queue`].
///
/// A backend implements it or not. A [`Worker`] uses it only when it was
/// built with [`shared_pacing`](Worker::shared_pacing) (which needs this
/// trait); otherwise it paces alone, on its own concurrency, rate and
/// breaker, and never calls these methods. Nothing here is needed for an
/// entry to be delivered once: the pacing only spreads deliveries out, and
/// each entry is still settled through the queue's lease.
///
/// What an implementation must guarantee:
///
/// - **Slots** ([`take_slot`](Self::take_slot), [`renew_slot`](Self::renew_slot),
///   [`give_slot`](Self::give_slot)): at most `limit` slots of a lane are
///   held at once across every worker on the queue. A slot is held until it
///   is given back or its lease runs out (a worker that died frees its
///   slots by their leases); a renewal moves its lease to `lease` from now.
/// - **Turns** ([`take_turn`](Self::take_turn)): the starts of a lane,
///   across every worker, are at least `interval` apart.
/// - **Breaker** ([`breaker_state`](Self::breaker_state),
///   [`breaker_vote`](Self::breaker_vote), [`take_probe`](Self::take_probe),
///   [`renew_probe`](Self::renew_probe), [`settle_probe`](Self::settle_probe)):
///   one state per lane that every worker reads, judged by the
///   [`BreakerRule`] over every worker's votes, whose probes are leased as
///   slots are. A backend that shares no breaker answers `Ok(None)` from
///   each (and does nothing on [`renew_probe`](Self::renew_probe)): each
///   worker's own breaker then judges alone, and says so in its docs.
/// - An answer it cannot give (its server unreachable, too slow) is an
///   `Err`: the worker's own limits and breaker hold meanwhile, and the
///   failure is logged and counted. It never answers "go" for a slot or
///   turn it did not take.
///
/// Every call is bounded by the worker (a sixth of its lease), so a slow
/// backend can neither hold up a delivery nor let its entry's lease run
/// out.
pub trait SharedPacing: Queue {
    /// Takes one of `limit` delivery slots of the lane `lane` that every
    /// worker on this queue shares (so that a route's concurrency holds
    /// across instances), for `lease` (renewed with
    /// [`renew_slot`](Self::renew_slot), given back with
    /// [`give_slot`](Self::give_slot), or freed when the lease runs out):
    /// `Some(slot)`, or `None` when all are taken.
    fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<u64>, QueueError>> + Send;

    /// Renews a slot from [`take_slot`](Self::take_slot) for `lease` from
    /// now.
    fn renew_slot(
        &self,
        lane: &str,
        slot: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// Gives back a slot from [`take_slot`](Self::take_slot).
    fn give_slot(
        &self,
        lane: &str,
        slot: u64,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// Takes the next turn of the lane `lane` at one start per `interval`,
    /// shared by every worker on this queue (so that a route's rate holds
    /// across instances): `Ok(None)` when this start may go now, or how long
    /// until the next turn.
    fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> impl Future<Output = Result<Option<Duration>, QueueError>> + Send;

    /// The shared breaker of the lane `lane` (one every worker on this queue
    /// follows, so that one instance's judgement of the upstream holds for
    /// all of them): where it stands now, or `None` from a queue that shares
    /// no breaker (each worker judges alone, as it does while a shared one
    /// cannot answer).
    fn breaker_state(
        &self,
        lane: &str,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send;

    /// Casts `entry`'s vote (`ok`: its delivery succeeded) in the lane's
    /// shared breaker, which judges by `rule` over the votes of every
    /// worker on the queue (one per entry, its latest, within a minute;
    /// while it is open or half-open, only the probes' results count) and
    /// answers where it stands (`None`: no breaker shared).
    fn breaker_vote(
        &self,
        lane: &str,
        entry: u64,
        ok: bool,
        rule: BreakerRule,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send;

    /// Asks the lane's shared breaker for a probe, leased for `lease`
    /// (renewed with [`renew_probe`](Self::renew_probe); a probe whose
    /// lease runs out, its worker dead, makes room for another):
    /// [`BreakerState::Probe`] with its id if one was taken, or where the
    /// breaker stands (closed: deliver as usual; open; every probe out);
    /// `None`: no breaker shared.
    fn take_probe(
        &self,
        lane: &str,
        rule: BreakerRule,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send;

    /// Renews a probe from [`take_probe`](Self::take_probe) for `lease`
    /// from now.
    fn renew_probe(
        &self,
        lane: &str,
        probe: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// Settles a probe from [`take_probe`](Self::take_probe) with its
    /// result: `Some(true)` delivered (the breaker closes), `Some(false)`
    /// failed (it opens again if the probe's entry had not failed before,
    /// `fresh`, or when every probe failed), `None` said nothing of the
    /// upstream (its place goes to another). Answers where the breaker
    /// stands (`None`: no breaker shared).
    fn settle_probe(
        &self,
        lane: &str,
        probe: u64,
        up: Option<bool>,
        fresh: bool,
        rule: BreakerRule,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send;
}

/// Logs at warn level when the `tracing` feature is on.
macro_rules! log_warn {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::warn!($($t)*);
    };
}
pub(crate) use log_warn;

/// Logs at info level when the `tracing` feature is on.
macro_rules! log_info {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::info!($($t)*);
    };
}
pub(crate) use log_info;

// Every Rust block of the README is a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}
