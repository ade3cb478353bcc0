//! The claim protocol of one guarded request: claim, then replay, wait, take
//! over, or run the inner call as the claim's owner.

use super::config::{DedupConfig, OnStoreError};
use super::guard::ClaimGuard;
use super::owner::{Head, Owner};
use super::reply::{in_flight, refusal, replay, retry_later};
use super::store_call::store_call;
use super::Mismatched;
use crate::body::{BoxError, CancelOnDrop, ResponseBody};
use crate::outcome::{self, log_warn, Outcome};
use crate::store::{Claim, OwnerToken, Store, StoreError};
use crate::IdempotencyKey;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower_service::Service;

/// One guarded request.
pub(super) struct Run<S, St> {
    pub(super) inner: S,
    pub(super) store: St,
    pub(super) config: Arc<DedupConfig>,
    pub(super) tasks: TaskTracker,
    pub(super) key: IdempotencyKey,
}

/// The inner service as the owner's task needs it.
pub(super) trait Inner<ReqBody, ResBody>:
    Service<Request<ReqBody>, Response = Response<ResBody>, Future = Self::Fut, Error = Self::Err>
    + Send
    + 'static
{
    type Fut: Future<Output = Result<Response<ResBody>, Self::Err>> + Send + 'static;
    type Err: Send + 'static;
}

impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Fut = S::Future;
    type Err = S::Error;
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<S, St: Store> Run<S, St> {
    pub(super) async fn run<ReqBody, ResBody>(
        self,
        req: Request<ReqBody>,
    ) -> Answer<ResBody, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let fingerprint = self.key.fingerprint();
        // How long a copy waits for the key's owner, from its first look:
        // the clock is read only once a copy finds the key in flight.
        let mut deadline = None;
        let mut waited = false;
        loop {
            let token = OwnerToken::new();
            // Owns whatever claim the call below makes: if the call times out,
            // fails in transport after the store acted, or this future is
            // dropped, the claim is released (owner-checked, so harmless when
            // there was none) instead of blocking the key for a whole lease.
            let mut guard = ClaimGuard::new(
                self.store.clone(),
                self.key.clone(),
                token,
                self.config.store_timeout,
                self.tasks.clone(),
            );
            let claim = store_call(
                self.config.store_timeout,
                "claim",
                self.store
                    .claim(self.key.as_str(), fingerprint, token, self.config.lease),
            );
            let claim = crate::span::instrument(claim, crate::span::claim()).await;
            // The rare paths below (a store failure, an unknown token) are
            // boxed, so that their futures do not enlarge every request's.
            let claim = match claim {
                Ok(claim) => claim,
                Err(e) => {
                    drop(guard);
                    return Box::pin(self.store_failed(e, req)).await;
                }
            };
            if !matches!(claim, Claim::Acquired(_)) {
                guard.disarm();
            }
            match claim {
                Claim::Completed(record) => {
                    if record.fingerprint != fingerprint {
                        return Ok(self.mismatch(req.headers(), Mismatched::Completed));
                    }
                    if self.config.strict {
                        return Ok(self.duplicate_submission());
                    }
                    let outcome = if waited {
                        Outcome::Waited
                    } else {
                        Outcome::Replayed
                    };
                    outcome::record(self.key.preset_arc(), outcome);
                    let _span = crate::span::replay().entered();
                    return Ok(replay(record, outcome));
                }
                Claim::InFlight {
                    fingerprint: running,
                    watch,
                } => {
                    // The other payload may yet fail and release the key:
                    // said so, for a caller that can come back (a queue's
                    // deliverer).
                    if running != fingerprint {
                        return Ok(self.mismatch(req.headers(), Mismatched::InFlight));
                    }
                    if self.config.strict {
                        return Ok(self.duplicate_submission());
                    }
                    let now = Instant::now();
                    let deadline = *deadline.get_or_insert(now + self.config.wait);
                    if now >= deadline {
                        outcome::record(self.key.preset_arc(), Outcome::InFlightRejected);
                        return Ok(in_flight(self.key.token_key().is_some()));
                    }
                    waited = true;
                    let _ = tokio::time::timeout_at(deadline, watch.changed()).await;
                }
                Claim::Acquired(held) => {
                    guard.acquired(held.fence);
                    let owner = held.owner;
                    if let Some(token_key) = self.key.token_key().cloned() {
                        let taken = store_call(
                            self.config.store_timeout,
                            "take_token",
                            self.store.take_token(&token_key, owner),
                        )
                        .await;
                        match taken {
                            // Only a token known to be taken is given back on
                            // failure: restoring an unconfirmed one could mint
                            // a guessed token.
                            Ok(true) => guard.restore_token(token_key, self.config.token_ttl),
                            Ok(false) => {
                                Box::pin(guard.release()).await;
                                return Ok(self.unknown_token());
                            }
                            Err(e) => {
                                Box::pin(guard.release()).await;
                                return Box::pin(self.store_failed(e, req)).await;
                            }
                        }
                    }
                    // Boxed: a replay's future (most of a storm) need not
                    // carry the owner's room (1.6 KB) that only a first
                    // delivery uses.
                    return Box::pin(self.execute(req, guard)).await;
                }
                _ => {
                    drop(guard);
                    return Box::pin(self.store_failed(crate::store::unknown_claim(), req)).await;
                }
            }
        }
    }

    /// Runs the inner call as the claim's owner, in a tracked task, and
    /// answers with its head, or with the retryable failure at the reply
    /// deadline (the task goes on).
    async fn execute<ReqBody, ResBody>(
        self,
        mut req: Request<ReqBody>,
        mut guard: ClaimGuard<St>,
    ) -> Answer<ResBody, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let Run {
            inner,
            config,
            tasks,
            key,
            ..
        } = self;
        // The handler may complete the record in its own transaction.
        req.extensions_mut()
            .insert(guard.active_claim(config.window));
        let (head_tx, mut head_rx) = oneshot::channel();
        // Unless calls are finished on disconnect, dropping this future (or
        // the body it answers) cancels the call and releases its claim.
        let (mut cancel_on_drop, cancelled) = if config.finish_on_disconnect {
            (None, None)
        } else {
            let (guard, cancelled) = CancelOnDrop::new();
            (Some(guard), Some(cancelled))
        };
        let owner = Owner {
            inner,
            guard,
            config: config.clone(),
        };
        // The owner runs here, in the caller's task, until the head is ready;
        // whatever is left of it then (a streamed body, the record) goes on
        // in a tracked task, and so does all of it if this future is dropped
        // or the reply deadline passes. A small answer is thus served without
        // a task of its own.
        let mut work = Detachable {
            work: Some(Box::pin(owner.run(req, head_tx, cancelled))),
            tasks,
        };
        let head = std::future::poll_fn(|cx| {
            work.poll_inline(cx);
            std::pin::Pin::new(&mut head_rx).poll(cx)
        });
        let head = match config.reply_timeout {
            None => head.await,
            Some(patience) => match tokio::time::timeout(patience, head).await {
                Ok(head) => head,
                Err(_) => {
                    // The call goes on, detached, holding its claim.
                    if let Some(guard) = cancel_on_drop.take() {
                        guard.disarm();
                    }
                    work.detach();
                    outcome::record(key.preset_arc(), Outcome::ReplyDeadline);
                    log_warn!(key = %key.redacted(), "reply deadline passed; the call goes on in the background");
                    return Ok(retry_later(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the request is still being processed; retry later\n",
                        Outcome::ReplyDeadline,
                    ));
                }
            },
        };
        work.detach();
        match head {
            Ok(Head::Done(answer)) => answer,
            Ok(Head::Streamed(parts, rx, hint)) => {
                let body = ResponseBody::channel(rx, hint, cancel_on_drop);
                let mut res = Response::from_parts(parts, body);
                res.extensions_mut().insert(Outcome::Executed);
                Ok(res)
            }
            // The owner's task ended without a word (a bug of ours); its
            // guard released the claim.
            Err(_) => Ok(refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error\n",
                Outcome::Failed,
            )),
        }
    }

    async fn store_failed<ReqBody, ResBody>(
        mut self,
        error: StoreError,
        req: Request<ReqBody>,
    ) -> Answer<ResBody, S::Err>
    where
        S: Inner<ReqBody, ResBody>,
    {
        outcome::record(self.key.preset_arc(), Outcome::StoreError);
        log_warn!(key = %self.key.redacted(), error = %error, "idempotency store failed");
        let _ = &error;
        match self.config.on_store_error {
            OnStoreError::FailClosed => Ok(retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency store unavailable; retry later\n",
                Outcome::StoreError,
            )),
            OnStoreError::FailOpen => {
                outcome::record(self.key.preset_arc(), Outcome::PassedThrough);
                let mut res = self.inner.call(req).await?.map(ResponseBody::stream);
                res.extensions_mut().insert(Outcome::PassedThrough);
                Ok(res)
            }
        }
    }

    fn duplicate_submission<ResBody>(&self) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::InFlightRejected);
        refusal(
            StatusCode::CONFLICT,
            "duplicate submission: this request was already received\n",
            Outcome::InFlightRejected,
        )
    }

    fn unknown_token<ResBody>(&self) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::RejectedBadInput);
        refusal(
            StatusCode::BAD_REQUEST,
            "unknown, expired or already used idempotency token\n",
            Outcome::RejectedBadInput,
        )
    }

    fn mismatch<ResBody>(
        &self,
        headers: &http::HeaderMap,
        with: Mismatched,
    ) -> Response<ResponseBody<ResBody>> {
        outcome::record(self.key.preset_arc(), Outcome::Mismatch);
        // The request's id (tower-http's `SetRequestIdLayer`), when it has one.
        let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok());
        log_warn!(
            key = %self.key.redacted(),
            request_id,
            "idempotency key reused with a different payload: possible tampering"
        );
        let _ = request_id;
        let message = match self.key.token_key() {
            Some(_) => {
                "idempotency token already used for a different request (method, path or body)\n"
            }
            None => "idempotency key reused with a different request payload\n",
        };
        let mut res = refusal(StatusCode::UNPROCESSABLE_ENTITY, message, Outcome::Mismatch);
        res.extensions_mut().insert(with);
        res
    }
}

/// The owner's work, polled in the caller's task until it is detached (or
/// dropped) into a tracked task of its own.
struct Detachable {
    work: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
    tasks: TaskTracker,
}

impl Detachable {
    /// Polls the work, if it is still here and not finished.
    fn poll_inline(&mut self, cx: &mut std::task::Context<'_>) {
        if let Some(work) = &mut self.work
            && work.as_mut().poll(cx).is_ready()
        {
            self.work = None;
        }
    }

    /// Moves what is left of the work to a tracked task.
    fn detach(&mut self) {
        if let Some(work) = self.work.take() {
            // Without a runtime (it is shutting down) the work is dropped:
            // its claim guard releases the claim, or its lease runs out.
            if tokio::runtime::Handle::try_current().is_ok() {
                self.tasks.spawn(work);
            }
        }
    }
}

impl Drop for Detachable {
    fn drop(&mut self) {
        self.detach();
    }
}
