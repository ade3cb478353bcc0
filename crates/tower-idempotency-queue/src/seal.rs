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
//! and never delivered.

use super::{
    BreakerRule, BreakerState, DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError,
    QueueErrorKind, QueueStats, SharedPacing,
};
use ring::hmac;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The error of a dead letter whose MAC did not hold (or that had none).
pub const UNAUTHENTICATED: &str = "unauthenticated";

/// The fewest bytes a shared secret may have.
pub const MIN_SECRET_LEN: usize = 32;

/// What the MAC covers first: entries of this format only.
const CONTEXT: &[u8] = b"tower-idempotency-queue entry\0";

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

    /// The MAC of `message` as it stands.
    fn sign(&self, message: &Message) -> [u8; 32] {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(CONTEXT);
        ctx.update(&message.encode_plain());
        let tag = ctx.sign();
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Whether `mac` is the MAC of `message` (in constant time).
    fn verify(&self, message: &Message, mac: &[u8; 32]) -> bool {
        let mut signed = CONTEXT.to_vec();
        signed.extend_from_slice(&message.encode_plain());
        hmac::verify(&self.0, &signed, mac).is_ok()
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
/// not handed out. An entry with no MAC (queued by an earlier version) is
/// handed out only with [`accept_unsigned`](Self::accept_unsigned) on.
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
    name: Arc<str>,
}

impl<Q: Queue> Sealed<Q> {
    /// `inner` sealed with `key`; `name` labels its metric and warnings.
    pub fn new(inner: Q, key: QueueKey, name: &str) -> Self {
        Self {
            inner,
            key,
            accept_unsigned: false,
            name: Arc::from(name),
        }
    }

    /// Hands out entries with no MAC (queued by a version that did not seal
    /// them), as before, while an upgrade drains them. Defaults to `false`:
    /// they are dead-lettered as [`UNAUTHENTICATED`] (replay them once this
    /// is on).
    pub fn accept_unsigned(mut self, accept: bool) -> Self {
        self.accept_unsigned = accept;
        self
    }

    /// The queue underneath.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    /// Whether `message` may be delivered.
    fn holds(&self, message: &Message) -> bool {
        match &message.mac {
            Some(mac) => self.key.verify(message, mac),
            None => self.accept_unsigned,
        }
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
            name,
        } = self;
        match inner {
            ::either::Either::Left(inner) => ::either::Either::Left(Sealed {
                inner,
                key,
                accept_unsigned,
                name,
            }),
            ::either::Either::Right(inner) => ::either::Either::Right(Sealed {
                inner,
                key,
                accept_unsigned,
                name,
            }),
        }
    }
}

impl<Q: super::Park> super::Park for Sealed<Q> {
    fn parks(&self) -> bool {
        self.inner.parks()
    }

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
    async fn ingest(&self, mut message: Message) -> Result<Ingested, QueueError> {
        message.mac = None;
        message.mac = Some(self.key.sign(&message));
        self.inner.ingest(message).await
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        let mut got = self.inner.fetch(max, lease).await?;
        let mut refused = Vec::new();
        got.retain(|d| {
            let holds = self.holds(&d.message);
            if !holds {
                refused.push(d.clone());
            }
            holds
        });
        for d in refused {
            self.refused(&d);
            if let Err(_e) = self.inner.dead_letter(&d, UNAUTHENTICATED).await {
                // Its lease runs out and it is fetched, and checked, again.
                crate::log_warn!(queue = %self.name, entry = %d.id, error = %_e, "cannot dead-letter an unauthenticated entry; it is checked again after its lease");
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

    fn replay(&self, id: &EntryId) -> impl Future<Output = Result<bool, QueueError>> + Send {
        self.inner.replay(id)
    }

    fn replay_all(&self) -> impl Future<Output = Result<usize, QueueError>> + Send {
        self.inner.replay_all()
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
        ] {
            let mut changed = back.clone();
            change(&mut changed);
            assert!(!key.verify(&changed, changed.mac.as_ref().unwrap()));
        }
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
