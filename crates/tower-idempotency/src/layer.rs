//! [`IdempotencyLayer`]: the layers composed for one preset.

use crate::dedup::{Dedup, DedupLayer, OnStoreError};
use crate::key::{AuthorizationHash, Key, KeyLayer, Principal};
use crate::normalize::{Normalize, NormalizeLayer};
use crate::store::{MemoryStore, Store};
use crate::verify::{Verify, VerifyLayer};
use crate::Preset;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_layer::Layer;

/// The full stack for one route: [`Normalize`] → [`Verify`] → [`Key`] →
/// [`Dedup`] → inner.
pub type Idempotency<S, St = MemoryStore> = Normalize<Verify<Key<Dedup<S, St>>>>;

/// The normalize, verify, key and dedup layers composed for one [`Preset`]
/// (verification is off until [`verify`](Self::verify) is given keys).
///
/// Adding WeChat Pay v3 to an axum route is one line (give it the channel's
/// keys with [`verify`](Self::verify) too, or anyone can post a notification):
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_idempotency::IdempotencyLayer;
///
/// async fn on_paid(body: String) -> &'static str {
///     // mark the order paid…
///     "ok"
/// }
///
/// let app: Router = Router::new()
///     .route("/notify/wechat", post(on_paid).layer(IdempotencyLayer::wechatpay_v3()));
/// ```
///
/// Each builder method documents its default; the preset sets the window,
/// wait and body limit. Clones share the store, so one layer value (or one
/// store passed to several layers) protects every instance of a route.
///
/// A channel preset without [`verify`](Self::verify) accepts notifications
/// that nobody signed, and WeChat Pay v3 resources stay encrypted: with the
/// `tracing` feature the layer says so once, at a warning level, the first
/// time it is applied to a service.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer<St = MemoryStore> {
    key: KeyLayer,
    dedup: DedupLayer<St>,
    normalize: NormalizeLayer,
    verify: VerifyLayer,
    /// Channel presets only: set once the "unverified" warning was given (or
    /// when it must not be: the gateway warns per route itself).
    unverified_warned: Option<Arc<AtomicBool>>,
}

impl IdempotencyLayer<MemoryStore> {
    /// The stack for `preset` with its own in-memory store.
    pub fn new(preset: Preset) -> Self {
        Self::new_in(preset, MemoryStore::new())
    }

    /// WeChat Pay API v3.
    pub fn wechatpay_v3() -> Self {
        Self::new(Preset::wechatpay_v3())
    }

    /// WeChat Pay API v2.
    pub fn wechatpay_v2() -> Self {
        Self::new(Preset::wechatpay_v2())
    }

    /// Alipay.
    pub fn alipay() -> Self {
        Self::new(Preset::alipay())
    }

    /// Stripe.
    pub fn stripe() -> Self {
        Self::new(Preset::stripe())
    }

    /// PayPal.
    pub fn paypal() -> Self {
        Self::new(Preset::paypal())
    }

    /// Adyen.
    pub fn adyen() -> Self {
        Self::new(Preset::adyen())
    }

    /// Standard Webhooks.
    pub fn standard_webhooks() -> Self {
        Self::new(Preset::standard_webhooks())
    }

    /// Client APIs with the `Idempotency-Key` header.
    pub fn idempotency_key() -> Self {
        Self::new(Preset::idempotency_key())
    }

