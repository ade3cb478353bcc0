//! [`Store`] for [`Either`]: a program that picks its store at run time.
//!
//! ```
//! use either::Either;
//! use std::time::Duration;
//! use tower_idempotency::store::{Claim, MemoryStore, OwnerToken, Store};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // Memory here; `Either::Right(RedisStore::standalone(url).await?)` when
//! // a Redis URL is configured.
//! let store: Either<MemoryStore, MemoryStore> = Either::Left(MemoryStore::new());
//! let claim = store
//!     .claim("k", Fingerprint::of(b"x"), OwnerToken::new(), Duration::from_secs(5))
//!     .await
//!     .unwrap();
//! assert!(matches!(claim, Claim::Acquired(_)));
//! # }
//! ```
//!
//! `Either` keeps the calls static (no boxed future, no allocation per
//! call) for a choice between two stores. For a choice among more (Redis,
//! Redis Cluster, SQL, tiered), [`BoxStore`](super::BoxStore) is one type
//! for all of them.
//!
//! An `Either`'s call futures are as large as its larger side's. When one
//! side is the memory store and the other a network store, box the network
//! side (`Either<MemoryStore, BoxStore>`): the memory store's calls then
//! stay small, and each network call pays one allocation.

use super::{
    Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Position, RecordState, Store,
    StoreError,
};
use crate::Fingerprint;
use ::either::Either;
use std::sync::Arc;
use std::time::Duration;

impl<A: Store, B: Store> Store for Either<A, B> {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        match self {
            Either::Left(s) => s.claim(key, fingerprint, token, lease).await,
            Either::Right(s) => s.claim(key, fingerprint, token, lease).await,
        }
    }

    async fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        match self {
            Either::Left(s) => s.claim_unwatched(key, fingerprint, token, lease).await,
            Either::Right(s) => s.claim_unwatched(key, fingerprint, token, lease).await,
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Either::Left(s) => s.complete(key, token, record, window).await,
            Either::Right(s) => s.complete(key, token, record, window).await,
        }
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Either::Left(s) => s.renew(key, token, lease).await,
            Either::Right(s) => s.renew(key, token, lease).await,
        }
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        match self {
            Either::Left(s) => s.release(key, token).await,
            Either::Right(s) => s.release(key, token).await,
        }
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        match self {
            Either::Left(s) => s.put_token(key, ttl).await,
            Either::Right(s) => s.put_token(key, ttl).await,
        }
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        match self {
            Either::Left(s) => s.take_token(key, owner).await,
            Either::Right(s) => s.take_token(key, owner).await,
        }
    }

    async fn inspect(&self, key: &str) -> Result<RecordState, StoreError> {
        match self {
            Either::Left(a) => a.inspect(key).await,
            Either::Right(b) => b.inspect(key).await,
        }
    }

    async fn forget(&self, key: &str) -> Result<Forgotten, StoreError> {
        match self {
            Either::Left(a) => a.forget(key).await,
            Either::Right(b) => b.forget(key).await,
        }
    }

    async fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Either::Left(a) => a.replace(key, record, window).await,
            Either::Right(b) => b.replace(key, record, window).await,
        }
    }

    async fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> Result<Advance, StoreError> {
        match self {
            Either::Left(a) => a.advance(object, position, ttl).await,
            Either::Right(b) => b.advance(object, position, ttl).await,
        }
    }

    async fn position(&self, object: &str) -> Result<Option<Position>, StoreError> {
        match self {
            Either::Left(a) => a.position(object).await,
            Either::Right(b) => b.position(object).await,
        }
    }
}
