//! [`BoxStore`]: any store behind one type, picked at run time, with its
//! calls' futures on the heap.

use super::{
    Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Position, RecordState, Store,
    StoreError,
};
use crate::Fingerprint;
use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// A boxed future of a store call.
type Call<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A [`Store`] of a type chosen at run time (by a command line or a
/// configuration file), as tower's `BoxCloneService` is a service: one
/// type whatever the store behind it, so that a program does not spell a
/// nested `Either` of every store it can open.
///
/// Every call, the defaulted ones included (an atomic
/// [`replace`](Store::replace) stays atomic), goes to the wrapped store.
/// Clones share it (it is kept behind an `Arc`), and each call's future is
/// boxed: one allocation per call, next to which a network store's round
/// trip is long.
///
/// The boxing also keeps the futures that await a store call small. A
/// future holds the future of the call it awaits inline, and an
/// [`Either`](super::Either) store's future is as large as its larger
/// side's: `Either<MemoryStore, RedisStore>` would make every request's
/// future as large as a network call's (kilobytes), even when the memory
/// store answers. `Either<MemoryStore, BoxStore>` keeps the memory store's
/// calls inline and small, and is two words wide.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::store::{BoxStore, Claim, MemoryStore, OwnerToken, Store, TieredStore};
/// use tower_idempotency::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // Which store is configured is known only at run time.
/// let tiered = std::env::var_os("TIERED").is_some();
/// let store = if tiered {
///     BoxStore::new(TieredStore::new(MemoryStore::new(), MemoryStore::new()))
/// } else {
///     BoxStore::new(MemoryStore::new())
/// };
/// let claim = store
///     .claim("k", Fingerprint::of(b"x"), OwnerToken::new(), Duration::from_secs(5))
///     .await
///     .unwrap();
/// assert!(matches!(claim, Claim::Acquired(_)));
/// // The store behind it, by its type.
/// assert_eq!(store.downcast_ref::<MemoryStore>().is_some(), !tiered);
/// # }
/// ```
#[derive(Clone)]
pub struct BoxStore(Arc<dyn DynStore>);

impl BoxStore {
    /// Wraps `store`.
    pub fn new<S: Store>(store: S) -> Self {
        Self(Arc::new(store))
    }

    /// The wrapped store, if it is an `S`.
    pub fn downcast_ref<S: Store>(&self) -> Option<&S> {
        self.0.as_any().downcast_ref()
    }
}

impl fmt::Debug for BoxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BoxStore")
            .field(&self.0.type_name())
            .finish()
    }
}

/// [`Store`] with boxed futures, which a trait object can have.
trait DynStore: Send + Sync + 'static {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Call<'a, Claim>;
    fn claim_unwatched<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Call<'a, Claim>;
    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Call<'a, bool>;
    fn renew<'a>(&'a self, key: &'a str, token: OwnerToken, lease: Duration) -> Call<'a, bool>;
    fn release<'a>(&'a self, key: &'a str, token: OwnerToken) -> Call<'a, bool>;
    fn put_token<'a>(&'a self, key: &'a str, ttl: Duration) -> Call<'a, ()>;
    fn take_token<'a>(&'a self, key: &'a str, owner: OwnerToken) -> Call<'a, bool>;
    fn inspect<'a>(&'a self, key: &'a str) -> Call<'a, RecordState>;
    fn replace<'a>(
        &'a self,
        key: &'a str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Call<'a, bool>;
    fn forget<'a>(&'a self, key: &'a str) -> Call<'a, Forgotten>;
    fn advance<'a>(
        &'a self,
        object: &'a str,
        position: Position,
        ttl: Duration,
    ) -> Call<'a, Advance>;
    fn position<'a>(&'a self, object: &'a str) -> Call<'a, Option<Position>>;
    fn as_any(&self) -> &dyn Any;
    fn type_name(&self) -> &'static str;
}

impl<S: Store> DynStore for S {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Call<'a, Claim> {
        Box::pin(Store::claim(self, key, fingerprint, token, lease))
    }
    fn claim_unwatched<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Call<'a, Claim> {
        Box::pin(Store::claim_unwatched(self, key, fingerprint, token, lease))
    }
    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Call<'a, bool> {
        Box::pin(Store::complete(self, key, token, record, window))
    }
    fn renew<'a>(&'a self, key: &'a str, token: OwnerToken, lease: Duration) -> Call<'a, bool> {
        Box::pin(Store::renew(self, key, token, lease))
    }
    fn release<'a>(&'a self, key: &'a str, token: OwnerToken) -> Call<'a, bool> {
        Box::pin(Store::release(self, key, token))
    }
    fn put_token<'a>(&'a self, key: &'a str, ttl: Duration) -> Call<'a, ()> {
        Box::pin(Store::put_token(self, key, ttl))
    }
    fn take_token<'a>(&'a self, key: &'a str, owner: OwnerToken) -> Call<'a, bool> {
        Box::pin(Store::take_token(self, key, owner))
    }
    fn inspect<'a>(&'a self, key: &'a str) -> Call<'a, RecordState> {
        Box::pin(Store::inspect(self, key))
    }
    fn replace<'a>(
        &'a self,
        key: &'a str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Call<'a, bool> {
        Box::pin(Store::replace(self, key, record, window))
    }
    fn forget<'a>(&'a self, key: &'a str) -> Call<'a, Forgotten> {
        Box::pin(Store::forget(self, key))
    }
    fn advance<'a>(
        &'a self,
        object: &'a str,
        position: Position,
        ttl: Duration,
    ) -> Call<'a, Advance> {
        Box::pin(Store::advance(self, object, position, ttl))
    }
    fn position<'a>(&'a self, object: &'a str) -> Call<'a, Option<Position>> {
        Box::pin(Store::position(self, object))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<S>()
    }
}

impl Store for BoxStore {
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.0.claim(key, fingerprint, token, lease).await
    }

    async fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.0.claim_unwatched(key, fingerprint, token, lease).await
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        self.0.complete(key, token, record, window).await
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.0.renew(key, token, lease).await
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        self.0.release(key, token).await
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        self.0.put_token(key, ttl).await
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        self.0.take_token(key, owner).await
    }

    async fn inspect(&self, key: &str) -> Result<RecordState, StoreError> {
        self.0.inspect(key).await
    }

    async fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        self.0.replace(key, record, window).await
    }

    async fn forget(&self, key: &str) -> Result<Forgotten, StoreError> {
        self.0.forget(key).await
    }

    async fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> Result<Advance, StoreError> {
        self.0.advance(object, position, ttl).await
    }

    async fn position(&self, object: &str) -> Result<Option<Position>, StoreError> {
        self.0.position(object).await
    }
}
