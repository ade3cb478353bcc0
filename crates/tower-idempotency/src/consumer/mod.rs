//! Idempotent message consumers: run a handler at most once per message key.
//!
//! Queues redeliver: a worker killed before it acknowledged, a lease that ran
//! out, a dead letter replayed. [`Consumer::once`] runs the handler for a key
//! only if no earlier delivery of it succeeded, with the same store and the
//! same guarantees as the HTTP [dedup layer](crate::dedup): an atomic claim,
//! a lease renewed every `lease/3` while the handler runs, an owner-checked
//! completion, failures and panics never recorded (the claim is released, so
//! the next delivery runs again). [`ConsumerLayer`] does the same as a tower
//! layer over any message type. The `tower-idempotency-queue` crate has the
//! same for a RabbitMQ or NATS JetStream subscription (`AmqpConsumer`,
//! `JetStreamConsumer`), settling each message.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use tower_idempotency::consumer::{Consumer, Once};
//! use tower_idempotency::store::MemoryStore;
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let consumer = Consumer::new(MemoryStore::new()).scope("credit-points");
//! let credited = AtomicUsize::new(0);
//! let fp = Fingerprint::of(b"order 42, 100 points");
//! for _ in 0..3 {
//!     let once = consumer
//!         .once("order-42", fp, async {
//!             let n = credited.fetch_add(100, Ordering::SeqCst) + 100;
//!             Ok::<_, std::io::Error>(format!("balance {n}"))
//!         })
//!         .await
//!         .unwrap();
//!     // The first delivery ran; the copies get its receipt back.
//!     assert_eq!(once.into_inner(), "balance 100");
//! }
//! assert_eq!(credited.load(Ordering::SeqCst), 100);
//! # }
//! ```
//!
//! As a tower layer, keyed by a closure:
//!
//! ```
//! use tower::{service_fn, ServiceExt};
//! use tower_idempotency::consumer::{Consumer, ConsumerLayer, Once};
//! use tower_idempotency::store::MemoryStore;
//! use tower_idempotency::Fingerprint;
//! use tower_layer::Layer;
//!
//! struct Paid { id: String, amount: u64 }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let key = |m: &Paid| Some((m.id.clone(), Fingerprint::of(&m.amount.to_le_bytes())));
//! let layer = ConsumerLayer::new(Consumer::new(MemoryStore::new()), key);
//! let svc = layer.layer(service_fn(|m: Paid| async move {
//!     Ok::<_, std::convert::Infallible>(format!("credited {}", m.amount))
//! }));
//! let first = svc.clone().oneshot(Paid { id: "tx-1".into(), amount: 5 }).await.unwrap();
//! let copy = svc.oneshot(Paid { id: "tx-1".into(), amount: 5 }).await.unwrap();
//! assert!(first.ran() && !copy.ran());
//! assert_eq!(copy.into_inner(), "credited 5");
//! # }
//! ```
//!
//! An instance that dies while its handler talks to a remote system cannot
//! know whether that system acted: after the lease, the next delivery runs
//! again. Keep a unique index in the business database as the backstop.

mod disposition;
mod lease;
pub(crate) use lease::{timed, Held};
mod once;
mod service;

pub use disposition::{Disposition, Failure};
pub use once::Consumer;
pub use service::{ConsumeFuture, ConsumeOnce, ConsumerLayer, MessageKey};

use crate::store::StoreError;
use bytes::Bytes;
use std::fmt;

/// What a consumer keeps of a handler's success, to hand to later copies.
///
/// Implemented for `()` (nothing kept), [`Bytes`], `Vec<u8>` and `String`.
/// Implement it for your own type to keep more (serialize it, for example
/// as JSON). Keep it small: it is stored for the whole window.
pub trait Receipt: Sized {
    /// The bytes to store.
    fn encode(&self) -> Bytes;
    /// Rebuilds the value from [`encode`](Self::encode)'s bytes; `None` if
    /// they cannot be read.
    fn decode(bytes: Bytes) -> Option<Self>;
}

