//! Where records live: the [`Store`] trait, its records and errors, and the
//! parts a store builds on.
//!
//! A record goes through this life cycle:
//!
//! ```text
//! absent ──claim──▶ in-flight{owner, fingerprint, lease} ──complete──▶ completed{fingerprint, response}
//!                      ├─ release (owner only) ──▶ absent
//!                      └─ lease expired ──▶ claimable again
//! ```
//!
//! Every operation but `claim` is checked against the owner token, so an owner
//! whose lease ran out can never overwrite or delete a newer owner's record.
//!
//! Beside the records, a store keeps the applied [`Position`] of an object
//! (a payment, an order) for a layer that lets an object's state only move
//! forward: [`Store::advance`] moves it in one compare-and-set, never back.
//!
//! The memory store of the layers crate
//! ([`MemoryStore`](https://docs.rs/tower-idempotency/latest/tower_idempotency/store/struct.MemoryStore.html))
//! shows the life cycle in its documentation; every store passes the
//! conformance suite of `testing` (feature `testing`).

mod active;
mod boxed;
pub mod codec;
mod completed;
mod either;
mod error;
mod fence;
mod pollers;
mod position;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod watch;

/// Two stores, one picked at run time, are a [`Store`] (re-exported from the
/// [`either`](https://docs.rs/either) crate).
pub use ::either::Either;
pub use active::ActiveClaim;
pub use boxed::BoxStore;
pub use completed::Completed as CompletedCache;
pub use error::{StoreError, StoreErrorKind};
pub use fence::{fence_floor, Ownership};
pub use pollers::{Poller, Pollers};
pub use position::{Advance, Position};
pub use watch::{Watch, WatchSender};

use crate::Fingerprint;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The token that identifies the owner of an in-flight claim.
///
/// Unique per claim attempt: 64 random bits per process and a 64-bit counter.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(u128);

impl OwnerToken {
    /// A fresh token, distinct from every other token of this process and,
    /// with overwhelming probability, of every other process.
    pub fn new() -> Self {
        static PROCESS: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(1);
        let process = *PROCESS.get_or_init(|| {
            let mut buf = [0u8; 8];
            // Falls back to the time and pid if the OS has no randomness to give.
            if getrandom::fill(&mut buf).is_err() {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                buf = (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
            }
            u64::from_le_bytes(buf)
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Self((u128::from(process) << 64) | u128::from(n))
    }

    /// The token as a number, for stores that persist it.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// Rebuilds a token from [`as_u128`](Self::as_u128).
    pub const fn from_u128(v: u128) -> Self {
        Self(v)
    }
}

impl Default for OwnerToken {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({:032x})", self.0)
    }
}

/// A response as it was first answered, kept for replay.
///
/// Built with [`new`](Self::new) (fields may be added: it is
/// `#[non_exhaustive]`), read by its fields.
///
/// ```
/// use bytes::Bytes;
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::store::StoredResponse;
///
/// let r = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::from_static(b"ok"));
/// assert_eq!(r.body, "ok");
/// let omitted = r.with_body_omitted(true);
/// assert!(omitted.body.is_empty() && omitted.body_omitted);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers, without hop-by-hop headers.
    pub headers: HeaderMap,
    /// The body. Empty when [`body_omitted`](Self::body_omitted) is set.
    pub body: Bytes,
    /// Trailers, if the response had any (gRPC's `grpc-status` lives here).
    pub trailers: Option<HeaderMap>,
    /// The body was larger than the cache limit and was not kept: a replay
    /// answers the status and headers with an empty body and the header
    /// `idempotent-body-omitted: true`.
    pub body_omitted: bool,
}

impl StoredResponse {
    /// A response of `status`, `headers` and `body`, without trailers.
    pub fn new(status: StatusCode, headers: HeaderMap, body: Bytes) -> Self {
        Self {
            status,
            headers,
            body,
            trailers: None,
            body_omitted: false,
        }
    }

