//! [`Sealed`]: a queue whose entries carry a MAC under a key that every
//! instance of the queue shares ([`QueueKey`]), checked before delivery.
//!
//! Anyone who can write to a shared queue (Redis Streams, RabbitMQ, NATS)
//! could otherwise add an entry in its encoding and have it delivered, with
//! the gateway's own headers, to whatever path it names. A sealed queue
//! writes HMAC-SHA256 over the whole entry (key, fingerprint, order group,
//! method, target, headers, body) into every entry it queues, and hands out
//! only entries whose MAC holds: any other is moved to the dead letters
//! with the error [`UNAUTHENTICATED`], counted in
//! `idempotency_queue_unauthenticated_total{queue}` (feature `metrics`),
//! and never delivered. The MAC covers when the entry was sealed too: one
//! sealed longer ago than the queue's [max age](Sealed::max_age) (a copy
//! of a delivered entry written back into the queue, once its key is
//! forgotten) is moved to the dead letters with the error [`EXPIRED`],
//! and replaying it seals it afresh.

use super::{
    BreakerRule, BreakerState, DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError,
    QueueErrorKind, QueueStats, SharedPacing,
};
use crate::common::now_ms;
use ring::hmac;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The error of a dead letter whose MAC did not hold (or that had none).
pub const UNAUTHENTICATED: &str = "unauthenticated";

/// The error of a dead letter sealed longer ago than the queue's
/// [max age](Sealed::max_age) (or sealed by an earlier version, with no
/// time): replay it to have it delivered.
pub const EXPIRED: &str = "expired";

/// The fewest bytes a shared secret may have.
pub const MIN_SECRET_LEN: usize = 32;

/// How long a sealed entry may wait for its delivery by default: the
/// 25 hours a queue remembers a delivered key by default.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(25 * 3600);

/// What a replay queues in place of a dead letter's message (`None`: the
/// message as it is); see [`Queue::replay_with`].
pub type Reseal = dyn Fn(&Message) -> Option<Message> + Send + Sync;

/// What the MAC covers first: entries sealed by earlier versions (no
/// time).
const CONTEXT: &[u8] = b"tower-idempotency-queue entry\0";

/// What the MAC covers first: entries with the time they were sealed.
const CONTEXT_TIMED: &[u8] = b"tower-idempotency-queue entry sealed at\0";

/// The key the instances of one queue share to seal its entries.
#[derive(Clone)]
pub struct QueueKey(hmac::Key);

impl fmt::Debug for QueueKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("QueueKey(..)")
    }
}

impl QueueKey {
    /// A key from a shared secret of at least [`MIN_SECRET_LEN`] bytes.
    pub fn new(secret: &[u8]) -> Result<Self, QueueError> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(QueueError::new(
                QueueErrorKind::Invalid,
                format!(
                    "a queue secret needs at least {MIN_SECRET_LEN} bytes, got {}",
                    secret.len()
                ),
            ));
        }
        Ok(Self(hmac::Key::new(hmac::HMAC_SHA256, secret)))
    }

    /// The key in `path`: its bytes, without trailing whitespace (a file
    /// written with `echo` ends with a newline).
    pub fn from_file(path: &Path) -> Result<Self, QueueError> {
        let raw = std::fs::read(path)
            .map_err(|e| QueueError::backend(format_args!("cannot read {}", path.display()), e))?;
        let end = raw
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        Self::new(&raw[..end])
            .map_err(|e| QueueError::new(e.kind(), format!("{}: {e}", path.display())))
    }

    /// The key in `path`, made (32 random bytes, hex, readable by the
    /// owner only) if the file does not exist: for a queue only this
    /// process writes (the embedded one).
    pub fn load_or_create(path: &Path) -> Result<Self, QueueError> {
        if !path.exists() {
            let mut secret = [0u8; 32];
            getrandom::fill(&mut secret).map_err(|e| {
                QueueError::new(
                    QueueErrorKind::Unavailable,
                    format!("no random bytes for a queue key: {e}"),
                )
            })?;
            let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
            write_private(path, hex.as_bytes()).map_err(|e| {
                QueueError::backend(format_args!("cannot write {}", path.display()), e)
            })?;
        }
        Self::from_file(path)
    }

    /// What the MAC of `message` covers: its time, when it has one, and
    /// its plain encoding.
    fn signed(message: &Message) -> Vec<u8> {
        let plain = message.encode_plain();
        let mut signed = Vec::with_capacity(CONTEXT_TIMED.len() + 8 + plain.len());
        match message.sealed_at {
            Some(at) => {
                signed.extend_from_slice(CONTEXT_TIMED);
                signed.extend_from_slice(&at.to_le_bytes());
            }
            None => signed.extend_from_slice(CONTEXT),
        }
        signed.extend_from_slice(&plain);
        signed
    }

    /// The MAC of `message` as it stands (with its time, if it has one).
    fn sign(&self, message: &Message) -> [u8; 32] {
        let tag = hmac::sign(&self.0, &Self::signed(message));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Whether `mac` is the MAC of `message` (in constant time).
    fn verify(&self, message: &Message, mac: &[u8; 32]) -> bool {
        hmac::verify(&self.0, &Self::signed(message), mac).is_ok()
    }

    /// `message` sealed now: the time, and the MAC over it and the rest.
    fn seal(&self, mut message: Message) -> Message {
        message.mac = None;
        message.sealed_at = Some(now_ms());
        message.mac = Some(self.sign(&message));
        message
    }

    /// `message` sealed afresh if its MAC holds (it was sealed under this
    /// key, perhaps long ago); `None` otherwise: it is replayed as it is,
    /// and checked again when fetched. What a replay of a sealed queue's
    /// dead letter queues (see [`Queue::replay_with`]).
    pub fn reseal(&self, message: &Message) -> Option<Message> {
        let mac = message.mac.as_ref()?;
        self.verify(message, mac)
            .then(|| self.seal(message.clone()))
    }
}