    /// Client APIs with one-time tokens in `Idempotency-Token`. Issue the
    /// tokens with [`IssueToken`](crate::token::IssueToken) over the same store.
    pub fn client_token() -> Self {
        Self::new(Preset::client_token())
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// The stack for `preset` over `store`: the same as
    /// `IdempotencyLayer::new(preset).with_store(store)`, without creating
    /// the in-memory store first.
    pub fn new_in(preset: Preset, store: St) -> Self {
        let mut key = KeyLayer::from_arc(preset.extractor().clone(), preset.describe().clone())
            .preset(Arc::<str>::from(preset.name()))
            .max_body_bytes(preset.max_body_bytes());
        if preset.is_client_api() {
            key = key.principal(AuthorizationHash);
        }
        if preset.consumes_token() {
            key = key.consume_token(true);
        }
        if !preset.key_required() {
            key = key.required(false);
        }
        let dedup = DedupLayer::new(store)
            .window(preset.window())
            .wait(preset.wait());
        Self {
            key,
            dedup,
            normalize: NormalizeLayer::new(preset.reply().clone()),
            verify: VerifyLayer::off()
                .preset(Arc::<str>::from(preset.name()))
                .max_body_bytes(preset.max_body_bytes()),
            unverified_warned: (!preset.is_client_api()).then(Arc::default),
        }
    }

    /// The same settings over another store (e.g. one shared by several
    /// routes). Defaults to an in-memory store of this layer's own.
    pub fn with_store<St2: Store>(self, store: St2) -> IdempotencyLayer<St2> {
        IdempotencyLayer {
            key: self.key,
            dedup: self.dedup.with_store(store),
            normalize: self.normalize,
            verify: self.verify,
            unverified_warned: self.unverified_warned,
        }
    }

    /// How long a success is replayed. Defaults to the preset's: longer
    /// than its channel keeps retrying (25 h for WeChat Pay, 26 h for
    /// Alipay, 30 h for Standard Webhooks, 4 days for Stripe and PayPal, 31
    /// days for Adyen), 24 h for client keys.
    pub fn window(mut self, window: Duration) -> Self {
        self.dedup = self.dedup.window(window);
        self
    }

    /// The claim's lease, renewed every `lease/3`. Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.dedup = self.dedup.lease(lease);
        self
    }

