//! [`Consumer`]: the plain async API.

use super::lease::{timed, Held};
use super::{ConsumeError, Once, Receipt};
use crate::dedup::{MAX_SETTING, MIN_LEASE};
use crate::outcome::{self, log_warn, Outcome};
use crate::store::{Claim, CompletedRecord, OwnerToken, Store, StoredResponse};
use crate::Fingerprint;
use futures_util::FutureExt;
use http::{HeaderMap, StatusCode};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone)]
struct Config {
    scope: Arc<str>,
    window: Duration,
    lease: Duration,
    wait: Duration,
    store_timeout: Duration,
    max_run: Duration,
}

/// Runs a message handler at most once per key, over any [`Store`].
///
/// Cheap to clone. See the [module docs](crate::consumer) for an example.
#[derive(Debug, Clone)]
pub struct Consumer<St> {
    store: St,
    config: Arc<Config>,
}

impl<St: Store> Consumer<St> {
    /// A consumer over `store` with the defaults below.
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: Arc::new(Config {
                scope: Arc::from("consumer"),
                window: crate::dedup::DEFAULT_WINDOW,
                lease: crate::dedup::DEFAULT_LEASE,
                wait: Duration::ZERO,
                store_timeout: crate::dedup::DEFAULT_STORE_TIMEOUT,
                max_run: crate::dedup::DEFAULT_MAX_RUN,
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The name that scopes this consumer's keys in the store (stored key =
    /// `scope:key`), and labels its metrics. Two consumers that must not
    /// share records (two queues, two handlers) need two scopes. Defaults to
    /// `"consumer"`.
    pub fn scope(self, scope: impl Into<Arc<str>>) -> Self {
        let scope = scope.into();
        self.with(|c| c.scope = scope)
    }

    /// How long a success is remembered: a copy of the message within the
    /// window does not run the handler. Keep it longer than the sender's
    /// redelivery horizon. Defaults to 25 hours. At most a year.
    pub fn window(self, window: Duration) -> Self {
        self.with(|c| c.window = window.min(MAX_SETTING))
    }

    /// How long a claim holds without renewal; it is renewed every `lease/3`
    /// while the handler runs, and runs out if the process dies, so that a
    /// redelivery runs the handler again. Defaults to 30 seconds. From 100 ms
    /// to a year: a value outside is taken as the nearest end.
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = lease.clamp(MIN_LEASE, MAX_SETTING))
    }

