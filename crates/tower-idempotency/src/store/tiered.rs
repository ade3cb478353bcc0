//! Two stores in tiers: a fast one in front (Redis: claims, waiters, replays)
//! and a durable one behind (a SQL database), which decides every claim.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{Claim, MemoryStore, OwnerToken, Store, TieredStore};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // In production: TieredStore::new(RedisStore::standalone(..).await?, SqlStore::connect(..).await?)
//! let (front, back) = (MemoryStore::new(), MemoryStore::new());
//! let store = TieredStore::new(front, back.clone());
//! let fp = Fingerprint::of(b"x");
//! let token = OwnerToken::new();
//! assert!(matches!(store.claim("k", fp, token, Duration::from_secs(5)).await.unwrap(), Claim::Acquired(_)));
//! // The claim is held behind too.
//! assert!(matches!(back.claim("k", fp, OwnerToken::new(), Duration::from_secs(5)).await.unwrap(), Claim::InFlight { .. }));
//! # }
//! ```

use super::{
    Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Position, RecordState, Store,
    StoreError,
};
use crate::Fingerprint;
use std::sync::Arc;
use std::time::Duration;

/// A [`Store`] in two tiers: `front` (Redis) in front, `back` (a
/// `SqlStore` (crate `tower-idempotency-sqlx`)) behind.
///
/// - **claim**: in front first. A completed record there is replayed and a
///   claim in flight there is waited on (the front's watch), without touching
///   the back. When the front lets the caller claim (the key is new to it,
///   or the front lost its data), the claim is made in the back too, with the
///   same owner token, and the back decides: a record completed there is
///   replayed, a claim in flight there is waited on (the back's watch). So a Redis restarted without persistence runs nothing twice: its
///   misses are answered from the database.
/// - **fencing tokens** are the back's: the claim that wins is the back's,
///   and so is its token (`SqlStore` (crate `tower-idempotency-sqlx`): the row's
///   fence, kept in the database), so the tokens of a key keep growing when
///   Redis restarts without its data or is down.
/// - **complete**: in the back first (durable), then in the front; the
///   back's answer counts. **renew**, **release**: both; the back's answer
///   counts. Client tokens and objects' positions
///   ([`advance`](Store::advance)) live in the back, which decides every
///   compare-and-set.
/// - When the front fails (Redis down), every call goes to the back alone,
///   which stays correct: every claim that wins has won in the back.
///
/// A first delivery costs the front's claim and completion plus the back's;
/// a repeat costs the front's claim alone.
#[derive(Clone, Debug)]
pub struct TieredStore<F, B> {
    front: F,
    back: B,
}

impl<F: Store, B: Store> TieredStore<F, B> {
    /// `front` in front of `back`.
    pub const fn new(front: F, back: B) -> Self {
        Self { front, back }
    }

    /// The front store.
    pub fn front(&self) -> &F {
        &self.front
    }

    /// The back store.
    pub fn back(&self) -> &B {
        &self.back
    }
}

impl<F: Store, B: Store> TieredStore<F, B> {
    /// A claim in front, then behind; `watched`: as
    /// [`claim`](Store::claim), else as [`claim_unwatched`](Store::claim_unwatched).
    async fn claim_in(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
        watched: bool,
    ) -> Result<Claim, StoreError> {
        let front = match watched {
            true => self.front.claim(key, fingerprint, token, lease).await,
            false => {
                self.front
                    .claim_unwatched(key, fingerprint, token, lease)
                    .await
            }
        };
        let front_held = match front {
            Ok(Claim::Acquired(_)) => true,
            Ok(other) => return Ok(other),
            // The front is down: the back alone decides.
            Err(_) => false,
        };
        let back = match watched {
            true => self.back.claim(key, fingerprint, token, lease).await,
            false => {
                self.back
                    .claim_unwatched(key, fingerprint, token, lease)
                    .await
            }
        };
        if front_held && !matches!(back, Ok(Claim::Acquired(_))) {
            // Completed or in flight behind (the front lost its data, or
            // the record outlived the front's copy), or the back failed:
            // the front's claim goes. The back does not say how much of its
            // window a record has left, so it is not copied to the front.
            let _ = self.front.release(key, token).await;
        }
        back
    }
}

impl<F: Store, B: Store> Store for TieredStore<F, B> {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, true).await
    }

    async fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, false).await
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let done = self
            .back
            .complete(key, token, record.clone(), window)
            .await?;
        if done {
            let _ = self.front.complete(key, token, record, window).await;
        } else {
            let _ = self.front.release(key, token).await;
        }
        Ok(done)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (front, back) = tokio::join!(
            self.front.renew(key, token, lease),
            self.back.renew(key, token, lease)
        );
        let _ = front;
        back
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        // The back first: a waiter woken by the front's release must find
        // the key free behind too.
        let back = self.back.release(key, token).await;
        let _ = self.front.release(key, token).await;
        back
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        self.back.put_token(key, ttl).await
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        self.back.take_token(key, owner).await
    }

    /// The back's state (the durable one), or the front's claim in flight
    /// when the back has none (a claim is made in front first).
    async fn inspect(&self, key: &str) -> Result<RecordState, StoreError> {
        match self.back.inspect(key).await? {
            RecordState::Absent => match self.front.inspect(key).await {
                Ok(state @ RecordState::InFlight { .. }) => Ok(state),
                _ => Ok(RecordState::Absent),
            },
            state => Ok(state),
        }
    }

    /// Both tiers; a key in flight in either is left alone. A tier that
    /// fails makes `forget` fail (after the other may have forgotten): a
    /// record left in either tier would still be replayed, so `Deleted` is
    /// answered only when neither holds it any more. Forgetting again once
    /// both answer finishes the job.
    async fn forget(&self, key: &str) -> Result<Forgotten, StoreError> {
        if let RecordState::InFlight { .. } = self.front.inspect(key).await? {
            return Ok(Forgotten::InFlight);
        }
        let back = self.back.forget(key).await?;
        if back == Forgotten::InFlight {
            return Ok(back);
        }
        let front = self.front.forget(key).await?;
        Ok(if front == Forgotten::Deleted {
            Forgotten::Deleted
        } else {
            back
        })
    }

    /// In the back first (it decides), then in the front; the back's
    /// answer counts. Each tier replaces in one step, so a claim in either
    /// finds the old record or the new one, never the key absent (a front
    /// that does not hold it sends the claim to the back, which does).
    async fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        if !self.back.replace(key, record.clone(), window).await? {
            return Ok(false);
        }
        self.front.replace(key, record, window).await?;
        Ok(true)
    }

    async fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> Result<Advance, StoreError> {
        self.back.advance(object, position, ttl).await
    }

    async fn position(&self, object: &str) -> Result<Option<Position>, StoreError> {
        self.back.position(object).await
    }
}