/// Replays every dead letter of `queue` with
/// [`replay_with`](Queue::replay_with), a page at a time after the last
/// one read (a letter that stays, claimed by a delete, is passed over);
/// how many.
pub(crate) async fn replay_each<Q: Queue>(queue: &Q, reseal: &Reseal) -> Result<usize, QueueError> {
    let mut n = 0;
    let mut after: Option<EntryId> = None;
    loop {
        let page = queue.dead_page(after.as_ref(), 256).await?;
        let Some(last) = page.last() else {
            return Ok(n);
        };
        after = Some(last.id.clone());
        for letter in &page {
            n += usize::from(queue.replay_with(&letter.id, reseal).await?);
        }
    }
}

/// Creates `path` with `bytes`, readable and writable by its owner only;
/// fails if it exists (another process made it first: its key is read).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = match options.open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(e),
    };
    file.write_all(bytes)?;
    file.sync_all()
}

/// A queue whose entries are sealed with a [`QueueKey`] at ingest and
/// checked when fetched: an entry whose MAC does not hold (forged, altered,
/// or sealed under another key) is dead-lettered as [`UNAUTHENTICATED`] and
/// not handed out; one sealed longer ago than [`max_age`](Self::max_age) is
/// dead-lettered as [`EXPIRED`]. An entry with no MAC, or sealed with no
/// time (both queued by an earlier version), is handed out only with
/// [`accept_unsigned`](Self::accept_unsigned) on. A replay seals a dead
/// letter afresh when its MAC holds (an expired one is then delivered);
/// one whose MAC does not hold is replayed as it is.
///
/// ```
/// use tower_idempotency_queue::{Ingested, MemoryQueue, Message, Queue, QueueKey, Sealed};
/// use tower_idempotency::Fingerprint;
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let key = QueueKey::new(&[7; 32]).unwrap();
/// let queue = Sealed::new(MemoryQueue::new(), key, "q");
/// let got = queue.ingest(Message::new("k", Fingerprint::of(b"x"), "x")).await.unwrap();
/// assert!(matches!(got, Ingested::Queued(_)));
/// assert_eq!(queue.fetch(10, Duration::from_secs(30)).await.unwrap().len(), 1);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Sealed<Q> {
    inner: Q,
    key: QueueKey,
    accept_unsigned: bool,
    max_age: Duration,
    name: Arc<str>,
}

impl<Q: Queue> Sealed<Q> {
    /// `inner` sealed with `key`; `name` labels its metric and warnings.
    pub fn new(inner: Q, key: QueueKey, name: &str) -> Self {
        Self {
            inner,
            key,
            accept_unsigned: false,
            max_age: DEFAULT_MAX_AGE,
            name: Arc::from(name),
        }
    }

