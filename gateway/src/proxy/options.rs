//! [`RouteOptions`]: per-route settings of the idempotency stack.

use crate::shed::Slots;
use http::HeaderName;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::dedup::OnStoreError;
use tower_idempotency::key::{AuthorizationHash, CookiePrincipal, HeaderPrincipal, Principal};
use tower_idempotency::order::{Order, OrderLayer};
use tower_idempotency::store::Store;
use tower_idempotency::verify::VerifyLayer;
use tower_idempotency::{IdempotencyLayer, Preset};

/// Settings of one route's idempotency stack; every unset one is the
/// preset's (see [`IdempotencyLayer`]).
///
/// ```
/// use std::time::Duration;
/// use idempotency_gateway::proxy::RouteOptions;
///
/// let opts = RouteOptions::new().window(Duration::from_secs(25 * 3600)).max_body_bytes(64 << 10);
/// assert_eq!(opts.get_max_body_bytes(), Some(64 << 10));
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct RouteOptions {
    window: Option<Duration>,
    lease: Option<Duration>,
    wait: Option<Duration>,
    max_body: Option<usize>,
    principal_header: Option<HeaderName>,
    principal_cookie: Option<CookiePrincipal>,
    on_store_error: Option<OnStoreError>,
    max_run: Option<Duration>,
    reply_timeout: Option<Duration>,
    ack_then_deliver: bool,
    verify: Option<VerifyLayer>,
    in_flight: Option<Slots>,
    queue_wait: Option<Duration>,
    upstream: Option<super::Forward>,
    destinations: Vec<super::Destination>,
    order: Option<Order>,
}

/// The run limit of a route that sets none (the layer's default).
impl RouteOptions {
    /// Every setting the preset's.
    pub const fn new() -> Self {
        Self {
            window: None,
            lease: None,
            wait: None,
            max_body: None,
            principal_header: None,
            principal_cookie: None,
            on_store_error: None,
            max_run: None,
            reply_timeout: None,
            ack_then_deliver: false,
            verify: None,
            in_flight: None,
            queue_wait: None,
            upstream: None,
            destinations: Vec::new(),
            order: None,
        }
    }

    /// The order of the objects the route's notifications are about (see
    /// [`OrderLayer`](tower_idempotency::order::OrderLayer)): behind the
    /// dedup layer, per object one event at a time reaches the upstream, an
    /// event at or behind its object's position is answered with the
    /// channel's success without reaching it (and its copies replay that
    /// answer), and a success moves the position. Queued deliveries of an
    /// acknowledge-then-deliver route go through it too. Kept in the route's
    /// store, for the route's window (or the preset's). Defaults to none.
    pub fn order(mut self, order: Order) -> Self {
        self.order = Some(order);
        self
    }

    /// The route's order, if it has one.
    pub fn get_order(&self) -> Option<&Order> {
        self.order.as_ref()
    }

    /// The route's own upstream: its requests (guarded, and its queued
    /// deliveries) go to `forward` (its own pool, call cap and error
    /// label, see [`ForwardBuilder::name`](super::ForwardBuilder::name))
    /// instead of the gateway's. Defaults to the gateway's forwarder.
    pub fn upstream(mut self, forward: super::Forward) -> Self {
        self.upstream = Some(forward);
        self
    }

    /// Delivers the route's notifications to `destination` (with those
    /// given before): an acknowledge-then-deliver route alone. Each
    /// notification is queued once for every destination it matches, is
    /// acknowledged once all of those are durable (one matching none is
    /// acknowledged, counted as `filtered`, and delivered nowhere), and each
    /// destination's delivery is its own: attempts, dead letters, pause and
    /// fencing token. The route's [`upstream`](Self::upstream) is then not
    /// delivered to.
    pub fn deliver_to(mut self, destination: super::Destination) -> Self {
        self.destinations.push(destination);
        self
    }

    /// The destinations of [`deliver_to`](Self::deliver_to), in order.
    pub fn get_destinations(&self) -> &[super::Destination] {
        &self.destinations
    }

    /// The route's own upstream, if it has one.
    pub fn get_upstream(&self) -> Option<&super::Forward> {
        self.upstream.as_ref()
    }

