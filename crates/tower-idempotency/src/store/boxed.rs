//! [`BoxedCalls`]: a store whose calls' futures live on the heap, so that
//! the futures awaiting them stay small.

use super::{Claim, CompletedRecord, Forgotten, OwnerToken, RecordState, Store, StoreError};
use crate::Fingerprint;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A [`Store`] that boxes the future of each call of the store it wraps,
/// and otherwise is that store: every call, the defaulted ones included
/// (an atomic [`replace`](Store::replace) stays atomic), goes to it. Clones
/// share the wrapped store: it is kept behind an `Arc`, so that an `Either`
/// of it and the memory store (cloned into every request) is two words
/// wide, not as wide as a Redis or SQL store.
///
/// A future that awaits a store call holds that call's future inline, and
/// an [`Either`](super::Either) store's future is as large as its largest
/// side's: a choice between the memory store and Redis or SQL would make
/// every request's future as large as a network call's (kilobytes), even
/// when the memory store answers. `Either<MemoryStore,
/// BoxedCalls<RedisStore>>` keeps the memory store's calls inline and
/// small, and gives each network call one allocation, next to which its
/// round trip is long.
///
/// ```
/// use either::Either;
/// use std::time::Duration;
/// use tower_idempotency::store::{BoxedCalls, Claim, MemoryStore, OwnerToken, Store};
/// use tower_idempotency::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // `Either::Right(BoxedCalls::new(RedisStore::standalone(url).await?))`
/// // when a Redis URL is configured.
/// let store: Either<MemoryStore, BoxedCalls<MemoryStore>> = Either::Left(MemoryStore::new());
/// let claim = store
///     .claim("k", Fingerprint::of(b"x"), OwnerToken::new(), Duration::from_secs(5))
///     .await
///     .unwrap();
/// assert!(matches!(claim, Claim::Acquired(_)));
/// # }
/// ```
#[derive(Debug)]
pub struct BoxedCalls<S>(Arc<S>);

impl<S> Clone for BoxedCalls<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S> BoxedCalls<S> {
    /// Wraps `store`.
    pub fn new(store: S) -> Self {
        Self(Arc::new(store))
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.0
    }

    /// Unwraps the store (a clone of it while other clones of `self` live).
    pub fn into_inner(self) -> S
    where
        S: Clone,
    {
        Arc::try_unwrap(self.0).unwrap_or_else(|shared| (*shared).clone())
    }
}

impl<S: Store> Store for BoxedCalls<S> {
    fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        Box::pin(self.0.claim(key, fingerprint, token, lease))
    }

    fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.0.complete(key, token, record, window))
    }

    fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.0.renew(key, token, lease))
    }

    fn release(
        &self,
        key: &str,
        token: OwnerToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.0.release(key, token))
    }

    fn put_token(
        &self,
        key: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        Box::pin(self.0.put_token(key, ttl))
    }

    fn take_token(
        &self,
        key: &str,
        owner: OwnerToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.0.take_token(key, owner))
    }

    fn inspect(&self, key: &str) -> impl Future<Output = Result<RecordState, StoreError>> + Send {
        Box::pin(self.0.inspect(key))
    }

    fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.0.replace(key, record, window))
    }

    fn forget(&self, key: &str) -> impl Future<Output = Result<Forgotten, StoreError>> + Send {
        Box::pin(self.0.forget(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    /// Every call reaches the wrapped store, the defaulted ones too.
    #[tokio::test]
    async fn every_call_goes_to_the_wrapped_store() {
        let store = BoxedCalls::new(MemoryStore::new());
        let fp = Fingerprint::of(b"x");
        let token = OwnerToken::new();
        let lease = Duration::from_secs(5);
        assert!(matches!(
            store.claim("k", fp, token, lease).await.unwrap(),
            Claim::Acquired(_)
        ));
        assert!(store.renew("k", token, lease).await.unwrap());
        let record = Arc::new(CompletedRecord {
            fingerprint: fp,
            response: crate::store::StoredResponse {
                status: http::StatusCode::OK,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::from_static(b"ok"),
                trailers: None,
                body_omitted: false,
            },
        });
        let window = Duration::from_secs(60);
        assert!(store
            .complete("k", token, record.clone(), window)
            .await
            .unwrap());
        assert!(matches!(
            store.get_ref().inspect("k").await.unwrap(),
            RecordState::Completed { .. }
        ));
        assert!(store.replace("k", record, window).await.unwrap());
        assert_eq!(store.forget("k").await.unwrap(), Forgotten::Deleted);
        assert!(!store.release("k", token).await.unwrap());
        store.put_token("t", window).await.unwrap();
        assert!(store.take_token("t", OwnerToken::new()).await.unwrap());
    }
}
