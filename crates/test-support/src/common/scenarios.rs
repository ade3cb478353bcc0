//! The channel scenarios of the `channels*` tests: each vector of a preset
//! through `IdempotencyLayer::<preset>()` around a `service_fn` handler.
//!
//! - `key_and_success`: the scoped key ends with the channel's key, the
//!   handler sees the same bytes, and any 2xx becomes the exact success reply;
//! - `failure_not_cached`: a handler 500 becomes the failure reply and the
//!   retry runs the handler again;
//! - `storm`: K identical copies at the same instant through a real hyper
//!   server run the handler once and all get the success reply;
//! - `storm_after_failure`: the same storm when the first run fails;
//! - `in_flight`: a copy whose wait for the running first one runs out gets
//!   a retryable answer, never a success;
//! - `resent_and_tampered`: a re-signed, re-timestamped copy replays, the
//!   same key with another business field gets the failure reply;
//! - `limits`: 413 past the body limit, 400 for a malformed body or a missing
//!   key, in the channel's failure form.

use super::vectors::*;
use super::{all_at_once, client, post, read, request, serve, Answer, Counter};
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::util::ServiceFn;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::{Idempotency, IdempotencyKey, IdempotencyLayer};

/// Copies of one notification sent at the same instant.
pub const K: usize = 7;

// ---------------------------------------------------------------------------
// The handler and the stack.
// ---------------------------------------------------------------------------

pub const HANDLER_CT: &str = "application/x-handler";
pub const HANDLER_OK: &[u8] = b"ok";
pub const HANDLER_FAILED: &str = "handler failed";

pub type HandlerResult = Result<Response<Full<Bytes>>, Infallible>;
pub type HandlerFuture = Pin<Box<dyn Future<Output = HandlerResult> + Send>>;

/// The scoped key (if any) and the body of one call the handler got.
pub type Seen = (Option<String>, Bytes);