    /// How long after it was sealed an entry may still be delivered.
    /// Defaults to [`DEFAULT_MAX_AGE`]. Give it the time the consumer in
    /// front of the handler remembers a delivered key (the route's
    /// window): an older entry could be a copy of one delivered and
    /// forgotten, so it is dead-lettered as [`EXPIRED`] instead.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Hands out entries with no MAC (queued by a version that did not seal
    /// them) and entries sealed with no time (by a version that did not
    /// time its seals), as before, while an upgrade drains them. Defaults
    /// to `false`: they are dead-lettered as [`UNAUTHENTICATED`] (replay
    /// them once this is on) and [`EXPIRED`] (a replay seals them afresh).
    pub fn accept_unsigned(mut self, accept: bool) -> Self {
        self.accept_unsigned = accept;
        self
    }

    /// The queue underneath.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    /// The key it seals with.
    pub fn key(&self) -> &QueueKey {
        &self.key
    }

    /// Why `message` may not be delivered: `None` if it may.
    fn refusal(&self, message: &Message) -> Option<&'static str> {
        let Some(mac) = &message.mac else {
            return (!self.accept_unsigned).then_some(UNAUTHENTICATED);
        };
        if !self.key.verify(message, mac) {
            return Some(UNAUTHENTICATED);
        }
        match message.sealed_at {
            None => (!self.accept_unsigned).then_some(EXPIRED),
            Some(at) => {
                let age = Duration::from_millis(now_ms().saturating_sub(at));
                (age > self.max_age).then_some(EXPIRED)
            }
        }
    }

    fn expired(&self, delivery: &Delivery) {
        crate::log_warn!(
            queue = %self.name,
            entry = %delivery.id,
            path = %delivery.message.uri.path(),
            "queue entry sealed longer ago than the queue's max age (or with no time, by an earlier version): dead-lettered as `expired`, not delivered; replay it to deliver it"
        );
    }

    fn refused(&self, delivery: &Delivery) {
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotency_queue_unauthenticated_total",
            "queue" => metrics::SharedString::from(self.name.clone())
        )
        .increment(1);
        let _signed = delivery.message.mac.is_some();
        crate::log_warn!(
            queue = %self.name,
            entry = %delivery.id,
            path = %delivery.message.uri.path(),
            signed = _signed,
            "queue entry failed authentication (not written by a gateway holding this queue's key): dead-lettered as `unauthenticated`, not delivered"
        );
    }
}

impl<A: Queue, B: Queue> Sealed<::either::Either<A, B>> {
    /// The queue underneath picked at run time, sealed with the same key
    /// and settings: for a program that treats the two apart (a
    /// [`Worker`](crate::Worker) with [`shared_pacing`](crate::Worker::shared_pacing)
    /// over the one that implements [`SharedPacing`], alone over the other).
    ///
    /// ```
    /// use either::Either;
    /// use tower_idempotency_queue::{MemoryQueue, QueueKey, RedbQueue, Sealed};
    ///
    /// let key = QueueKey::new(&[7; 32]).unwrap();
    /// let picked: Either<MemoryQueue, RedbQueue> = Either::Left(MemoryQueue::new());
    /// let sealed = Sealed::new(picked, key, "q");
    /// assert!(matches!(sealed.factor(), Either::Left(_)));
    /// ```
    pub fn factor(self) -> ::either::Either<Sealed<A>, Sealed<B>> {
        let Self {
            inner,
            key,
            accept_unsigned,
            max_age,
            name,
        } = self;
        match inner {
            ::either::Either::Left(inner) => ::either::Either::Left(Sealed {
                inner,
                key,
                accept_unsigned,
                max_age,
                name,
            }),
            ::either::Either::Right(inner) => ::either::Either::Right(Sealed {
                inner,
                key,
                accept_unsigned,
                max_age,
                name,
            }),
        }
    }
}

impl<Q: super::Park> super::Park for Sealed<Q> {
    fn park(
        &self,
        delivery: &Delivery,
        prefix: &str,
    ) -> impl Future<Output = Result<Option<bool>, QueueError>> + Send {
        self.inner.park(delivery, prefix)
    }

    fn wake(&self, prefix: &str) -> impl Future<Output = Result<u64, QueueError>> + Send {
        self.inner.wake(prefix)
    }

    fn parked(&self) -> impl Future<Output = Result<Vec<String>, QueueError>> + Send {
        self.inner.parked()
    }
}

