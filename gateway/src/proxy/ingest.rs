//! The queueing end of an acknowledge-then-deliver route: [`Ingest`], the
//! innermost service of the route's pipeline (normalize, verify, key),
//! which queues the notification durably and only then answers.

use super::headers::{set_forwarded, ClientConn};
use super::{plain, GatewayResponse};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_idempotency::key::KeyBody;
use tower_idempotency::Outcome;
use tower_idempotency::{IdempotencyKey, ResponseBody};
use tower_idempotency_queue::{copy_key, Ingested, Message, Queue, QueueError};
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// On a route that does not verify its sender, how many copies of one key
/// with distinct fingerprints are queued (the first copy is not trusted
/// over the later ones); a copy past them gets the retryable failure reply,
/// counted as [`Outcome::TooManyCopies`].
pub(crate) const MAX_UNVERIFIED_COPIES: usize = 4;

/// The queue keys the notifications of stored key `key` may be queued
/// under: the key itself, then the copies with another payload that a route
/// which does not verify its sender queues beside it (`KEY~copyN`). What a
/// forget of `key` clears in the queue
/// ([`Queue::forget`](tower_idempotency_queue::Queue::forget) on each).
///
/// ```
/// use idempotency_gateway::proxy::queued_keys;
/// let keys: Vec<String> = queued_keys("idem:stripe:/n::evt_1").collect();
/// assert_eq!(keys[0], "idem:stripe:/n::evt_1");
/// assert_eq!(keys[1], "idem:stripe:/n::evt_1~copy1");
/// ```
pub fn queued_keys(key: &str) -> impl Iterator<Item = String> + '_ {
    (0..MAX_UNVERIFIED_COPIES).map(move |n| copy_key(key, n))
}

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
/// with another fingerprint (503 on a route that does not verify its
/// sender, once its copies are full), 503 when the queue fails. The route's
/// normalize layer turns these into the channel's replies.
///
/// On a route that does not verify its sender (`verified` false), a copy
/// whose fingerprint differs from the first one's is queued as an entry of
/// its own (up to [`MAX_UNVERIFIED_COPIES`]): delivery runs the key once
/// through the dedup layer, so the upstream decides, not the order of
/// arrival.
#[derive(Debug, Clone)]
pub(crate) struct Ingest {
    pub(crate) queue: IngestFn,
    pub(crate) verified: bool,
    /// Whether the client's `traceparent` is kept when no span's context
    /// replaces it.
    pub(crate) accept_traceparent: bool,
    /// The route's destinations: each notification is queued once for
    /// each it matches (none: once, for the route's upstream).
    pub(crate) destinations: Arc<[super::Destination]>,
}

impl Service<Request<KeyBody>> for Ingest {
    type Response = GatewayResponse;
    type Error = Infallible;
    type Future = BoxFuture<Result<GatewayResponse, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<KeyBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.ingest(req).await) })
    }
}