/// A business handler: answers `status` (500 for its first `fail_first`
/// calls), counts its calls and keeps the scoped keys and bodies it saw.
#[derive(Clone)]
pub struct Handler {
    pub calls: Counter,
    pub status: u16,
    pub fail_first: usize,
    pub delay: Duration,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Handler {
    pub fn answering(status: u16) -> Self {
        Self {
            calls: Counter::default(),
            status,
            fail_first: 0,
            delay: Duration::ZERO,
            seen: Arc::default(),
        }
    }

    pub fn failing_first(mut self, n: usize) -> Self {
        self.fail_first = n;
        self
    }

    /// Slow enough for K copies sent at once to overlap.
    pub fn slow(self) -> Self {
        self.taking(Duration::from_millis(300))
    }

    pub fn taking(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub fn calls(&self) -> usize {
        self.calls.get()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// What the handler answers when it succeeds.
    pub fn ok_body(&self) -> &'static [u8] {
        if self.status == 204 {
            b""
        } else {
            HANDLER_OK
        }
    }

    pub async fn handle(self, req: Request<Full<Bytes>>) -> HandlerResult {
        let n = self.calls.bump();
        let key = req
            .extensions()
            .get::<IdempotencyKey>()
            .map(|k| k.as_str().to_owned());
        let body = req.into_body().collect().await.unwrap().to_bytes();
        self.seen.lock().unwrap().push((key, body));
        tokio::time::sleep(self.delay).await;
        let (status, body) = if n <= self.fail_first {
            (500, HANDLER_FAILED.as_bytes())
        } else {
            (self.status, self.ok_body())
        };
        Ok(Response::builder()
            .status(status)
            .header(CONTENT_TYPE, HANDLER_CT)
            .body(Full::new(Bytes::from_static(body)))
            .unwrap())
    }

    /// `IdempotencyLayer::<preset>()` around this handler.
    pub fn stack(
        &self,
        channel: &Channel,
    ) -> Idempotency<
        ServiceFn<impl FnMut(Request<Full<Bytes>>) -> HandlerFuture + Clone + Send + use<>>,
    > {
        self.stack_with((channel.layer)())
    }

    /// `layer` around this handler.
    pub fn stack_with(
        &self,
        layer: IdempotencyLayer,
    ) -> Idempotency<
        ServiceFn<impl FnMut(Request<Full<Bytes>>) -> HandlerFuture + Clone + Send + use<>>,
    > {
        let handler = self.clone();
        layer.layer(service_fn(move |req| {
            Box::pin(handler.clone().handle(req)) as HandlerFuture
        }))
    }
}

// ---------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------
/// The reply to a success of `handler`.
pub fn success_reply(channel: &Channel, handler: &Handler) -> Expect {
    channel.success.unwrap_or(Expect {
        status: handler.status,
        ct: Ct::Has(HANDLER_CT),
        body: BodyCheck::Exact(handler.ok_body()),
    })
}

/// The reply to a handler failure.
pub fn failure_reply(channel: &Channel) -> Expect {
    channel.failure.with(channel.failure.status, HANDLER_FAILED)
}

/// The reply to a reused key with another payload.
pub fn mismatch_reply(channel: &Channel) -> Expect {
    channel
        .failure
        .with(channel.mismatch_status, "different request payload")
}

/// The reply to a copy whose wait for the first ran out.
pub fn busy_reply(channel: &Channel) -> Expect {
    channel
        .failure
        .with(channel.busy_status, "still in progress")
}

/// The layers' own answer to a bad request: its status, the channel's form.
pub fn rejection(channel: &Channel, status: u16, hint: &'static str) -> Expect {
    channel.failure.with(status, hint)
}

/// The stack as the tests call it.
pub trait Stack:
    tower::Service<
        Request<Full<Bytes>>,
        Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
        Error = Infallible,
    > + Clone
{
}

impl<S> Stack for S where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
{
}

/// Sends one request through `svc` with `oneshot`.
pub async fn send(svc: &impl Stack, path: &str, req: &Req) -> Answer {
    let res = svc
        .clone()
        .oneshot(request(path, &req.header_refs(), req.body.clone()))
        .await
        .unwrap();
    read(res).await
}

/// Sends K copies of `req` at the same instant through a real hyper server.
pub async fn storm_of(v: &'static Vector, handler: &Handler, req: Req) -> Vec<Answer> {
    let (addr, server) = serve(handler.stack(v.channel)).await;
    let http = client();
    let answers = all_at_once(K, |_| {
        let (http, req) = (http.clone(), req.clone());
        async move {
            post(
                &http,
                addr,
                v.channel.path,
                &req.header_refs(),
                req.body.clone(),
            )
            .await
        }
    })
    .await;
    server.abort();
    answers
}

pub fn replayed(answers: &[Answer]) -> usize {
    answers.iter().filter(|a| a.replayed()).count()
}

// ---------------------------------------------------------------------------
// Scenarios, each run for every vector of a preset.
// ---------------------------------------------------------------------------

/// The scoped key, the bytes handed on, and the success reply to any 2xx.
pub async fn key_and_success(v: &'static Vector) {
    let base = v.base();
    for status in [200, 201, 202, 204] {
        let what = format!("{}, handler {status}", v.label());
        let handler = Handler::answering(status);
        let svc = handler.stack(v.channel);
        let ok = success_reply(v.channel, &handler);

        let first = send(&svc, v.channel.path, &base).await;
        check(&first, ok, &what);
        assert!(!first.replayed(), "{what}: the first copy is not a replay");

        let seen = handler.seen();
        assert_eq!(seen.len(), 1, "{what}: handler calls");
        let (key, body) = &seen[0];
        let key = key.as_deref().expect("an IdempotencyKey extension");
        let scope = format!("idem:{}:{}:", v.channel.name, v.channel.path);
        assert!(key.starts_with(&scope), "{what}: {key} not in {scope}");
        assert!(
            key.ends_with(&format!(":{}", v.key)),
            "{what}: {key} not ending with {}",
            v.key
        );
        if !(v.channel.preset)().is_client_api() {
            // Channels have no principal: the key follows the scope.
            assert_eq!(key, format!("{scope}:{}", v.key), "{what}: scoped key");
        }
        assert_eq!(body, &base.body, "{what}: the handler gets the same bytes");

        let again = send(&svc, v.channel.path, &base).await;
        check(&again, ok, &format!("{what}, replay"));
        assert!(again.replayed(), "{what}: the second copy is a replay");
        assert_eq!(handler.calls(), 1, "{what}: handler calls");
    }
}

/// A failure gets the failure reply and is not cached: the retry runs.
pub async fn failure_not_cached(v: &'static Vector) {
    let what = v.label();
    let base = v.base();
    let handler = Handler::answering(200).failing_first(1);
    let svc = handler.stack(v.channel);
    let ok = success_reply(v.channel, &handler);

    let failed = send(&svc, v.channel.path, &base).await;
    check(
        &failed,
        failure_reply(v.channel),
        &format!("{what}, failure"),
    );
    assert!(!failed.replayed(), "{what}: a failure is not a replay");
    assert_eq!(handler.calls(), 1, "{what}: handler calls");

    let retry = send(&svc, v.channel.path, &base).await;
    check(&retry, ok, &format!("{what}, retry"));
    assert!(!retry.replayed(), "{what}: the retry runs the handler");
    assert_eq!(handler.calls(), 2, "{what}: the retry runs the handler");

    let third = send(&svc, v.channel.path, &base).await;
    check(&third, ok, &format!("{what}, third"));
    assert!(third.replayed(), "{what}: the third copy is a replay");
    assert_eq!(handler.calls(), 2, "{what}: handler calls");
}

/// K copies at once through hyper: one run, K success replies.
pub async fn storm(v: &'static Vector) {
    let what = v.label();
    let handler = Handler::answering(200).slow();
    let answers = storm_of(v, &handler, v.base()).await;
    assert_eq!(handler.calls(), 1, "{what}: handler calls");
    let ok = success_reply(v.channel, &handler);
    for (i, ans) in answers.iter().enumerate() {
        check(ans, ok, &format!("{what}, copy {i}"));
    }
    assert_eq!(replayed(&answers), K - 1, "{what}: replays");
}

/// K copies at once when the first run fails: that copy gets the failure
/// reply, one waiter runs the handler again, the rest replay its success.
pub async fn storm_after_failure(v: &'static Vector) {
    let what = v.label();
    let handler = Handler::answering(200).failing_first(1).slow();
    let answers = storm_of(v, &handler, v.base()).await;
    assert_eq!(handler.calls(), 2, "{what}: handler calls");
    let failure = failure_reply(v.channel);
    let (failed, ok): (Vec<_>, Vec<_>) = answers.iter().partition(|a| a.status == failure.status);
    assert_eq!(failed.len(), 1, "{what}: failures {answers:#?}");
    check(failed[0], failure, &format!("{what}, failed copy"));
    assert!(!failed[0].replayed(), "{what}: a failure is not a replay");
    for (i, ans) in ok.iter().enumerate() {
        check(
            ans,
            success_reply(v.channel, &handler),
            &format!("{what}, copy {i}"),
        );
    }
    assert_eq!(replayed(&answers), K - 2, "{what}: replays");
}

/// A copy whose wait for the running first one runs out gets a retryable
/// answer (the channel's failure reply, 409 for client keys), never a
/// success; the next retry replays.
pub async fn in_flight(v: &'static Vector) {
    let what = v.label();
    let base = v.base();
    // The first runs for a second; the second copy comes after 50 ms and
    // gives up waiting 50 ms later.
    let handler = Handler::answering(200).taking(Duration::from_secs(1));
    let svc = handler.stack_with((v.channel.layer)().wait(Duration::from_millis(50)));
    let ok = success_reply(v.channel, &handler);

    let (first, second) = tokio::join!(send(&svc, v.channel.path, &base), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        send(&svc, v.channel.path, &base).await
    });
    check(&first, ok, &format!("{what}, first"));
    check(&second, busy_reply(v.channel), &format!("{what}, busy"));
    assert!(!second.replayed(), "{what}: a busy answer is not a replay");
    if (v.channel.preset)().is_client_api() {
        assert!(
            second.headers.contains_key("retry-after"),
            "{what}: Retry-After"
        );
    }
    assert_eq!(handler.calls(), 1, "{what}: handler calls");

    let retry = send(&svc, v.channel.path, &base).await;
    check(&retry, ok, &format!("{what}, retry"));
    assert!(retry.replayed(), "{what}: the retry is a replay");
    assert_eq!(handler.calls(), 1, "{what}: handler calls");
}

/// A re-signed copy replays; the same key with another business field is
/// refused without running the handler, and does not spoil the record.
pub async fn resent_and_tampered(v: &'static Vector) {
    let what = v.label();
    let base = v.base();
    let handler = Handler::answering(200);
    let svc = handler.stack(v.channel);
    let ok = success_reply(v.channel, &handler);

    check(&send(&svc, v.channel.path, &base).await, ok, &what);

    let resent = send(&svc, v.channel.path, &v.resent.apply(&base)).await;
    check(&resent, ok, &format!("{what}, resent"));
    assert!(resent.replayed(), "{what}: a re-signed copy is a replay");

    let tampered = send(&svc, v.channel.path, &v.tampered.apply(&base)).await;
    if v.fingerprinted {
        check(
            &tampered,
            mismatch_reply(v.channel),
            &format!("{what}, tampered"),
        );
        assert!(
            !tampered.replayed(),
            "{what}: a tampered copy is not a replay"
        );
    } else {
        // The preset has no fingerprint fields, so the key alone decides.
        check(&tampered, ok, &format!("{what}, other body"));
        assert!(tampered.replayed(), "{what}: the key alone decides");
    }
    assert_eq!(handler.calls(), 1, "{what}: handler calls");

    let genuine = send(&svc, v.channel.path, &base).await;
    check(&genuine, ok, &format!("{what}, genuine retry"));
    assert!(
        genuine.replayed(),
        "{what}: the genuine retry still replays"
    );
    assert_eq!(handler.calls(), 1, "{what}: handler calls");
}

/// 413 one byte past the limit (streamed or declared), 400 for malformed
/// bodies and missing keys, the limit itself accepted.
pub async fn limits(v: &'static Vector) {
    let what = v.label();
    let limit = v.channel.max_body;
    assert_eq!(
        (v.channel.preset)().max_body_bytes(),
        limit,
        "{what}: body limit"
    );
    let base = v.base();
    let handler = Handler::answering(200);
    let svc = handler.stack(v.channel);
    let too_large = rejection(v.channel, 413, "too large");

    let over = base.with_body(v.pad.to(&base.body, limit + 1));
    check(
        &send(&svc, v.channel.path, &over).await,
        too_large,
        &format!("{what}, over"),
    );
    for (i, (edit, hint)) in v.malformed.iter().enumerate() {
        let ans = send(&svc, v.channel.path, &edit.apply(&base)).await;
        check(
            &ans,
            rejection(v.channel, 400, hint),
            &format!("{what}, malformed {i}"),
        );
    }
    assert_eq!(handler.calls(), 0, "{what}: rejected before the handler");

    let full = base.with_body(v.pad.to(&base.body, limit));
    let ans = send(&svc, v.channel.path, &full).await;
    check(
        &ans,
        success_reply(v.channel, &handler),
        &format!("{what}, at the limit"),
    );
    assert_eq!(handler.calls(), 1, "{what}: handler calls");

    // Through hyper the length is declared up front.
    let (addr, server) = serve(handler.stack(v.channel)).await;
    let ans = post(
        &client(),
        addr,
        v.channel.path,
        &over.header_refs(),
        over.body.clone(),
    )
    .await;
    server.abort();
    check(&ans, too_large, &format!("{what}, over, declared"));
    assert_eq!(handler.calls(), 1, "{what}: handler calls");
}

/// `mod PRESET { #[tokio::test] async fn SCENARIO() }` for every scenario
/// above, each run over every vector of the preset.
#[macro_export]
macro_rules! channel_tests {
    ($($preset:ident: $vectors:expr;)*) => {$(
        mod $preset {
            use super::*;

            const VECTORS: &[$crate::common::vectors::Vector] = $vectors;

            $crate::channel_tests!(@each key_and_success, failure_not_cached, storm,
                storm_after_failure, in_flight, resent_and_tampered, limits);
        }
    )*};
    (@each $($scenario:ident),*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $scenario() {
            for v in VECTORS {
                $crate::common::scenarios::$scenario(v).await;
            }
        }
    )*};
}