impl<Q: Queue> Queue for Sealed<Q> {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        self.inner.ingest(self.key.seal(message)).await
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        let mut got = self.inner.fetch(max, lease).await?;
        let mut refused = Vec::new();
        got.retain(|d| match self.refusal(&d.message) {
            None => true,
            Some(why) => {
                refused.push((d.clone(), why));
                false
            }
        });
        for (d, why) in refused {
            if why == EXPIRED {
                self.expired(&d);
            } else {
                self.refused(&d);
            }
            if let Err(_e) = self.inner.dead_letter(&d, why).await {
                // Its lease runs out and it is fetched, and checked, again.
                crate::log_warn!(queue = %self.name, entry = %d.id, error = %_e, "cannot dead-letter a refused entry; it is checked again after its lease");
            }
        }
        Ok(got)
    }

    fn renew(
        &self,
        delivery: &Delivery,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.renew(delivery, lease)
    }

    fn ack(&self, delivery: &Delivery) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.ack(delivery)
    }

    fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.retry(delivery, after, error)
    }

    fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.postpone(delivery, after, error)
    }

    fn dead_letter(
        &self,
        delivery: &Delivery,
        error: &str,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.dead_letter(delivery, error)
    }

    fn dead_letters(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, QueueError>> + Send {
        self.inner.dead_letters(limit)
    }

    fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, QueueError>> + Send {
        self.inner.dead_page(after, limit)
    }

    fn find_dead(
        &self,
        id: &EntryId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, QueueError>> + Send {
        self.inner.find_dead(id)
    }

    fn delete_dead(
        &self,
        id: &EntryId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, QueueError>> + Send {
        self.inner.delete_dead(id)
    }

    /// Replays the dead letter `id` sealed afresh (when its MAC holds).
    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        let key = self.key.clone();
        self.inner.replay_with(id, &move |m| key.reseal(m)).await
    }

    /// Replays every dead letter, each sealed afresh (when its MAC holds).
    async fn replay_all(&self) -> Result<usize, QueueError> {
        let key = self.key.clone();
        self.inner.replay_all_with(&move |m| key.reseal(m)).await
    }

    fn replay_with(
        &self,
        id: &EntryId,
        reseal: &Reseal,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.replay_with(id, reseal)
    }

    fn replay_all_with(
        &self,
        reseal: &Reseal,
    ) -> impl Future<Output = Result<usize, QueueError>> + Send {
        self.inner.replay_all_with(reseal)
    }

    fn stats(&self) -> impl Future<Output = Result<QueueStats, QueueError>> + Send {
        self.inner.stats()
    }

    fn forget(&self, key: &str) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.forget(key)
    }
}

impl<Q: SharedPacing> SharedPacing for Sealed<Q> {
    fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<u64>, QueueError>> + Send {
        self.inner.take_slot(lane, limit, lease)
    }