impl Ingest {
    async fn ingest(self, req: Request<KeyBody>) -> GatewayResponse {
        let Some(key) = req.extensions().get::<IdempotencyKey>().cloned() else {
            return plain(
                StatusCode::METHOD_NOT_ALLOWED,
                "this route queues notifications: use POST\n",
            )
            .map(ResponseBody::stream);
        };
        let (mut parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(never) => match never {},
        };
        // Which destinations want it, from what the sender wrote.
        let mut wanted = Vec::new();
        for d in self.destinations.iter() {
            match d.wants(&parts, &body) {
                Ok(true) => wanted.push(d.name.clone()),
                Ok(false) => {}
                Err(e) => {
                    Outcome::StoreError.count(key.preset_arc());
                    tracing::warn!(key = %key.redacted(), destination = %d.name, error = %e, "cannot read the notification for a destination's filter; answering a failure");
                    return reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "cannot read the notification for its destinations\n",
                        Outcome::StoreError,
                        key,
                    );
                }
            }
        }
        if !self.destinations.is_empty() && wanted.is_empty() {
            Outcome::Filtered.count(key.preset_arc());
            return reply(StatusCode::OK, "filtered\n", Outcome::Filtered, key);
        }
        // Who sent it is known now, not at delivery.
        let conn = parts.extensions.get::<ClientConn>().copied();
        let authority = parts.uri.authority().map(|a| a.to_string());
        set_forwarded(&mut parts.headers, conn, authority.as_deref());
        // The ingest's trace context goes with the notification: its
        // delivery, on whichever instance, links to it.
        tower_idempotency::trace::pass_on(&mut parts.headers, self.accept_traceparent);
        parts.extensions = http::Extensions::new();
        let req = Request::from_parts(parts, body);
        let got = match wanted.as_slice() {
            [] => self.queue_copies(&key, &req, None).await,
            // Durable for every destination before the answer: a failure
            // answers the channel's failure, and its retry finds the
            // destinations already queued `Duplicate`.
            destinations => {
                let mut all = Ok(Ingested::Duplicate);
                for d in destinations {
                    let got = self.queue_copies(&key, &req, Some(d)).await;
                    all = match (all, got) {
                        (Err(e), _) | (_, Err(e)) => Err(e),
                        (Ok(Ingested::Mismatch), _) | (_, Ok(Ingested::Mismatch)) => {
                            Ok(Ingested::Mismatch)
                        }
                        (Ok(Ingested::Duplicate), Ok(got)) => Ok(got),
                        (Ok(queued), _) => Ok(queued),
                    };
                    if all.is_err() {
                        break;
                    }
                }
                all
            }
        };
        match got {
            Ok(Ingested::Queued(_)) => {
                Outcome::Executed.count(key.preset_arc());
                reply(StatusCode::OK, "queued\n", Outcome::Executed, key)
            }
            Ok(Ingested::Duplicate) => {
                Outcome::Replayed.count(key.preset_arc());
                reply(StatusCode::OK, "already queued\n", Outcome::Replayed, key)
            }
            // Every entry beside the key holds another payload of a sender
            // nobody verified: perhaps forgeries, and this the genuine copy.
            // A retryable failure: the channel comes back once they are
            // delivered (a 422 it would never retry).
            Ok(Ingested::Mismatch) if !self.verified => {
                Outcome::TooManyCopies.count(key.preset_arc());
                tracing::warn!(key = %key.redacted(), copies = MAX_UNVERIFIED_COPIES, "every copy queued for this key has another payload (a route that does not verify its sender): not queued, answering a retryable failure");
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many copies of this notification with other payloads are waiting\n",
                    Outcome::TooManyCopies,
                    key,
                )
            }
            Ok(Ingested::Mismatch) => {
                Outcome::Mismatch.count(key.preset_arc());
                tracing::warn!(key = %key.redacted(), "idempotency key reused with a different payload: possible tampering; not queued");
                reply(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency key reused with a different request payload\n",
                    Outcome::Mismatch,
                    key,
                )
            }
            // An answer of a later version of the queue contract: not
            // known to be stored, so the sender is asked to come back.
            Ok(_) => {
                Outcome::StoreError.count(key.preset_arc());
                tracing::warn!(key = %key.redacted(), "the queue answered an ingest this version does not know; answering a failure");
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "cannot queue the notification\n",
                    Outcome::StoreError,
                    key,
                )
            }
            Err(_e) => {
                Outcome::StoreError.count(key.preset_arc());
                // A queue that cannot write says so itself, once a minute.
                if !_e.is_unwritable() {
                    tracing::warn!(key = %key.redacted(), error = %_e, "cannot queue the notification; answering a failure");
                }
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "cannot queue the notification\n",
                    Outcome::StoreError,
                    key,
                )
            }
        }
    }
}

impl Ingest {
    /// Queues `req` under `key` (for `destination`, when the route has
    /// several): the key's entry, or on a route that does not verify its
    /// sender the first of its copies that takes it.
    async fn queue_copies(
        &self,
        key: &IdempotencyKey,
        req: &Request<Bytes>,
        destination: Option<&str>,
    ) -> Result<Ingested, QueueError> {
        let copies = if self.verified {
            1
        } else {
            MAX_UNVERIFIED_COPIES
        };
        let mut got = Ok(Ingested::Mismatch);
        for n in 0..copies {
            let mut message = Message::from_request(key.as_str(), key.fingerprint(), req.clone());
            if let Some(d) = destination {
                message = message.destination(d);
            }
            message.key = copy_key(&message.key, n);
            let queued = message.key.clone();
            got = (self.queue.0)(message.order(queued)).await;
            if !matches!(got, Ok(Ingested::Mismatch)) {
                if n > 0 && matches!(got, Ok(Ingested::Queued(_))) {
                    tracing::warn!(key = %key.redacted(), copy = n, "a copy with another payload on a route that does not verify its sender: queued as its own entry (delivery runs the key once)");
                }
                break;
            }
        }
        got
    }
}

/// The answer, with its outcome and key in the extensions (for the access
/// log, the duplicate ratio and the journal, as a dedup layer's answers).
fn reply(
    status: StatusCode,
    msg: &'static str,
    outcome: Outcome,
    key: IdempotencyKey,
) -> GatewayResponse {
    let mut res = plain(status, msg).map(ResponseBody::stream);
    res.extensions_mut().insert(outcome);
    res.extensions_mut().insert(key);
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_idempotency_queue::original_key;

    #[test]
    fn copies_name_their_key() {
        assert_eq!(
            original_key(&copy_key("idem:alipay:/a:N1", 0)),
            "idem:alipay:/a:N1"
        );
        assert_eq!(
            original_key(&copy_key("idem:alipay:/a:N1", 3)),
            "idem:alipay:/a:N1"
        );
        assert_eq!(original_key("k~copy"), "k~copy");
        assert_eq!(original_key("k~copyx"), "k~copyx");
    }
}
