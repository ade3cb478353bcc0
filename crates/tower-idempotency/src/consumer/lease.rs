//! Holding a claim: renewal while the handler runs, release on every exit.

use crate::outcome::{self, log_warn, Outcome};
use crate::store::{OwnerToken, Store, StoreError};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Runs one store call under `timeout`.
pub(crate) async fn timed<T>(
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
pub(crate) struct Held<St: Store> {
    pub(super) store: St,
    pub(super) key: Arc<str>,
    pub(super) token: OwnerToken,
    pub(super) timeout: Duration,
    armed: bool,
}

impl<St: Store> Held<St> {
    pub(crate) fn new(store: St, key: Arc<str>, token: OwnerToken, timeout: Duration) -> Self {
        Self {
            store,
            key,
            token,
            timeout,
            armed: true,
        }
    }

    /// Nothing to release: the claim was completed, or never made.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Releases the claim now (owner-checked: harmless if it was lost).
    pub(crate) async fn release(mut self) {
        self.armed = false;
        let _ = timed(
            self.timeout,
            "release",
            self.store.release(&self.key, self.token),
        )
        .await;
    }

    /// Polls `work` and, alongside it, renews the claim every `lease/3`
    /// (sooner after a failed renewal: a fifth of that), until `work`
    /// finishes; `work` is polled while a renewal is under way. Returns the
    /// output and whether a renewal found the claim lost. A failed renewal is
    /// logged and counted under `scope`.
    pub(crate) async fn renewing<F: Future>(
        &self,
        work: F,
        lease: Duration,
        scope: &Arc<str>,
    ) -> (F::Output, bool) {
        let period = lease / 3;
        let lost = AtomicBool::new(false);
        let renew = async {
            let mut next = Instant::now() + period;
            loop {
                tokio::time::sleep_until(next).await;
                let renewed = timed(
                    self.timeout,
                    "renew",
                    self.store.renew(&self.key, self.token, lease),
                )
                .await;
                match renewed {
                    Ok(true) => next = Instant::now() + period,
                    // Logged and counted once the handler ends.
                    Ok(false) => {
                        lost.store(true, Ordering::Relaxed);
                        return std::future::pending::<()>().await;
                    }
                    // The store is down: try again soon; the lease may still hold.
                    Err(_error) => {
                        outcome::record(scope, Outcome::StoreError);
                        log_warn!(scope = %scope, error = %_error, "renewing the consumer's lease failed; retrying");
                        next = Instant::now() + period / 5;
                    }
                }
            }
        };
        // The renewal timer is polled outside the task's budget: a handler
        // that is always ready spends it, and a budgeted timer would then
        // never fire.
        let renew = tokio::task::unconstrained(renew);
        tokio::select! {
            biased;
            out = work => (out, lost.load(Ordering::Relaxed)),
            () = renew => unreachable!("the renewal loop never ends"),
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