    fn renew_slot(
        &self,
        lane: &str,
        slot: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<(), QueueError>> + Send {
        self.inner.renew_slot(lane, slot, lease)
    }

    fn give_slot(
        &self,
        lane: &str,
        slot: u64,
    ) -> impl Future<Output = Result<(), QueueError>> + Send {
        self.inner.give_slot(lane, slot)
    }

    fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> impl Future<Output = Result<Option<Duration>, QueueError>> + Send {
        self.inner.take_turn(lane, interval)
    }

    fn breaker_state(
        &self,
        lane: &str,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send {
        self.inner.breaker_state(lane)
    }

    fn breaker_vote(
        &self,
        lane: &str,
        entry: u64,
        ok: bool,
        rule: BreakerRule,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send {
        self.inner.breaker_vote(lane, entry, ok, rule)
    }

    fn take_probe(
        &self,
        lane: &str,
        rule: BreakerRule,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send {
        self.inner.take_probe(lane, rule, lease)
    }

    fn renew_probe(
        &self,
        lane: &str,
        probe: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<(), QueueError>> + Send {
        self.inner.renew_probe(lane, probe, lease)
    }

    fn settle_probe(
        &self,
        lane: &str,
        probe: u64,
        up: Option<bool>,
        fresh: bool,
        rule: BreakerRule,
    ) -> impl Future<Output = Result<Option<BreakerState>, QueueError>> + Send {
        self.inner.settle_probe(lane, probe, up, fresh, rule)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryQueue;
    use tower_idempotency::Fingerprint;

    fn message(body: &str) -> Message {
        let mut m = Message::new("k", Fingerprint::of(body.as_bytes()), body.to_owned());
        m.headers.insert("x-a", "1".parse().unwrap());
        m
    }

    #[test]
    fn the_mac_covers_the_whole_entry_and_survives_its_encoding() {
        let key = QueueKey::new(&[1; 32]).unwrap();
        let mut m = message("paid 100");
        m.mac = Some(key.sign(&m));
        let back = Message::decode(&m.encode()).unwrap();
        assert!(key.verify(&back, back.mac.as_ref().unwrap()));
        let other = QueueKey::new(&[2; 32]).unwrap();
        assert!(!other.verify(&back, back.mac.as_ref().unwrap()));
        for change in [
            |m: &mut Message| m.body = "paid 999".into(),
            |m: &mut Message| m.key = "k2".into(),
            |m: &mut Message| m.uri = "/other".parse().unwrap(),
            |m: &mut Message| m.method = http::Method::PUT,
            |m: &mut Message| {
                m.headers.insert("x-a", "2".parse().unwrap());
            },
            |m: &mut Message| m.order = Some("g".into()),
            |m: &mut Message| m.destination = Some("ledger".into()),
        ] {
            let mut changed = back.clone();
            change(&mut changed);
            assert!(!key.verify(&changed, changed.mac.as_ref().unwrap()));
        }
    }

    #[test]
    fn an_entry_sealed_for_one_destination_fails_its_check_for_another() {
        let key = QueueKey::new(&[1; 32]).unwrap();
        let sealed = key.seal(message("paid 100").destination("ledger"));
        let bytes = sealed.encode();
        let back = Message::decode(&bytes).unwrap();
        assert!(key.verify(&back, back.mac.as_ref().unwrap()));
        // The same bytes, the destination (and its key) rewritten in place:
        // `ledger` and `orders` are as long as each other.
        let moved = replace_all(&bytes, b"ledger", b"orders");
        assert_ne!(moved, bytes);
        let moved = Message::decode(&moved).unwrap();
        assert_eq!(moved.destination.as_deref(), Some("orders"));
        assert!(!key.verify(&moved, moved.mac.as_ref().unwrap()));
        // Without its destination (an entry of the notification as such).
        let mut bare = back.clone();
        bare.destination = None;
        bare.key = "k".into();
        assert!(!key.verify(&bare, bare.mac.as_ref().unwrap()));
    }

    fn replace_all(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let mut i = 0;
        while i + from.len() <= out.len() {
            if &out[i..i + from.len()] == from {
                out[i..i + from.len()].copy_from_slice(to);
                i += from.len();
            } else {
                i += 1;
            }
        }
        out
    }

    #[test]
    fn the_mac_covers_when_it_was_sealed() {
        let key = QueueKey::new(&[1; 32]).unwrap();
        let m = key.seal(message("paid 100"));
        let back = Message::decode(&m.encode()).unwrap();
        assert_eq!(back.sealed_at, m.sealed_at);
        assert!(key.verify(&back, back.mac.as_ref().unwrap()));
        let mut younger = back.clone();
        younger.sealed_at = younger.sealed_at.map(|t| t + 3_600_000);
        assert!(!key.verify(&younger, younger.mac.as_ref().unwrap()));
        // Its MAC without a time (as an earlier version wrote) holds for
        // no message with one, and the other way round.
        let mut untimed = back.clone();
        untimed.sealed_at = None;
        assert!(!key.verify(&untimed, back.mac.as_ref().unwrap()));
        untimed.mac = Some(key.sign(&untimed));
        let mut timed = untimed.clone();
        timed.sealed_at = Some(0);
        assert!(!key.verify(&timed, untimed.mac.as_ref().unwrap()));
    }

    /// Expired (older than the max age) or sealed with no time: dead-lettered
    /// as `expired`, never handed out; replayed, sealed afresh and handed
    /// out. An unauthenticated letter replayed is still refused.
    #[tokio::test]
    async fn an_old_entry_is_expired_and_a_replay_seals_it_afresh() {
        let inner = MemoryQueue::new();
        let key = QueueKey::new(&[3; 32]).unwrap();
        let queue = Sealed::new(inner.clone(), key.clone(), "q").max_age(Duration::from_secs(60));
        let mut old = key.seal(Message::new("old", Fingerprint::of(b"o"), "o"));
        old.sealed_at = Some(now_ms() - 61_000);
        old.mac = Some(key.sign(&old));
        inner.ingest(old).await.unwrap();
        let mut untimed = Message::new("untimed", Fingerprint::of(b"t"), "t");
        untimed.mac = Some(key.sign(&untimed));
        inner.ingest(untimed).await.unwrap();
        inner
            .ingest(Message::new("unsigned", Fingerprint::of(b"u"), "u"))
            .await
            .unwrap();
        queue.ingest(message("fresh")).await.unwrap();
        let lease = Duration::from_secs(30);
        let got = queue.fetch(10, lease).await.unwrap();
        let keys: Vec<&str> = got.iter().map(|d| d.message.key.as_str()).collect();
        assert_eq!(keys, ["k"]);
        let mut dead: Vec<(String, String)> = (queue.dead_letters(10).await.unwrap().into_iter())
            .map(|d| (d.message.key, d.error))
            .collect();
        dead.sort_unstable();
        let want = [
            ("old", EXPIRED),
            ("unsigned", UNAUTHENTICATED),
            ("untimed", EXPIRED),
        ];
        assert_eq!(dead, want.map(|(k, e)| (k.to_owned(), e.to_owned())));
        assert_eq!(queue.replay_all().await.unwrap(), 3);
        let got = queue.fetch(10, lease).await.unwrap();
        let mut keys: Vec<&str> = got.iter().map(|d| d.message.key.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["old", "untimed"]);
        assert!(got.iter().all(|d| d.message.sealed_at.is_some()));
        let dead = queue.dead_letters(10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].message.key.as_str(), dead[0].error.as_str()),
            ("unsigned", UNAUTHENTICATED)
        );
    }

    /// While unsigned entries are accepted (an upgrade draining), an entry
    /// sealed with no time is handed out as before.
    #[tokio::test]
    async fn an_untimed_seal_is_handed_out_while_unsigned_ones_are_accepted() {
        let inner = MemoryQueue::new();
        let key = QueueKey::new(&[3; 32]).unwrap();
        let queue = Sealed::new(inner.clone(), key.clone(), "q").accept_unsigned(true);
        let mut untimed = Message::new("untimed", Fingerprint::of(b"t"), "t");
        untimed.mac = Some(key.sign(&untimed));
        inner.ingest(untimed).await.unwrap();
        let got = queue.fetch(10, Duration::from_secs(30)).await.unwrap();
        assert_eq!(got.len(), 1);
    }

    #[test]
    fn a_short_secret_is_refused() {
        assert!(QueueKey::new(&[1; 31]).is_err());
    }

    #[tokio::test]
    async fn forged_and_unsigned_entries_are_dead_lettered_not_handed_out() {
        let inner = MemoryQueue::new();
        let queue = Sealed::new(inner.clone(), QueueKey::new(&[3; 32]).unwrap(), "q");
        queue.ingest(message("genuine")).await.unwrap();
        // Written around the seal: no MAC, and a MAC under another key.
        inner
            .ingest(Message::new("unsigned", Fingerprint::of(b"u"), "u"))
            .await
            .unwrap();
        let other = Sealed::new(inner.clone(), QueueKey::new(&[4; 32]).unwrap(), "q");
        other
            .ingest(Message::new("forged", Fingerprint::of(b"f"), "f"))
            .await
            .unwrap();
        let got = queue.fetch(10, Duration::from_secs(30)).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].message.key, "k");
        let dead = queue.dead_letters(10).await.unwrap();
        let mut keys: Vec<_> = dead
            .iter()
            .map(|d| (d.message.key.as_str(), d.error.as_str()))
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [("forged", UNAUTHENTICATED), ("unsigned", UNAUTHENTICATED)]
        );
        // The dead letters are the inner queue's, through the seal too.
        let page = queue.dead_page(None, 1).await.unwrap();
        assert_eq!(page.len(), 1);
        let id = page[0].id.clone();
        assert!(queue.find_dead(&id).await.unwrap().is_some());
        let deleted = queue.delete_dead(&id).await.unwrap();
        assert_eq!(deleted.map(|d| d.id), Some(id.clone()));
        assert!(queue.find_dead(&id).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn unsigned_entries_are_handed_out_while_accepted() {
        let inner = MemoryQueue::new();
        let queue =
            Sealed::new(inner.clone(), QueueKey::new(&[3; 32]).unwrap(), "q").accept_unsigned(true);
        inner
            .ingest(Message::new("unsigned", Fingerprint::of(b"u"), "u"))
            .await
            .unwrap();
        let got = queue.fetch(10, Duration::from_secs(30)).await.unwrap();
        assert_eq!(got.len(), 1);
    }

    #[test]
    fn a_made_key_file_is_private_and_read_back() {
        let dir = std::env::temp_dir().join(format!("seal-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("queue.key");
        let a = QueueKey::load_or_create(&path).unwrap();
        let b = QueueKey::load_or_create(&path).unwrap();
        let m = message("x");
        assert!(b.verify(&m, &a.sign(&m)));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
