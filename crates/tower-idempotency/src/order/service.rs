//! The [`Ordered`] service: one event of an object at a time, stale ones
//! answered without the inner service, the position moved on success.

use super::layer::OrderConfig;
use super::{Order, Placement};
use crate::body::BoxError;
use crate::consumer::{timed, Held};
use crate::normalize::text_response;
use crate::outcome::log_warn;
use crate::store::{Advance, Claim, OwnerToken, Position, Store, StoreError};
use crate::Fingerprint;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::time::Instant;
use tower_service::Service;

/// The header of an answer to a stale event (`idempotent-stale: true`):
/// the object had moved past it, and the inner service was not called.
/// The dedup layer records it with the answer, so a copy of the event
/// replays it.
pub const STALE_HEADER: HeaderName = HeaderName::from_static("idempotent-stale");

/// The mark, in a response's extensions, of an event answered as stale:
/// the position the object was at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stale {
    /// Where the object was when the event arrived.
    pub at: Position,
    /// Where the event stands.
    pub event: Position,
}

/// What the [`OrderLayer`](super::OrderLayer) puts into the request's
/// extensions for the inner service, when the order placed the event: the
/// object, the event's position, and the fencing token of the object's
/// claim (a number that grows per object), for a conditional write that
/// refuses an owner whose lease ran out (`… WHERE fence < $1`).
///
/// ```
/// use tower_idempotency::order::OrderedEvent;
///
/// fn handle(req: &http::Request<()>) -> Option<u64> {
///     let event = req.extensions().get::<OrderedEvent>()?;
///     Some(event.fence)
/// }
/// # let _ = handle;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OrderedEvent {
    /// The object's id.
    pub object: String,
    /// Where the event stands.
    pub position: Position,
    /// The fencing token of the object's claim.
    pub fence: u64,
}

/// Serves the events of each object one at a time, in order. See
/// [`OrderLayer`](super::OrderLayer).
pub struct Ordered<S, St> {
    pub(super) inner: S,
    pub(super) store: St,
    pub(super) config: Arc<OrderConfig>,
}

impl<S: Clone, St: Clone> Clone for Ordered<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Ordered<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ordered")
            .field("inner", &self.inner)
            .field("order", &self.config.order)
            .finish_non_exhaustive()
    }
}

impl<S, St: Store> Ordered<S, St> {
    /// Wraps `inner` with `order` over `store` and the
    /// [`OrderLayer`](super::OrderLayer)'s defaults.
    pub fn new(inner: S, order: Order, store: St) -> Self {
        tower_layer::Layer::layer(&super::OrderLayer::new(order, store), inner)
    }

    /// A layer of `order` over `store`: [`OrderLayer::new`](super::OrderLayer::new).
    pub fn layer(order: Order, store: St) -> super::OrderLayer<St> {
        super::OrderLayer::new(order, store)
    }
}

impl<S, St> Ordered<S, St> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The order.
    pub fn order(&self) -> &Order {
        &self.config.order
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Ordered<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: From<Bytes> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(serve(inner, self.store.clone(), self.config.clone(), req))
    }
}

/// What happened to one event, counted as
/// `idempotency_order_events_total{order, result}` with the `metrics`
/// feature.
#[derive(Debug, Clone, Copy)]
enum Tally {
    /// Forwarded, succeeded, the position moved.
    Advanced,
    /// At or behind the object's position: answered here.
    Stale,
    /// The order could not place it: forwarded.
    Unplaced,
    /// Forwarded, and the inner service failed: nothing moved.
    Failed,
    /// The object stayed busy past the wait.
    Busy,
    /// The store failed.
    StoreError,
}

impl Tally {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Advanced => "advanced",
            Self::Stale => "stale",
            Self::Unplaced => "unplaced",
            Self::Failed => "failed",
            Self::Busy => "busy",
            Self::StoreError => "store_error",
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
fn count(config: &OrderConfig, result: Tally) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_order_events_total",
        "order" => metrics::SharedString::from(config.name.clone()),
        "result" => result.as_str()
    )
    .increment(1);
    let _ = result.as_str();
}

/// The retryable answer when the event cannot be judged now (the store
/// failed, or the object stayed busy past the wait): the channel sends it
/// again.
fn retry_later<B: From<Bytes>>(message: &'static str) -> Response<B> {
    let mut res = text_response(StatusCode::SERVICE_UNAVAILABLE, message);
    res.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}