    /// With these trailers (`None`: none).
    #[must_use]
    pub fn with_trailers(mut self, trailers: Option<HeaderMap>) -> Self {
        self.trailers = trailers;
        self
    }

    /// With its body omitted (`true`: the body is dropped, see
    /// [`body_omitted`](Self::body_omitted)) or kept.
    #[must_use]
    pub fn with_body_omitted(mut self, omitted: bool) -> Self {
        if omitted {
            self.body = Bytes::new();
        }
        self.body_omitted = omitted;
        self
    }
}

/// A completed record: the first success and the fingerprint of its request.
///
/// Built with [`new`](Self::new) (`#[non_exhaustive]`), read by its fields.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CompletedRecord {
    /// Fingerprint of the request that produced the response.
    pub fingerprint: Fingerprint,
    /// The response to replay.
    pub response: StoredResponse,
}

impl CompletedRecord {
    /// The record of `response`, answered to a request of `fingerprint`.
    pub fn new(fingerprint: Fingerprint, response: StoredResponse) -> Self {
        Self {
            fingerprint,
            response,
        }
    }
}

/// What a store holds for one key, as [`Store::inspect`] finds it: for
/// operators (`gateway inspect`), never on a request's path.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum RecordState {
    /// Nothing: the next request with this key runs the inner service.
    Absent,
    /// Claimed by a request that is still running.
    InFlight {
        /// The fingerprint of the owner's request.
        fingerprint: Fingerprint,
        /// How long ago the owner claimed it, where the store knows.
        age: Option<Duration>,
        /// How long until the owner's lease runs out (unless renewed).
        lease_left: Duration,
    },
    /// The first success, replayed to every copy until its window ends.
    Completed {
        /// The record.
        record: Arc<CompletedRecord>,
        /// How long until the window ends.
        left: Duration,
    },
}

/// What [`Store::forget`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Forgotten {
    /// The completed record was deleted: the next copy runs again.
    Deleted,
    /// There was no record.
    Absent,
    /// The key is in flight: nothing was deleted (its owner decides).
    InFlight,
}

/// What a claim found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Claim {
    /// The caller now owns the key: run the inner service. Carries the
    /// owner token and the claim's fencing token.
    Acquired(Ownership),
    /// Someone else is running it.
    InFlight {
        /// Fingerprint of the request that is running.
        fingerprint: Fingerprint,
        /// Resolves when the record may have changed.
        watch: Watch,
    },
    /// It already succeeded; replay it.
    Completed(Arc<CompletedRecord>),
}

