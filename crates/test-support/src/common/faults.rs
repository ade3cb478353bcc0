//! One fault-injecting store for every test: [`FaultStore`] wraps a real
//! store and asks a [`Faults`] plan before each call (an `Err` answers
//! instead of the store, a sleep slows the call, a pending future hangs it)
//! and after it (the store acted; an `Err` loses its answer). The plan's
//! fields are reached through the store (`Deref`), so a test flips
//! `store.down` on the store it handed to the layer.

use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_idempotency::store::{
    Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoreError, StoreErrorKind,
};
use tower_idempotency::Fingerprint;

/// The store call a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Claim,
    Complete,
    Renew,
    Release,
    PutToken,
    TakeToken,
}

/// A fault plan. Both hooks default to "no fault".
pub trait Faults: Clone + Send + Sync + 'static {
    /// Runs before the store is called; an `Err` is the call's answer.
    fn before(&self, op: Op, key: &str) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (op, key);
        async { Ok(()) }
    }

    /// Runs after the store acted; an `Err` replaces its answer.
    fn after(&self, op: Op, key: &str) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (op, key);
        async { Ok(()) }
    }

    /// Sees the call's answer: its error, if it failed.
    fn answered(&self, op: Op, key: &str, error: Option<&StoreError>) {
        let _ = (op, key, error);
    }

    /// The caller dropped the call `waited` after it began, before it was
    /// answered (a timeout or a cancelled request).
    fn dropped(&self, op: Op, key: &str, waited: Duration) {
        let _ = (op, key, waited);
    }
}

/// No faults: a plain store, e.g. one that only counts.
impl Faults for () {}

/// An error as a backend would return it.
pub fn backend_error(message: &'static str) -> StoreError {
    StoreError::new(StoreErrorKind::Backend, message)
}

/// `inner` (a memory store by default) with the faults of `faults`.
#[derive(Clone, Default)]
pub struct FaultStore<F, St = MemoryStore> {
    pub inner: St,
    pub faults: F,
}

impl<F> FaultStore<F> {
    /// A fresh memory store with `faults`.
    pub fn new(faults: F) -> Self {
        Self {
            inner: MemoryStore::new(),
            faults,
        }
    }
}

impl<F, St> Deref for FaultStore<F, St> {
    type Target = F;

    fn deref(&self) -> &F {
        &self.faults
    }
}

impl<F: Faults, St: Store> FaultStore<F, St> {
    async fn around<T>(
        &self,
        op: Op,
        key: &str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let mut pending = Pending {
            faults: &self.faults,
            op,
            key,
            since: Instant::now(),
            answered: false,
        };
        let out = async {
            self.faults.before(op, key).await?;
            let out = call.await;
            self.faults.after(op, key).await?;
            out
        }
        .await;
        pending.answered = true;
        self.faults.answered(op, key, out.as_ref().err());
        out
    }
}

/// A call under way: dropped unanswered, it tells the plan.
struct Pending<'a, F: Faults> {
    faults: &'a F,
    op: Op,
    key: &'a str,
    since: Instant,
    answered: bool,
}

impl<F: Faults> Drop for Pending<'_, F> {
    fn drop(&mut self) {
        if !self.answered {
            self.faults.dropped(self.op, self.key, self.since.elapsed());
        }
    }
}

impl<F: Faults, St: Store> Store for FaultStore<F, St> {
    async fn claim(
        &self,
        key: &str,
        fp: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.around(Op::Claim, key, self.inner.claim(key, fp, token, lease))
            .await
    }
    /// Counted and faulted as a claim.
    async fn claim_unwatched(
        &self,
        key: &str,
        fp: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let call = self.inner.claim_unwatched(key, fp, token, lease);
        self.around(Op::Claim, key, call).await
    }
    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        self.around(
            Op::Complete,
            key,
            self.inner.complete(key, token, record, window),
        )
        .await
    }
    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.around(Op::Renew, key, self.inner.renew(key, token, lease))
            .await
    }
    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        self.around(Op::Release, key, self.inner.release(key, token))
            .await
    }
    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        self.around(Op::PutToken, key, self.inner.put_token(key, ttl))
            .await
    }
    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        self.around(Op::TakeToken, key, self.inner.take_token(key, owner))
            .await
    }
}
