//! Holding a claim: renewal while the handler runs, release on every exit.

use crate::store::{OwnerToken, Store, StoreError};
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::time::Instant;

/// Runs one store call under `timeout`.
pub(super) async fn timed<T>(
    timeout: Duration,
    op: &'static str,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(res) => res,
        Err(_) => Err(StoreError::timeout(op, timeout)),
    }
}

/// Owns a claim until it is completed or released. Dropped while armed (the
/// `once` future cancelled, a panic) it releases the claim in a spawned task;
/// without a runtime the lease runs out by itself.
pub(super) struct Held<St: Store> {
    pub(super) store: St,
    pub(super) key: Arc<str>,
    pub(super) token: OwnerToken,
    pub(super) timeout: Duration,
    armed: bool,
}

impl<St: Store> Held<St> {
    pub(super) fn new(store: St, key: Arc<str>, token: OwnerToken, timeout: Duration) -> Self {
        Self {
            store,
            key,
            token,
            timeout,
            armed: true,
        }
    }

    /// Nothing to release: the claim was completed, or never made.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Releases the claim now (owner-checked: harmless if it was lost).
    pub(super) async fn release(mut self) {
        self.armed = false;
        let _ = timed(
            self.timeout,
            "release",
            self.store.release(&self.key, self.token),
        )
        .await;
    }

    /// Polls `work`, renewing the claim every `lease/3` until it finishes.
    /// Returns the output and whether a renewal found the claim lost.
    pub(super) async fn renewing<F: Future>(&self, work: F, lease: Duration) -> (F::Output, bool) {
        let period = lease / 3;
        let mut work = std::pin::pin!(work);
        let mut tick = std::pin::pin!(tokio::time::sleep(period));
        let mut lost = false;
        loop {
            let ready = std::future::poll_fn(|cx| {
                if let Poll::Ready(out) = work.as_mut().poll(cx) {
                    return Poll::Ready(Some(out));
                }
                if !lost && tick.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Poll::Pending
            })
            .await;
            if let Some(out) = ready {
                return (out, lost);
            }
            let renewed = timed(
                self.timeout,
                "renew",
                self.store.renew(&self.key, self.token, lease),
            )
            .await;
            // A store error keeps trying: the lease may still hold.
            if let Ok(false) = renewed {
                lost = true;
            }
            tick.as_mut().reset(Instant::now() + period);
        }
    }
}

impl<St: Store> Drop for Held<St> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, key, token, timeout) = (
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.timeout,
        );
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = timed(timeout, "release", store.release(&key, token)).await;
            });
        }
    }
}