/// The storage behind the dedup layer.
///
/// Cheap to clone (an `Arc` inside). Implementations must make
/// [`claim`](Self::claim) atomic and check the owner token in
/// [`complete`](Self::complete), [`renew`](Self::renew) and
/// [`release`](Self::release) (compare-and-set / compare-and-delete).
/// The conformance suite of `store::testing` (feature `testing`) checks
/// these rules; the stores of this family all run it, and a store of your
/// own can.
pub trait Store: Clone + Send + Sync + 'static {
    /// Atomically: if `key` is absent (or its lease ran out), claim it for
    /// `token` with a lease of `lease`; otherwise return what is there.
    fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// [`claim`](Self::claim) for a caller that never waits on the key (a
    /// lease taken as a lock, tried again later if taken): the same answer,
    /// but an in-flight answer's [`Watch`] starts nothing in the store (no
    /// poller of the backend) and only tells to look again after a while.
    /// Defaults to [`claim`](Self::claim).
    fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.claim(key, fingerprint, token, lease)
    }

    /// Turns `token`'s claim into a completed record kept for `window`.
    /// Returns `false` when `token` no longer owns the key (its lease ran out
    /// and another owner claimed it); the record is then left alone.
    fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends `token`'s lease to `lease` from now. `false` if it lost the key.
    fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes `token`'s claim so that the next request runs the inner service.
    /// `false` if `token` did not own the key.
    fn release(
        &self,
        key: &str,
        token: OwnerToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Stores a one-time client token (see the layers crate's
    /// [`IssueToken`](https://docs.rs/tower-idempotency/latest/tower_idempotency/token/struct.IssueToken.html))
    /// for `ttl`. The default answers [`StoreErrorKind::Unsupported`].
    fn put_token(
        &self,
        key: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (key, ttl);
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store does not keep client tokens",
        )))
    }

    /// Atomically consumes a token for the request that owns `owner`'s
    /// claim: `true` if it existed, had not expired and was not consumed by
    /// another request, so exactly one request can consume it. The same
    /// request taking it again (a resent call) gets `true` again. A token
    /// stored again with [`put_token`](Self::put_token) (given back) can be
    /// consumed afresh. The default answers [`StoreErrorKind::Unsupported`].
    fn take_token(
        &self,
        key: &str,
        owner: OwnerToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (key, owner);
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store does not keep client tokens",
        )))
    }

    /// What the store holds for `key`, without changing it (a completed
    /// record read here does not count as a use). For operators: it is
    /// never called on a request's path. The default answers
    /// [`StoreErrorKind::Unsupported`].
    fn inspect(&self, key: &str) -> impl Future<Output = Result<RecordState, StoreError>> + Send {
        let _ = key;
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot be inspected",
        )))
    }

    /// Replaces the completed record of `key` with `record`, kept for
    /// `window` from now, so that a record changing state (a queue's key
    /// record going from "queued" to "delivered") never leaves the key
    /// absent in between. `false`, and nothing changed, when the key holds
    /// no completed record (absent, its window over, or in flight: a claim
    /// is left to its owner).
    ///
    /// The memory, Redis and SQL stores do it in one atomic step. The
    /// default is three calls ([`forget`](Self::forget), [`claim`](Self::claim),
    /// [`complete`](Self::complete)): a claim by another caller can slip in
    /// between the first two, and then this answers `false` and that
    /// caller's outcome stands.
    fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async move {
            if self.forget(key).await? != Forgotten::Deleted {
                return Ok(false);
            }
            let token = OwnerToken::new();
            match self
                .claim(key, record.fingerprint, token, Duration::from_secs(10))
                .await?
            {
                Claim::Acquired(_) => self.complete(key, token, record, window).await,
                _ => Ok(false),
            }
        }
    }

    /// Deletes the completed record of `key`, so that the next copy runs
    /// the inner service again (after a business rollback, say). Atomic: a
    /// key in flight is left to its owner and answers
    /// [`Forgotten::InFlight`]. The default answers
    /// [`StoreErrorKind::Unsupported`].
    fn forget(&self, key: &str) -> impl Future<Output = Result<Forgotten, StoreError>> + Send {
        let _ = key;
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot forget records",
        )))
    }

    /// Atomically: moves the applied position of `object` to `position` if
    /// `position` is ahead of it (or the store keeps none for `object`), and
    /// keeps it at least `ttl` from now; otherwise changes nothing and
    /// answers [`Advance::Behind`] with the position kept. An equal
    /// position is behind: of many concurrent advances of one object, only
    /// strictly increasing ones are accepted.
    ///
    /// `object` names an object, not a record: positions live beside the
    /// records, and an object's name never collides with a record's key.
    /// The default answers [`StoreErrorKind::Unsupported`].
    fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> impl Future<Output = Result<Advance, StoreError>> + Send {
        let _ = (object, position, ttl);
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store does not keep positions",
        )))
    }

    /// The applied position of `object`, if the store keeps one (none
    /// after its time to live ended). The default answers
    /// [`StoreErrorKind::Unsupported`].
    fn position(
        &self,
        object: &str,
    ) -> impl Future<Output = Result<Option<Position>, StoreError>> + Send {
        let _ = object;
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store does not keep positions",
        )))
    }
}