impl Receipt for () {
    fn encode(&self) -> Bytes {
        Bytes::new()
    }
    fn decode(_: Bytes) -> Option<Self> {
        Some(())
    }
}

impl Receipt for Bytes {
    fn encode(&self) -> Bytes {
        // Copied: a slice of a larger buffer would keep it alive.
        Bytes::copy_from_slice(self)
    }
    fn decode(bytes: Bytes) -> Option<Self> {
        Some(bytes)
    }
}

impl Receipt for Vec<u8> {
    fn encode(&self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
    fn decode(bytes: Bytes) -> Option<Self> {
        Some(bytes.to_vec())
    }
}

impl Receipt for String {
    fn encode(&self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
    fn decode(bytes: Bytes) -> Option<Self> {
        String::from_utf8(bytes.to_vec()).ok()
    }
}

/// Whether the handler ran for this delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once<T> {
    /// The handler ran now and succeeded; its result.
    Ran(T),
    /// An earlier delivery already succeeded; its stored receipt.
    Done(T),
}

impl<T> Once<T> {
    /// Whether the handler ran for this delivery.
    pub fn ran(&self) -> bool {
        matches!(self, Self::Ran(_))
    }

    /// The result, fresh or stored.
    pub fn into_inner(self) -> T {
        match self {
            Self::Ran(t) | Self::Done(t) => t,
        }
    }
}

/// Why a message was not handled. Nothing is recorded: a later delivery
/// runs the handler again (unless [`is_retryable`](Self::is_retryable) says
/// it never will succeed).
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError<E> {
    /// The handler failed; its claim was released.
    Handler(E),
    /// The handler panicked; its claim was released.
    Panicked,
    /// Another delivery of this key is running now (of this message, or of
    /// one with another fingerprint, which may yet fail and free the key);
    /// retry later.
    InFlight,
    /// The key was used before by a message with another fingerprint, which
    /// succeeded: never run, never replayed (possible tampering).
    Mismatch,
    /// The message had no key.
    KeyMissing,
    /// The stored receipt could not be decoded by [`Receipt::decode`].
    CorruptReceipt,
    /// The handler ran past the consumer's run limit
    /// ([`Consumer::max_run`]): it was cancelled and its claim released.
    RunLimit,
    /// The store failed or timed out.
    Store(StoreError),
}

impl<E> ConsumeError<E> {
    /// Whether a later delivery may succeed: `false` for
    /// [`Mismatch`](Self::Mismatch), [`KeyMissing`](Self::KeyMissing) and
    /// [`CorruptReceipt`](Self::CorruptReceipt), which a queue should
    /// dead-letter at once.
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            Self::Mismatch | Self::KeyMissing | Self::CorruptReceipt
        )
    }
}

/// A queue's worker dead-letters what can never succeed at once, and
/// settles a handler's failure as the handler's error says.
impl<E: Failure> Failure for ConsumeError<E> {
    fn disposition(&self) -> Disposition {
        match self {
            Self::Handler(e) => e.disposition(),
            _ if !self.is_retryable() => Disposition::Permanent,
            _ => Disposition::Retry,
        }
    }
}

impl<E: fmt::Display> fmt::Display for ConsumeError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "message handler failed: {e}"),
            Self::Panicked => f.write_str("message handler panicked"),
            Self::InFlight => f.write_str("another delivery of this message is running"),
            Self::Mismatch => f.write_str("message key reused with a different payload"),
            Self::KeyMissing => f.write_str("message has no key"),
            Self::CorruptReceipt => f.write_str("stored receipt could not be decoded"),
            Self::RunLimit => f.write_str("message handler ran past the run limit"),
            Self::Store(e) => write!(f, "idempotency store failed: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for ConsumeError<E> {}
