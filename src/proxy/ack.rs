//! Acknowledge-then-deliver routes: the request pipeline of a route
//! (normalize, key) in front of [`Ingest`], which queues the notification
//! durably and only then answers; and [`Deliver`], which takes the queued
//! notifications to the upstream through the route's dedup layer.

use super::gateway::guarded;
use super::headers::{set_forwarded, ClientConn};
use super::{plain, Gateway, GatewayResponse};
use crate::key::KeyBody;
use crate::outcome::{self, Outcome};
use crate::queue::{Ingested, Message, Queue, QueueError};
use crate::store::Store;
use crate::{IdempotencyKey, ResponseBody};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A queue's `ingest`, type-erased so that a gateway does not carry the
/// queue's type.
#[derive(Clone)]
pub(crate) struct IngestFn(
    Arc<dyn Fn(Message) -> BoxFuture<Result<Ingested, QueueError>> + Send + Sync>,
);

impl IngestFn {
    pub(crate) fn new<Q: Queue>(queue: Q) -> Self {
        Self(Arc::new(move |message| {
            let queue = queue.clone();
            Box::pin(async move { queue.ingest(message).await })
        }))
    }
}

impl fmt::Debug for IngestFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IngestFn")
    }
}

/// The innermost service of an acknowledge-then-deliver route: queues the
/// request under its scoped key (set by the key layer in front) and answers
/// 200 only once the queue says the entry is durable; 422 for a key seen
/// with another fingerprint, 503 when the queue fails. The route's
/// normalize layer turns these into the channel's replies.
#[derive(Debug, Clone)]
pub(crate) struct Ingest {
    pub(crate) queue: IngestFn,
}

impl Service<Request<KeyBody>> for Ingest {
    type Response = GatewayResponse;
    type Error = Infallible;
    type Future = BoxFuture<Result<GatewayResponse, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<KeyBody>) -> Self::Future {
        let queue = self.queue.clone();
        Box::pin(async move { Ok(ingest(queue, req).await) })
    }
}

async fn ingest(queue: IngestFn, req: Request<KeyBody>) -> GatewayResponse {
    let Some(key) = req.extensions().get::<IdempotencyKey>().cloned() else {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "this route queues notifications: use POST\n",
        );
    };
    let (mut parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    // Who sent it is known now, not at delivery.
    let conn = parts.extensions.get::<ClientConn>().copied();
    let authority = parts.uri.authority().map(|a| a.to_string());
    set_forwarded(&mut parts.headers, conn, authority.as_deref());
    parts.extensions = http::Extensions::new();
    let message = Message::from_request(
        key.as_str(),
        key.fingerprint(),
        Request::from_parts(parts, body),
    )
    .order(key.as_str());
    match (queue.0)(message).await {
        Ok(Ingested::Queued(_)) => {
            outcome::record(key.preset_arc(), Outcome::Executed);
            reply(StatusCode::OK, "queued\n")
        }
        Ok(Ingested::Duplicate) => {
            outcome::record(key.preset_arc(), Outcome::Replayed);
            reply(StatusCode::OK, "already queued\n")
        }
        Ok(Ingested::Mismatch) => {
            outcome::record(key.preset_arc(), Outcome::Mismatch);
            outcome::log_warn!(key = %key.redacted(), "idempotency key reused with a different payload: possible tampering; not queued");
            reply(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency key reused with a different request payload\n",
            )
        }
        Err(_e) => {
            outcome::record(key.preset_arc(), Outcome::StoreError);
            outcome::log_warn!(key = %key.redacted(), error = %_e, "cannot queue the notification; answering a failure");
            reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "cannot queue the notification\n",
            )
        }
    }
}

fn reply(status: StatusCode, msg: &'static str) -> GatewayResponse {
    plain(status, msg).map(ResponseBody::stream)
}

/// Why [`Deliver`] did not deliver a message (the worker retries it).
#[derive(Debug, Clone)]
pub struct DeliveryError(Arc<str>);

impl DeliveryError {
    pub(crate) fn new(message: impl Into<Arc<str>>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeliveryError {}

/// Delivers queued notifications of a [`Gateway`]'s acknowledge-then-deliver
/// routes to the upstream, each through its route's dedup layer (so an
/// entry the queue hands out again does not reach the upstream twice once
/// it succeeded). `Ok` when the upstream answered 2xx (or the dedup layer
/// replayed such an answer); `Err` otherwise, to be retried. Give it to a
/// [`Worker`](crate::queue::Worker); from [`Gateway::deliverer`].
pub struct Deliver<S> {
    pub(crate) gateway: Gateway<S>,
}

impl<S> Clone for Deliver<S> {
    fn clone(&self) -> Self {
        Self {
            gateway: self.gateway.clone(),
        }
    }
}

impl<S> fmt::Debug for Deliver<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deliver")
            .field("gateway", &self.gateway)
            .finish()
    }
}

impl<S: Store> Service<Message> for Deliver<S> {
    type Response = ();
    type Error = DeliveryError;
    type Future = BoxFuture<Result<(), DeliveryError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), DeliveryError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, message: Message) -> Self::Future {
        let gateway = self.gateway.clone();
        Box::pin(async move { gateway.deliver(message).await })
    }
}

impl<S: Store> Gateway<S> {
    /// Whether a route acknowledges, then delivers (a worker is needed).
    pub fn has_ack_routes(&self) -> bool {
        self.routes.iter().any(|(_, route)| route.ack.is_some())
    }

    /// A service that delivers the queued notifications of the
    /// acknowledge-then-deliver routes; give it to a
    /// [`Worker`](crate::queue::Worker) over the queue given to
    /// [`GatewayBuilder::queue`](super::GatewayBuilder::queue).
    pub fn deliverer(&self) -> Deliver<S> {
        Deliver {
            gateway: self.clone(),
        }
    }

    /// Delivers one queued notification through its route's stack (the
    /// route found by the message's path). `Ok` once the upstream answered
    /// 2xx, or the dedup layer replayed such an answer of an earlier
    /// delivery.
    pub async fn deliver(&self, message: Message) -> Result<(), DeliveryError> {
        let path = message.uri.path();
        let Some((route, _)) = self.routes.find(path) else {
            return Err(DeliveryError::new(format!("no route for {path}")));
        };
        let at = route.stacks.iter().position(Option::is_some);
        let Some(at) = at.filter(|_| route.ack.is_some()) else {
            return Err(DeliveryError::new(format!(
                "{path} is not an ack-then-deliver route"
            )));
        };
        let mut req = message.to_request().map(Full::new);
        // Verified when it was queued; not checked again on delivery.
        let channel = crate::channel::PRESET_NAMES
            .get(at)
            .copied()
            .unwrap_or("custom");
        req.extensions_mut()
            .insert(crate::verify::Verified::new(channel, None));
        let res = guarded(route, at, req).await;
        let status = res.status();
        // Read the whole answer: the dedup layer records it at its end.
        let mut body = std::pin::pin!(res.into_body());
        while let Some(frame) = body.frame().await {
            if let Err(e) = frame {
                return Err(DeliveryError::new(format!("upstream answer cut: {e}")));
            }
        }
        if status.is_success() {
            Ok(())
        } else {
            Err(DeliveryError::new(format!("upstream answered {status}")))
        }
    }
}