    /// How long a duplicate waits for the first. Defaults to 4 seconds.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.dedup = self.dedup.wait(wait);
        self
    }

    /// The timeout of every store call. Defaults to 1 second.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.dedup = self.dedup.store_timeout(timeout);
        self
    }

    /// What to do when the store fails. Defaults to [`OnStoreError::FailClosed`].
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.dedup = self.dedup.on_store_error(policy);
        self
    }

    /// Finish the inner call when the caller hangs up. Defaults to `true`.
    pub fn finish_on_disconnect(mut self, finish: bool) -> Self {
        self.dedup = self.dedup.finish_on_disconnect(finish);
        self
    }

    /// Strict mode: copies get 409 "duplicate submission" instead of waiting
    /// for and replaying the first response. Defaults to `false`.
    pub fn strict(mut self, strict: bool) -> Self {
        self.dedup = self.dedup.strict(strict);
        self
    }

    /// How long a consumed client token lives again when its request fails,
    /// so that the client can retry with it. Defaults to 5 minutes.
    pub fn token_ttl(mut self, ttl: Duration) -> Self {
        self.dedup = self.dedup.token_ttl(ttl);
        self
    }

    /// The run limit: past it the inner call is cancelled, its claim
    /// released, and the caller gets the retryable failure (the channel's
    /// failure reply, or 503 with `Retry-After`). See
    /// [`DedupLayer::max_run`]. Defaults to 5 minutes.
    pub fn max_run(mut self, limit: Duration) -> Self {
        self.dedup = self.dedup.max_run(limit);
        self
    }

    /// The reply deadline: past it the caller gets the retryable failure
    /// while the inner call goes on in the background, so that its success
    /// is recorded and the next retry replays it. See
    /// [`DedupLayer::reply_timeout`]. Defaults to none.
    pub fn reply_timeout(mut self, timeout: Duration) -> Self {
        self.dedup = self.dedup.reply_timeout(timeout);
        self
    }

    /// Whether each guarded response carries its
    /// [`IdempotencyKey`](crate::IdempotencyKey) in its extensions (see
    /// [`DedupLayer::key_in_response`]). Defaults to `true`.
    pub fn key_in_response(mut self, on: bool) -> Self {
        self.dedup = self.dedup.key_in_response(on);
        self
    }

    /// The tracker that background work is spawned on; share one across
    /// layers and wait for it at shutdown (`tracker.close();
    /// tracker.wait().await`). See [`DedupLayer::task_tracker`]. Defaults to
    /// a tracker of this layer's own.
    pub fn task_tracker(mut self, tracker: crate::TaskTracker) -> Self {
        self.dedup = self.dedup.task_tracker(tracker);
        self
    }

    /// The tracker background work is spawned on.
    pub fn tasks(&self) -> &crate::TaskTracker {
        self.dedup.tasks()
    }

    /// The largest response body kept for replay, in bytes. Defaults to 1 MiB.
    pub fn max_cached_body_bytes(mut self, bytes: usize) -> Self {
        self.dedup = self.dedup.max_cached_body_bytes(bytes);
        self
    }

    /// The largest request body, in bytes (413 past it). Defaults to the
    /// preset's (64 KiB for channels, 1 MiB for client keys).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.key = self.key.max_body_bytes(bytes);
        self.verify = self.verify.max_body_bytes(bytes);
        self
    }

    /// The longest key accepted (400 past it). Defaults to 256 bytes.
    pub fn max_key_len(mut self, bytes: usize) -> Self {
        self.key = self.key.max_key_len(bytes);
        self
    }

    /// Whether a request without a key gets 400. Defaults to `true`.
    pub fn required(mut self, required: bool) -> Self {
        self.key = self.key.required(required);
        self
    }

    /// Who is asking. Defaults to nobody for channels and a hash of
    /// `Authorization` for client keys.
    pub fn principal(mut self, principal: impl Principal) -> Self {
        self.key = self.key.principal(principal);
        self
    }

    /// The route part of stored keys. Defaults to the request path.
    pub fn route(mut self, route: impl Into<Arc<str>>) -> Self {
        self.key = self.key.route(route);
        self
    }

    /// The first part of stored keys. Defaults to `idem`.
    pub fn prefix(mut self, prefix: impl Into<Cow<'static, str>>) -> Self {
        self.key = self.key.prefix(prefix);
        self
    }

    /// Verifies the sender before the key is claimed: pass the channel's keys
    /// (for example `WechatPayV3Keys`, with the `verify` feature: see
    /// [`verify`](crate::verify)) or a [`VerifyLayer`] (to inject a clock). A
    /// request that does not verify gets the channel's failure reply with
    /// status 401 and never touches the store. Defaults to no verification.
    pub fn verify(mut self, verify: impl Into<VerifyLayer>) -> Self {
        let preset = self.verify.preset.clone();
        let max_body = self.verify.max_body;
        self.verify = verify.into().preset(preset).max_body_bytes(max_body);
        self
    }

    /// The store.
    pub fn store(&self) -> &St {
        self.dedup.store()
    }

    /// The key layer (its principal and prefix, for the token issuer).
    pub(crate) fn key_layer(&self) -> &KeyLayer {
        &self.key
    }

    /// Whether each response of a request that had a key carries the
    /// request's buffered body (and the decrypted WeChat Pay v3 resource) as
    /// a [`CapturedRequest`](crate::key::CapturedRequest) in its extensions,
    /// for a journal of what the channel sent (see
    /// [`KeyLayer::capture_request`]). Defaults to `false`.
    pub fn capture_request(mut self, capture: bool) -> Self {
        self.key = self.key.capture_request(capture);
        self
    }

    /// No warning from this layer that its channel route runs without
    /// verification: for a program that warns in its own words (a gateway
    /// names the route from its config). Defaults to warning once.
    pub fn quiet(mut self) -> Self {
        self.unverified_warned = None;
        self
    }

    /// Warns once per layer (clones included) that a channel runs unverified.
    fn warn_if_unverified(&self) {
        let Some(warned) = &self.unverified_warned else {
            return;
        };
        if self.verify.is_on() || warned.swap(true, Ordering::Relaxed) {
            return;
        }
        let preset = &self.verify.preset;
        crate::outcome::log_warn!(
            preset = %preset,
            "a {preset} route runs without verification: notifications nobody signed \
             run the handler and nothing is decrypted; give the channel's keys to .verify(..)"
        );
        let _ = preset;
    }

    /// The layers in front of the dedup layer (normalize, verify, key) over
    /// `inner`, without the dedup layer: for a route that queues each
    /// notification (acknowledge, then deliver later through the whole
    /// stack) instead of running its handler now. A notification that fails
    /// verification is refused before it is queued; `inner` sees its
    /// [`IdempotencyKey`](crate::IdempotencyKey) in the request's
    /// extensions.
    pub fn front<S>(&self, inner: S) -> Normalize<Verify<Key<S>>> {
        self.normalize
            .layer(self.verify.layer(self.key.layer(inner)))
    }
}

impl<S, St: Store> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        self.warn_if_unverified();
        self.normalize
            .layer(self.verify.layer(self.key.layer(self.dedup.layer(inner))))
    }
}
