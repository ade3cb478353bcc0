//! Releasing a claim on every exit path, and finishing work whose caller left.

use super::service::store_call;
use crate::store::{OwnerToken, Store};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// Owns a claim until it is completed or released; dropped while still armed
/// (a cancelled call, a panic in our own code) it releases the claim in a
/// spawned task.
pub(super) struct ClaimGuard<St: Store> {
    pub(super) store: St,
    pub(super) key: Arc<str>,
    pub(super) token: OwnerToken,
    pub(super) store_timeout: Duration,
    /// A consumed client token to put back if the claim is released.
    restore_token: Option<(Arc<str>, Duration)>,
    armed: bool,
}

impl<St: Store> ClaimGuard<St> {
    pub(super) fn new(
        store: St,
        key: Arc<str>,
        token: OwnerToken,
        store_timeout: Duration,
    ) -> Self {
        Self {
            store,
            key,
            token,
            store_timeout,
            restore_token: None,
            armed: true,
        }
    }

    /// A client token this claim consumed: it is put back (for `ttl`) if the
    /// claim is released.
    pub(super) fn restore_token(&mut self, token_key: Arc<str>, ttl: Duration) {
        self.restore_token = Some((token_key, ttl));
    }

    /// The claim was completed: nothing to release.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Releases the claim now (and gives back a consumed client token).
    pub(super) async fn release(mut self) {
        self.armed = false;
        release(
            &self.store,
            &self.key,
            self.token,
            self.store_timeout,
            self.restore_token.take(),
        )
        .await;
    }
}

impl<St: Store> Drop for ClaimGuard<St> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, key, token, timeout, restore) = (
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.store_timeout,
            self.restore_token.take(),
        );
        // Without a runtime the lease runs out by itself.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move { release(&store, &key, token, timeout, restore).await });
        }
    }
}

/// Deletes `token`'s claim and puts a consumed client token back. Failures
/// are not fatal: the lease runs out by itself, and a lost token only means
/// the client asks for a new one.
async fn release<St: Store>(
    store: &St,
    key: &str,
    token: OwnerToken,
    timeout: Duration,
    restore_token: Option<(Arc<str>, Duration)>,
) {
    let _ = store_call(timeout, "release", store.release(key, token)).await;
    if let Some((token_key, ttl)) = restore_token {
        let _ = store_call(timeout, "put_token", store.put_token(&token_key, ttl)).await;
    }
}

/// Drives a future; if dropped before it finished and `detach` is set, hands
/// the rest of it to a spawned task instead of cancelling it.
pub(super) struct Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    fut: Option<Pin<Box<F>>>,
    detach: bool,
}

impl<F> Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    pub(super) fn new(fut: F, detach: bool) -> Self {
        Self {
            fut: Some(Box::pin(fut)),
            detach,
        }
    }
}

impl<F> Future for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let fut = self.fut.as_mut().expect("polled after completion");
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F> Drop for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    fn drop(&mut self) {
        if let Some(fut) = self.fut.take() {
            if self.detach {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    handle.spawn(async move {
                        let _ = fut.await;
                    });
                }
                // Without a runtime `fut` drops here, and its guard can only
                // leave the claim to its lease.
            }
        }
    }
}
