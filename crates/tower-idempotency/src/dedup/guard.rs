//! The owner's side of a claim: renewing, completing and releasing it, and
//! releasing it on every exit path that forgot to.

use super::store_call::store_call;
use crate::outcome::{self, log_warn, Outcome};
use crate::store::{ActiveClaim, CompletedRecord, OwnerToken, Store, StoreError};
use crate::IdempotencyKey;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

/// Owns a claim until it is completed or released; dropped while still armed
/// (a cancelled call, a panic in our own code) it releases the claim in a
/// tracked background task.
pub(super) struct ClaimGuard<St: Store> {
    store: St,
    key: IdempotencyKey,
    token: OwnerToken,
    store_timeout: Duration,
    tasks: TaskTracker,
    /// A consumed client token to put back if the claim is released.
    restore_token: Option<(Arc<str>, Duration)>,
    /// The claim as the inner service sees it (request extensions): it may
    /// complete the record itself, in its own transaction.
    active: Option<ActiveClaim>,
    /// The fencing token the store gave the claim.
    fence: u64,
    armed: bool,
}

impl<St: Store> ClaimGuard<St> {
    pub(super) fn new(
        store: St,
        key: IdempotencyKey,
        token: OwnerToken,
        store_timeout: Duration,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            store,
            key,
            token,
            store_timeout,
            tasks,
            restore_token: None,
            active: None,
            fence: 0,
            armed: true,
        }
    }

    /// The claim won, with fencing token `fence`.
    pub(super) fn acquired(&mut self, fence: u64) {
        self.fence = fence;
    }

    /// The claim for the inner service's request extensions, with which it
    /// can complete the record in its own transaction (SQL stores).
    pub(super) fn active_claim(&mut self, window: Duration) -> ActiveClaim {
        let claim = ActiveClaim::new(
            self.key.as_arc().clone(),
            self.token,
            self.key.fingerprint(),
            window,
        )
        .with_fence(self.fence);
        self.active = Some(claim.clone());
        claim
    }

    /// The inner service wrote the record in its own transaction (which
    /// may not have committed).
    pub(super) fn completed_by_handler(&self) -> bool {
        self.active
            .as_ref()
            .is_some_and(ActiveClaim::completed_by_handler)
    }

    /// The key this claim is for.
    pub(super) fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// A client token this claim consumed: it is put back (for `ttl`) if the
    /// claim is released.
    pub(super) fn restore_token(&mut self, token_key: Arc<str>, ttl: Duration) {
        self.restore_token = Some((token_key, ttl));
    }

    /// Nothing to release (the claim was not acquired, or was completed).
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Extends the lease. `Ok(false)`: another owner has the key now.
    pub(super) async fn renew(&self, lease: Duration) -> Result<bool, StoreError> {
        let fut = self.store.renew(self.key.as_str(), self.token, lease);
        store_call(self.store_timeout, "renew", fut).await
    }

    /// Stores the completed record and disarms the guard. If the store fails,
    /// keeps trying in a tracked background task for up to `lease`, so that
    /// the claim does not lapse into a second execution; giving up is logged
    /// and counted.
    pub(super) async fn complete(
        &mut self,
        record: Arc<CompletedRecord>,
        window: Duration,
        lease: Duration,
    ) -> Outcome {
        self.armed = false;
        if self.completed_by_handler() {
            // The handler wrote the record in its own transaction. Deleting
            // the claim (owner-checked, in flight only) changes nothing once
            // that transaction committed; if it did not commit, the claim is
            // still in flight, and this frees it for the next copy: the
            // handler's success is then no success (`Failed`), and a
            // consumed client token goes back.
            let fut = self.store.release(self.key.as_str(), self.token);
            return match store_call(self.store_timeout, "release", fut).await {
                Ok(false) => Outcome::Executed,
                Ok(true) => {
                    log_warn!(key = %self.key.redacted(), "the handler completed the record in a transaction that did not commit: answered as a failure, claim released");
                    if let Some((token_key, ttl)) = self.restore_token.take() {
                        let fut = self.store.put_token(&token_key, ttl);
                        let _ = store_call(self.store_timeout, "put_token", fut).await;
                    }
                    Outcome::Failed
                }
                // Committed or not, nobody can tell now: no success is
                // answered (if it committed, the next copy replays it).
                Err(_) => Outcome::StoreError,
            };
        }
        let fut = self
            .store
            .complete(self.key.as_str(), self.token, record.clone(), window);
        match store_call(self.store_timeout, "complete", fut).await {
            Ok(true) => Outcome::Executed,
            Ok(false) => Outcome::LeaseLost,
            Err(error) => {
                log_warn!(key = %self.key.redacted(), error = %error, "completing the record failed; retrying in the background");
                let _ = &error;
                let (store, key, token) = (self.store.clone(), self.key.clone(), self.token);
                let timeout = self.store_timeout;
                self.tasks.spawn(async move {
                    let give_up = Instant::now() + lease;
                    let mut backoff = Duration::from_millis(50);
                    while Instant::now() < give_up {
                        tokio::time::sleep(backoff).await;
                        let fut = store.complete(key.as_str(), token, record.clone(), window);
                        if let Ok(res) = store_call(timeout, "complete", fut).await {
                            if !res {
                                outcome::record(key.preset_arc(), Outcome::LeaseLost);
                            }
                            return;
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                    outcome::record(key.preset_arc(), Outcome::CompletionAbandoned);
                    log_warn!(key = %key.redacted(), "gave up completing the record: the next retry runs again");
                });
                Outcome::StoreError
            }
        }
    }

    /// Releases the claim now: first gives back a consumed client token (so
    /// that a copy waiting on this claim finds it), then deletes the claim.
    pub(super) async fn release(mut self) {
        self.armed = false;
        let restore = self.restore_token.take();
        if self.completed_by_handler() {
            // A record the handler committed keeps its client token
            // consumed; one whose transaction rolled back left the claim in
            // flight, and gives its token back once the claim is released.
            let fut = self.store.release(self.key.as_str(), self.token);
            let released = store_call(self.store_timeout, "release", fut).await;
            if let (Ok(true), Some((token_key, ttl))) = (released, restore) {
                let fut = self.store.put_token(&token_key, ttl);
                let _ = store_call(self.store_timeout, "put_token", fut).await;
            }
            return;
        }
        release(
            &self.store,
            &self.key,
            self.token,
            self.store_timeout,
            restore,
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
        if tokio::runtime::Handle::try_current().is_ok() {
            self.tasks
                .spawn(async move { release(&store, &key, token, timeout, restore).await });
        }
    }
}

/// Puts a consumed client token back, then deletes `token`'s claim. Failures
/// are not fatal: the lease runs out by itself, and a lost token only means
/// the client asks for a new one.
async fn release<St: Store>(
    store: &St,
    key: &IdempotencyKey,
    token: OwnerToken,
    timeout: Duration,
    restore_token: Option<(Arc<str>, Duration)>,
) {
    if let Some((token_key, ttl)) = restore_token {
        let _ = store_call(timeout, "put_token", store.put_token(&token_key, ttl)).await;
    }
    let _ = store_call(timeout, "release", store.release(key.as_str(), token)).await;
}