async fn serve<S, St, ReqBody, ResBody>(
    mut inner: S,
    store: St,
    config: Arc<OrderConfig>,
    req: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body<Data = Bytes> + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: From<Bytes>,
{
    let (parts, body) = req.into_parts();
    // Buffered already by the key layer in front: this takes its bytes.
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            return Ok(text_response(
                StatusCode::BAD_REQUEST,
                "the request body could not be read\n",
            ))
        }
    };
    let placement = config.order.place(&parts, &bytes);
    let mut req = Request::from_parts(parts, ReqBody::from(bytes));
    let (object, position) = match placement {
        Placement::Placed { object, position } => (object, position),
        Placement::Unplaced(why) => {
            count(&config, Tally::Unplaced);
            let mut res = inner.call(req).await?;
            res.extensions_mut().insert(why);
            return Ok(res);
        }
    };
    let key: Arc<str> = config.object_key(&object);
    let token = OwnerToken::new();
    let Some(held) = acquire(&store, &config, &key, token).await else {
        return Ok(retry_later(
            "another event of this object is being handled; retry\n",
        ));
    };
    let (held, fence) = match held {
        Ok(held) => held,
        Err(_error) => {
            count(&config, Tally::StoreError);
            log_warn!(order = %config.name, error = %_error, "the order's store failed");
            return Ok(retry_later("the idempotency store is unavailable; retry\n"));
        }
    };
    // With the object's claim: nobody moves its position meanwhile.
    let at = match timed(config.store_timeout, "position", store.position(&key)).await {
        Ok(at) => at,
        Err(_error) => {
            held.release().await;
            count(&config, Tally::StoreError);
            log_warn!(order = %config.name, error = %_error, "reading an object's position failed");
            return Ok(retry_later("the idempotency store is unavailable; retry\n"));
        }
    };
    if let Some(at) = at.filter(|at| *at >= position) {
        held.release().await;
        count(&config, Tally::Stale);
        let mut res = Response::new(ResBody::from(Bytes::new()));
        res.headers_mut()
            .insert(STALE_HEADER, HeaderValue::from_static("true"));
        res.extensions_mut().insert(Stale {
            at,
            event: position,
        });
        return Ok(res);
    }
    req.extensions_mut().insert(OrderedEvent {
        object,
        position,
        fence,
    });
    let (res, lost) = held
        .renewing(inner.call(req), config.lease, &config.name)
        .await;
    if lost {
        log_warn!(order = %config.name, "an object's claim was lost while its event ran");
    }
    let res = match res {
        Ok(res) => res,
        Err(e) => {
            held.release().await;
            count(&config, Tally::Failed);
            return Err(e);
        }
    };
    if !res.status().is_success() {
        held.release().await;
        count(&config, Tally::Failed);
        return Ok(res);
    }
    match timed(
        config.store_timeout,
        "advance",
        store.advance(&key, position, config.ttl),
    )
    .await
    {
        Ok(Advance::Moved) => count(&config, Tally::Advanced),
        // Only with a lost lease: another event of the object ran beside
        // this one and moved it further.
        Ok(_) => count(&config, Tally::Advanced),
        Err(_error) => {
            // The inner service succeeded: its answer stands; an older
            // event may still be forwarded after it.
            count(&config, Tally::StoreError);
            log_warn!(order = %config.name, error = %_error, "advancing an object's position failed");
        }
    }
    held.release().await;
    Ok(res)
}

/// The object's claim and its fencing token, waited for up to the
/// configured wait: `None` when it stayed busy, `Err` when the store failed.
async fn acquire<St: Store>(
    store: &St,
    config: &OrderConfig,
    key: &Arc<str>,
    token: OwnerToken,
) -> Option<Result<(Held<St>, u64), StoreError>> {
    let deadline = Instant::now() + config.wait;
    // One fingerprint for every event: the claim is a lock, not a record.
    let fingerprint = Fingerprint::of(b"order");
    loop {
        let claim = timed(
            config.store_timeout,
            "claim",
            store.claim(key, fingerprint, token, config.lease),
        )
        .await;
        match claim {
            Ok(Claim::Acquired(own)) => {
                let held = Held::new(store.clone(), key.clone(), token, config.store_timeout);
                return Some(Ok((held, own.fence)));
            }
            Ok(Claim::InFlight { watch, .. }) => {
                if tokio::time::timeout_at(deadline, watch.changed())
                    .await
                    .is_err()
                {
                    count(config, Tally::Busy);
                    return None;
                }
            }
            // Never made by this layer: the key is someone else's record.
            Ok(_) => {
                return Some(Err(StoreError::new(
                    crate::store::StoreErrorKind::Corrupt,
                    "an object's key holds a completed record",
                )))
            }
            Err(e) => return Some(Err(e)),
        }
    }
}