    /// How long a success is replayed. Defaults to the preset's window.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// The route's own window, if it has one.
    pub fn get_window(&self) -> Option<Duration> {
        self.window
    }

    /// The claim's lease. Defaults to [`IdempotencyLayer`]'s (30 seconds).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long a duplicate waits for the first copy. Defaults to the preset's.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The largest request body, in bytes (413 past it). Defaults to the
    /// preset's.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body = Some(bytes);
        self
    }

    /// Scopes client-API keys to this header's value (a tenant id set by an
    /// auth proxy) instead of the hash of `Authorization`. Channel presets
    /// are never scoped to a principal: a channel is one sender, and a copy
    /// with another header value is the same notification. Defaults to the
    /// preset's principal.
    pub fn principal_header(mut self, name: HeaderName) -> Self {
        self.principal_header = Some(name);
        self
    }

    /// Scopes client-API keys to a hash of this cookie's value (a session
    /// id, for clients without `Authorization`), falling back to the hash of
    /// `Authorization` for requests without the cookie. With
    /// [`principal_header`](Self::principal_header) too, keys are scoped to
    /// both. Never applies to channel presets. Defaults to none.
    pub fn principal_cookie(mut self, cookie: CookiePrincipal) -> Self {
        self.principal_cookie = Some(cookie);
        self
    }

    /// What a store outage does. Defaults to [`OnStoreError::FailClosed`].
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.on_store_error = Some(policy);
        self
    }

    /// The run limit: past it the upstream call is cancelled, the claim
    /// released and the caller gets the retryable failure, so that no key
    /// stays blocked by an upstream that never answers (see
    /// [`IdempotencyLayer::max_run`]). On a guarded route it is also the
    /// hard limit of the upstream call. Defaults to 5 minutes.
    pub fn max_run(mut self, limit: Duration) -> Self {
        self.max_run = Some(limit);
        self
    }

    /// The reply deadline: past it the caller gets the retryable failure
    /// while the upstream call goes on in the background, its claim held,
    /// until it answers or the run limit ends; its success is recorded, so
    /// the next retry replays it (see [`IdempotencyLayer::reply_timeout`]).
    /// Defaults to the [`Forward`](super::Forward)'s timeout.
    pub fn reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = Some(timeout);
        self
    }

    /// At most `max` of the route's calls in flight to the upstream at once
    /// (at least one), counted from the moment a call is sent until its
    /// answer has ended, background calls and acknowledge-then-deliver
    /// deliveries included. Past it a guarded request waits at most the
    /// queue wait for a slot, then gets the channel's retryable failure at
    /// once (`503` with `Retry-After` for a client API), counted as
    /// [`Outcome::Shed`](tower_idempotency::Outcome::Shed); its claim is released, so the
    /// channel's retry runs it. Choose it from the upstream's capacity: its
    /// throughput times its latency.
    ///
    /// The cap is made here and shared by every clone of these options, so
    /// the gateways of several serving threads built from clones share one
    /// cap. It comes on top of the upstream's cap of the
    /// [`Forward`](super::Forward) ([`CallLimit`](super::CallLimit)).
    /// Defaults to a share of the upstream's cap: half of it, so that one
    /// slow route cannot hold every slot (set a larger one here to let it).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_gateway::proxy::RouteOptions;
    ///
    /// let opts = RouteOptions::new().max_in_flight(20).queue_wait(Duration::from_millis(100));
    /// assert_eq!(opts.get_max_in_flight(), Some(20));
    /// assert_eq!(opts.clone().get_queue_wait(), Some(Duration::from_millis(100)));
    /// ```
    pub fn max_in_flight(mut self, max: usize) -> Self {
        self.in_flight = Some(Slots::new(max));
        self
    }

    /// The cap set with [`max_in_flight`](Self::max_in_flight), if any
    /// (an adaptive cap's limit now).
    pub fn get_max_in_flight(&self) -> Option<usize> {
        self.in_flight.as_ref().map(Slots::max)
    }

    /// A cap on the route's calls in flight to the upstream that adapts to
    /// the upstream's answers (see [`AimdLimit`](crate::shed::AimdLimit)):
    /// its failures (5xx, 429, no answer) and slow answers shrink it, its
    /// fast successes grow it; past it, as with
    /// [`max_in_flight`](Self::max_in_flight). Defaults to none.
    ///
    /// ```
    /// use idempotency_gateway::proxy::RouteOptions;
    /// use idempotency_gateway::shed::AimdLimit;
    ///
    /// let aimd = AimdLimit::new().max(40);
    /// let opts = RouteOptions::new().adaptive_in_flight(aimd);
    /// assert_eq!(opts.get_adaptive_in_flight(), Some(aimd));
    /// assert_eq!(opts.get_max_in_flight(), Some(20));
    /// ```
    pub fn adaptive_in_flight(mut self, limit: crate::shed::AimdLimit) -> Self {
        self.in_flight = Some(Slots::adaptive(limit));
        self
    }

    /// A cap on the route's calls in flight counted against `slots`, shared
    /// with every holder of a clone (other routes to the same upstream, or
    /// code that watches an adaptive limit with [`Slots::max`]). Defaults to
    /// none.
    pub fn shared_in_flight(mut self, slots: Slots) -> Self {
        self.in_flight = Some(slots);
        self
    }

    /// The adaptive cap set with [`adaptive_in_flight`](Self::adaptive_in_flight), if any.
    pub fn get_adaptive_in_flight(&self) -> Option<crate::shed::AimdLimit> {
        self.in_flight.as_ref().and_then(Slots::aimd)
    }

    /// How long a guarded request waits for a slot of the route's cap
    /// before it is shed; zero sheds at once. Defaults to the queue wait of
    /// the [`Forward`](super::Forward)'s [`CallLimit`](super::CallLimit)
    /// (50 milliseconds unless set).
    pub fn queue_wait(mut self, wait: Duration) -> Self {
        self.queue_wait = Some(wait);
        self
    }

    /// The queue wait set with [`queue_wait`](Self::queue_wait), if any.
    pub fn get_queue_wait(&self) -> Option<Duration> {
        self.queue_wait
    }

    /// The route's cap, shared by the clones of these options.
    pub(crate) fn in_flight_slots(&self) -> Option<&Slots> {
        self.in_flight.as_ref()
    }

    /// The run limit set with [`max_run`](Self::max_run), if any.
    pub fn get_max_run(&self) -> Option<Duration> {
        self.max_run
    }

    /// The reply deadline set with [`reply_timeout`](Self::reply_timeout),
    /// if any.
    pub fn get_reply_timeout(&self) -> Option<Duration> {
        self.reply_timeout
    }

    /// Acknowledge, then deliver: answer the channel's success reply as soon
    /// as the notification is durably queued (in the queue given to
    /// [`GatewayBuilder::queue`](super::GatewayBuilder::queue)), and deliver
    /// it to the upstream later, through the dedup layer, with retries.
    /// Only for a channel preset route. Defaults to `false`: the upstream
    /// answers before the channel is answered.
    pub fn ack_then_deliver(mut self, ack: bool) -> Self {
        self.ack_then_deliver = ack;
        self
    }

    /// Whether the route acknowledges, then delivers.
    pub fn is_ack_then_deliver(&self) -> bool {
        self.ack_then_deliver
    }

    /// Checks each request's signature with `verify` before the claim (see
    /// [`IdempotencyLayer::verify`]): a forged or stale notification gets the
    /// channel's failure reply and never reaches the store or the upstream.
    /// Build it from the channel's keys (`StripeKeys`, `WechatPayV3Keys`…, the
    /// `verify` feature) or from a
    /// [`VerifyConfig`](crate::config::VerifyConfig). Only for a route with
    /// one preset: [`GatewayBuilder::build`](super::GatewayBuilder::build)
    /// refuses it on an `auto` route. Defaults to no verification.
    ///
    /// ```
    /// # #[cfg(feature = "verify")] {
    /// use idempotency_gateway::proxy::{Forward, Gateway, RouteError, RouteOptions, Target};
    /// use tower_idempotency::store::MemoryStore;
    /// use tower_idempotency::verify::StripeKeys;
    /// use tower_idempotency::Preset;
    ///
    /// let opts = RouteOptions::new().verify(StripeKeys::new().secret("whsec_test_secret").unwrap());
    /// assert!(opts.verifies());
    /// let gateway = |target| {
    ///     let forward = Forward::new("http://127.0.0.1:1".parse().unwrap());
    ///     Gateway::builder(forward, MemoryStore::new())
    ///         .route_with("/notify", target, opts.clone())
    ///         .build()
    /// };
    /// assert!(gateway(Target::Preset(Preset::stripe())).is_ok());
    /// assert!(matches!(gateway(Target::Auto), Err(RouteError::VerifyOnAuto(_))));
    /// # }
    /// ```
    pub fn verify(mut self, verify: impl Into<VerifyLayer>) -> Self {
        self.verify = Some(verify.into());
        self
    }

    /// Whether [`verify`](Self::verify) was given a layer that verifies.
    pub fn verifies(&self) -> bool {
        self.verify.as_ref().is_some_and(VerifyLayer::is_on)
    }

    /// What reads a queued notification of a route with an order again at
    /// delivery (see [`VerifyLayer::reopen`]): its verifier, when it
    /// verifies and has an order.
    pub(crate) fn reopener(&self) -> Option<&VerifyLayer> {
        self.order.as_ref()?;
        self.verify.as_ref().filter(|v| v.is_on())
    }

    /// The same settings without verification: the stack that delivers a
    /// queued notification, verified once when it was queued.
    pub(crate) fn without_verify(&self) -> Self {
        Self {
            verify: None,
            ..self.clone()
        }
    }

    /// The largest request body set with [`max_body_bytes`](Self::max_body_bytes), if any.
    pub fn get_max_body_bytes(&self) -> Option<usize> {
        self.max_body
    }

    /// The body limit for `preset`.
    pub(crate) fn body_limit(&self, preset: &Preset) -> usize {
        self.max_body.unwrap_or_else(|| preset.max_body_bytes())
    }

    /// The layer for `preset` with these settings.
    pub(crate) fn layer<S: Store>(&self, preset: Preset, store: S) -> IdempotencyLayer<S> {
        let limit = self.body_limit(&preset);
        let principal = self.principal_for(&preset);
        // The gateway warns about an unverified route once, at start.
        let mut layer = IdempotencyLayer::new_in(preset, store)
            .max_body_bytes(limit)
            .quiet();
        if let Some(policy) = self.on_store_error {
            layer = layer.on_store_error(policy);
        }
        if let Some(window) = self.window {
            layer = layer.window(window);
        }
        if let Some(lease) = self.lease {
            layer = layer.lease(lease);
        }
        if let Some(wait) = self.wait {
            layer = layer.wait(wait);
        }
        if let Some(principal) = principal {
            layer = layer.principal(principal);
        }
        if let Some(limit) = self.max_run {
            layer = layer.max_run(limit);
        }
        if let Some(timeout) = self.reply_timeout {
            layer = layer.reply_timeout(timeout);
        }
        if let Some(verify) = &self.verify {
            layer = layer.verify(verify.clone());
        }
        layer
    }

    /// The order layer of these settings for `preset`'s events, over `store`.
    pub(crate) fn order_layer<S: Store>(&self, preset: &Preset, store: S) -> Option<OrderLayer<S>> {
        let order = self.order.clone()?;
        let mut layer = OrderLayer::new(order, store)
            .ttl(self.window.unwrap_or_else(|| preset.window()))
            .wait(self.wait.unwrap_or_else(|| preset.wait()));
        if let Some(lease) = self.lease {
            layer = layer.lease(lease);
        }
        Some(layer)
    }

    /// The principal of `preset`'s keys when these options set one: only
    /// client-API presets have a principal.
    pub(crate) fn principal_for(&self, preset: &Preset) -> Option<Arc<dyn Principal>> {
        if !preset.is_client_api() {
            return None;
        }
        let header = self.principal_header.clone().map(HeaderPrincipal);
        let cookie = self
            .principal_cookie
            .clone()
            .map(|c| c.or(AuthorizationHash));
        Some(match (header, cookie) {
            (Some(h), Some(c)) => Arc::new(h.and(c)),
            (Some(h), None) => Arc::new(h),
            (None, Some(c)) => Arc::new(c),
            (None, None) => return None,
        })
    }
}
