//! [`OrderLayer`]: an [`Order`] applied behind the dedup layer.

use super::service::Ordered;
use super::Order;
use crate::store::Store;
use crate::{Fingerprint, IdempotencyKey};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;
use tower_layer::Layer;

/// What every [`Ordered`] service of one layer shares.
#[derive(Debug)]
pub(super) struct OrderConfig {
    pub(super) order: Order,
    /// The order's name, for metrics and logs.
    pub(super) name: Arc<str>,
    pub(super) prefix: Cow<'static, str>,
    pub(super) lease: Duration,
    pub(super) wait: Duration,
    pub(super) ttl: Duration,
    pub(super) store_timeout: Duration,
}

impl OrderConfig {
    /// The store key of `object`'s claim and position:
    /// `prefix:order:name::object`, escaped (and hashed when long) as a
    /// record's key is.
    pub(super) fn object_key(&self, object: &str) -> Arc<str> {
        let key = IdempotencyKey::new(
            &self.prefix,
            Arc::from("order"),
            &self.name,
            None,
            object,
            Fingerprint::of(b""),
        );
        key.as_arc().clone()
    }
}

/// Serves the events of each object one at a time and in order, behind the
/// dedup layer, across every instance that shares the store.
///
/// For each distinct event (copies are replays before it gets here) the
/// [`Order`] finds the object and the event's position:
///
/// - per object, **one event at a time** reaches the inner service: a claim
///   of the object in the store, with the same lease, renewal and fencing
///   rules as a key's claim. An event that waits longer than
///   [`wait`](Self::wait) gets 503 (the channel's failure reply behind the
///   normalize layer), and the channel sends it again;
/// - an event **at or behind** the object's applied position is answered
///   200 with an empty body and `idempotent-stale: true` without calling
///   the inner service (the normalize layer of an
///   [`IdempotencyLayer`](crate::IdempotencyLayer) turns it into the
///   channel's success reply); the dedup layer records that answer, so a
///   copy of the event replays it. Its response carries [`Stale`](super::Stale);
/// - an event **ahead** is forwarded; when the inner service succeeds (2xx),
///   the object's position moves to the event's in one compare-and-set
///   ([`Store::advance`]); on a failure nothing moves;
/// - an event the order cannot place is forwarded as if there were no
///   order; its response carries the [`Unplaced`](super::Unplaced) reason.
///
/// With the `metrics` feature each event is counted as
/// `idempotency_order_events_total{order, result}`, `result` one of
/// `advanced`, `stale`, `unplaced`, `failed`, `busy`, `store_error`.
///
/// The store must keep positions ([`Store::advance`]): the memory, tiered,
/// Redis and SQL stores do. Add the layer *after* (inside) the
/// idempotency layer, over the same store or another:
///
/// ```
/// use axum::{routing::post, Router};
/// use tower::ServiceBuilder;
/// use tower_idempotency::order::{Order, OrderLayer};
/// use tower_idempotency::store::MemoryStore;
/// use tower_idempotency::IdempotencyLayer;
///
/// async fn on_event(body: String) -> &'static str {
///     // apply the event: the state only moves forward
///     "ok"
/// }
///
/// let store = MemoryStore::new();
/// let app: Router = Router::new().route(
///     "/stripe",
///     post(on_event).layer(
///         ServiceBuilder::new()
///             .layer(IdempotencyLayer::stripe().with_store(store.clone()))
///             .layer(OrderLayer::new(Order::stripe(), store)),
///     ),
/// );
/// ```
#[derive(Debug, Clone)]
pub struct OrderLayer<St> {
    store: St,
    config: Arc<OrderConfig>,
}

impl<St: Store> OrderLayer<St> {
    /// `order` over `store`. Defaults: lease 30 s, wait 4 s, positions kept
    /// 31 days, store calls limited to 5 s, key prefix `idem`.
    pub fn new(order: Order, store: St) -> Self {
        Self {
            store,
            config: Arc::new(OrderConfig {
                name: Arc::from(order.name()),
                order,
                prefix: Cow::Borrowed("idem"),
                lease: Duration::from_secs(30),
                wait: Duration::from_secs(4),
                ttl: Duration::from_secs(31 * 24 * 3600),
                store_timeout: Duration::from_secs(5),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut OrderConfig)) -> Self {
        let mut config = OrderConfig {
            order: self.config.order.clone(),
            name: self.config.name.clone(),
            prefix: self.config.prefix.clone(),
            lease: self.config.lease,
            wait: self.config.wait,
            ttl: self.config.ttl,
            store_timeout: self.config.store_timeout,
        };
        f(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// How long an object's claim holds without renewal (renewed every
    /// third of it while the inner service runs). Defaults to 30 s.
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = lease.max(Duration::from_millis(30)))
    }

    /// How long an event waits for the event of its object that runs
    /// before it, then answers 503 (the channel sends it again). Defaults
    /// to 4 s, as long as a copy waits for the first in the dedup layer.
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|c| c.wait = wait)
    }

    /// How long an object's position is kept after its last move: at least
    /// as long as the channel keeps retrying (the route's window). Defaults
    /// to 31 days.
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.ttl = ttl)
    }

    /// The limit of one store call. Defaults to 5 s.
    pub fn store_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.store_timeout = timeout)
    }

    /// The first part of the store keys of objects (as the key layer's
    /// prefix). Defaults to `idem`.
    pub fn prefix(self, prefix: impl Into<Cow<'static, str>>) -> Self {
        let prefix = prefix.into();
        self.with(|c| c.prefix = prefix)
    }

    /// The order.
    pub fn order(&self) -> &Order {
        &self.config.order
    }
}

impl<S, St: Store> Layer<S> for OrderLayer<St> {
    type Service = Ordered<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Ordered {
            inner,
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}