    /// How long a copy that finds the key in flight waits for the first one
    /// before it answers [`ConsumeError::InFlight`]. Defaults to zero (answer
    /// at once: a queue redelivers later anyway). At most a year.
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|c| c.wait = wait.min(MAX_SETTING))
    }

    /// The timeout of every store call. Defaults to 1 second.
    pub fn store_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.store_timeout = timeout)
    }

    /// The run limit: a handler still running after it is cancelled, its
    /// claim released, and [`ConsumeError::RunLimit`] returned, so that a
    /// handler that never ends does not keep its key claimed (and its
    /// queue entry undelivered) for good. Keep it longer than any handler
    /// run. Defaults to 5 minutes.
    pub fn max_run(self, limit: Duration) -> Self {
        self.with(|c| c.max_run = limit)
    }

    /// The run limit (see [`max_run`](Self::max_run)).
    pub fn get_max_run(&self) -> Duration {
        self.config.max_run
    }

    /// The same settings over another store. Defaults to the store given
    /// to [`new`](Self::new).
    pub fn with_store<St2: Store>(self, store: St2) -> Consumer<St2> {
        Consumer {
            store,
            config: self.config,
        }
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// Runs `handler` unless `key` already succeeded within the window.
    ///
    /// - Claimed: runs `handler`, renewing the claim every `lease/3`. On `Ok`
    ///   the result's [`Receipt`] is stored and [`Once::Ran`] returned; on
    ///   `Err` or a panic the claim is released, nothing is recorded, and the
    ///   next delivery runs again. Dropping the returned future cancels the
    ///   handler and releases the claim.
    /// - Already done: `handler` is dropped unpolled; [`Once::Done`] carries
    ///   the stored receipt.
    /// - Running elsewhere (with this `fingerprint` or another): waits up to
    ///   [`wait`](Self::wait), then [`ConsumeError::InFlight`] (a retry:
    ///   another payload's call may yet fail and free the key).
    /// - Done with another `fingerprint`: [`ConsumeError::Mismatch`], the
    ///   handler never runs.
    pub async fn once<T, E, F>(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        handler: F,
    ) -> Result<Once<T>, ConsumeError<E>>
    where
        T: Receipt,
        F: Future<Output = Result<T, E>>,
    {
        let config = &self.config;
        let stored_key: Arc<str> = Arc::from(format!("{}:{key}", config.scope));
        let deadline = Instant::now() + config.wait;
        let mut handler = Some(handler);
        loop {
            let token = OwnerToken::new();
            // Owns whatever the claim below makes, even if the call times
            // out after the store acted or this future is dropped.
            let mut held = Held::new(
                self.store.clone(),
                stored_key.clone(),
                token,
                config.store_timeout,
            );
            let claim = timed(
                config.store_timeout,
                "claim",
                self.store
                    .claim(&stored_key, fingerprint, token, config.lease),
            )
            .await;
            let claim = match claim {
                Ok(claim) => claim,
                Err(e) => {
                    outcome::record(&config.scope, Outcome::StoreError);
                    return Err(ConsumeError::Store(e));
                }
            };
            if !matches!(claim, Claim::Acquired(_)) {
                held.disarm();
            }
            match claim {
                Claim::Completed(record) => {
                    if record.fingerprint != fingerprint {
                        return Err(self.mismatch());
                    }
                    outcome::record(&config.scope, Outcome::Replayed);
                    return T::decode(record.response.body.clone())
                        .map(Once::Done)
                        .ok_or(ConsumeError::CorruptReceipt);
                }
                Claim::InFlight {
                    fingerprint: running,
                    watch,
                } => {
                    // Another payload's call may yet fail and free the key
                    // (only its completed record holds it for good): wait
                    // for it as for a copy, then answer a retry.
                    if Instant::now() >= deadline {
                        if running != fingerprint {
                            log_warn!(
                                scope = %config.scope,
                                "message key in flight with a different payload: possible tampering; retried later"
                            );
                        }
                        outcome::record(&config.scope, Outcome::InFlightRejected);
                        return Err(ConsumeError::InFlight);
                    }
                    let _ = tokio::time::timeout_at(deadline, watch.changed()).await;
                }
                Claim::Acquired(_) => {
                    let handler = handler.take().expect("claimed once");
                    return self.run(held, fingerprint, handler).await;
                }
                _ => {
                    outcome::record(&config.scope, Outcome::StoreError);
                    return Err(ConsumeError::Store(crate::store::unknown_claim()));
                }
            }
        }
    }

    fn mismatch<E>(&self) -> ConsumeError<E> {
        outcome::record(&self.config.scope, Outcome::Mismatch);
        log_warn!(
            scope = %self.config.scope,
            "message key reused with a different payload: possible tampering"
        );
        ConsumeError::Mismatch
    }

    async fn run<T, E, F>(
        &self,
        mut held: Held<St>,
        fingerprint: Fingerprint,
        handler: F,
    ) -> Result<Once<T>, ConsumeError<E>>
    where
        T: Receipt,
        F: Future<Output = Result<T, E>>,
    {
        let config = &self.config;
        let work = AssertUnwindSafe(handler).catch_unwind();
        let limited = tokio::time::timeout(config.max_run, work);
        let (result, lost) = held.renewing(limited, config.lease, &config.scope).await;
        let Ok(result) = result else {
            outcome::record(&config.scope, Outcome::RunLimitExceeded);
            log_warn!(scope = %config.scope, limit = ?config.max_run, "message handler ran past the run limit; cancelled, claim released");
            held.release().await;
            return Err(ConsumeError::RunLimit);
        };
        let value = match result {
            Err(_panic) => {
                outcome::record(&config.scope, Outcome::Failed);
                log_warn!(scope = %config.scope, "message handler panicked; claim released");
                held.release().await;
                return Err(ConsumeError::Panicked);
            }
            Ok(Err(e)) => {
                outcome::record(&config.scope, Outcome::Failed);
                held.release().await;
                return Err(ConsumeError::Handler(e));
            }
            Ok(Ok(value)) => value,
        };
        let record = Arc::new(CompletedRecord::new(
            fingerprint,
            StoredResponse::new(StatusCode::OK, HeaderMap::new(), value.encode()),
        ));
        // The handler succeeded: from here on the claim is never released.
        // The completion runs in a task of its own, so that cancelling this
        // future (a worker's shutdown) does not cut it off either.
        held.disarm();
        let completion = {
            let (store, key, token) = (self.store.clone(), held.key.clone(), held.token);
            let (record, window, timeout) = (record.clone(), config.window, config.store_timeout);
            tokio::spawn(async move {
                timed(
                    timeout,
                    "complete",
                    store.complete(&key, token, record, window),
                )
                .await
            })
        };
        let completed = completion.await.unwrap_or_else(|_| {
            Err(crate::store::StoreError::timeout(
                "complete",
                config.store_timeout,
            ))
        });
        let outcome = match completed {
            Ok(true) if !lost => Outcome::Executed,
            Ok(_) => {
                log_warn!(scope = %config.scope, "lease lost while the message handler ran");
                Outcome::LeaseLost
            }
            Err(_) => {
                // Keep trying in the background for one lease, so that the
                // claim does not lapse into a second run.
                let (store, key, token, window) = (
                    self.store.clone(),
                    held.key.clone(),
                    held.token,
                    config.window,
                );
                let (timeout, lease) = (config.store_timeout, config.lease);
                tokio::spawn(async move {
                    let give_up = Instant::now() + lease;
                    let mut backoff = Duration::from_millis(50);
                    while Instant::now() < give_up {
                        tokio::time::sleep(backoff).await;
                        let fut = store.complete(&key, token, record.clone(), window);
                        if let Ok(Ok(_)) = tokio::time::timeout(timeout, fut).await {
                            return;
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                });
                Outcome::StoreError
            }
        };
        outcome::record(&config.scope, outcome);
        Ok(Once::Ran(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, RecordState};

    /// A copy that meets another payload's call still running (on another
    /// instance sharing the store, say) is tried again later: that call
    /// may yet fail and free the key. Only another payload's completed
    /// record makes the key useless for good.
    #[tokio::test]
    async fn another_payload_in_flight_is_a_retry_and_one_completed_is_not() {
        let store = MemoryStore::new();
        let consumer = Consumer::new(store.clone());
        let (genuine, forged) = (Fingerprint::of(b"genuine"), Fingerprint::of(b"forged"));
        let (fail, failed) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn({
            let consumer = consumer.clone();
            async move {
                let handler = async move {
                    let _ = failed.await;
                    Err::<(), _>("upstream failed")
                };
                consumer.once("k", forged, handler).await
            }
        });
        while !matches!(
            store.inspect("consumer:k").await.unwrap(),
            RecordState::InFlight { .. }
        ) {
            tokio::task::yield_now().await;
        }
        let got = consumer
            .once("k", genuine, async { Ok::<(), &str>(()) })
            .await;
        assert!(matches!(got, Err(ConsumeError::InFlight)), "{got:?}");
        assert!(got.unwrap_err().is_retryable());
        // The forged copy's call fails: the genuine copy's retry runs.
        let _ = fail.send(());
        let forged_got = running.await.unwrap();
        assert!(
            matches!(forged_got, Err(ConsumeError::Handler(_))),
            "{forged_got:?}"
        );
        let got = consumer
            .once("k", genuine, async { Ok::<(), &str>(()) })
            .await;
        assert!(matches!(got, Ok(Once::Ran(()))), "{got:?}");
        // Completed: another payload can never succeed.
        let got = consumer
            .once("k", forged, async { Ok::<(), &str>(()) })
            .await;
        assert!(matches!(got, Err(ConsumeError::Mismatch)), "{got:?}");
        assert!(!got.unwrap_err().is_retryable());
    }
}
