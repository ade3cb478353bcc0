//! The delivering end of acknowledge-then-deliver routes: [`Deliver`], which
//! takes queued notifications to the upstream through the dedup layer of
//! the route their path matches now, without verifying them again (they
//! were verified once, when they were queued).

use super::detect::detect;
use super::gateway::{run_stack, Stack};
use super::headers::ClientConn;
use super::{Gateway, UpstreamAnswer};
use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Full};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tower_idempotency::consumer::{Disposition, Failure};
use tower_idempotency::dedup::Mismatched;
use tower_idempotency::order::Stale;
use tower_idempotency::store::Store;
use tower_idempotency::Outcome;
use tower_idempotency_queue::original_key;
use tower_idempotency_queue::Message;
use tower_service::Service;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Why [`Deliver`] did not deliver a message. A
/// [`Worker`](tower_idempotency_queue::Worker) retries it, dead-letters it at once when
/// no later delivery can succeed ([`is_permanent`](Self::is_permanent): the
/// key was done with another payload, or the message has no key), and keeps
/// it, never dead-lettered for it, when no route delivers its path now
/// ([`is_kept`](Self::is_kept)), and postpones it without counting the
/// attempt when the gateway answered itself or another payload of the key
/// is still in flight ([`is_held`](Self::is_held)).
#[derive(Debug, Clone)]
pub struct DeliveryError {
    message: Arc<str>,
    kind: Kind,
    upstream: Option<UpstreamAnswer>,
}

/// What a delivery got: the upstream's 2xx answer, or the stored 2xx answer
/// of an earlier delivery of the key that the dedup layer replayed (then
/// this attempt did not call the upstream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    status: http::StatusCode,
    upstream: Option<UpstreamAnswer>,
    stale: bool,
}

impl Delivered {
    /// The status of the answer (2xx).
    pub fn status(&self) -> http::StatusCode {
        self.status
    }

    /// What the upstream answered this attempt and how long it took; `None`
    /// when the answer was an earlier delivery's, replayed.
    pub fn upstream(&self) -> Option<UpstreamAnswer> {
        self.upstream
    }

    /// Whether the route's order settled it as stale: its object had moved
    /// past it, and the upstream was not called (see
    /// [`RouteOptions::order`](super::RouteOptions::order)).
    pub fn is_stale(&self) -> bool {
        self.stale
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Retry,
    Permanent,
    Kept,
    Held,
    Paused,
}

impl DeliveryError {
    pub(crate) fn new(message: impl Into<Arc<str>>) -> Self {
        Self {
            message: message.into(),
            kind: Kind::Retry,
            upstream: None,
        }
    }

    fn permanent(message: impl Into<Arc<str>>) -> Self {
        Self {
            kind: Kind::Permanent,
            ..Self::new(message)
        }
    }

    fn paused(path: &str) -> Self {
        Self {
            kind: Kind::Paused,
            ..Self::new(format!(
                "the route of {path} is paused: held until it resumes"
            ))
        }
    }

    fn kept(message: impl Into<Arc<str>>) -> Self {
        Self {
            kind: Kind::Kept,
            ..Self::new(message)
        }
    }

    /// Whether no later delivery can succeed (dead-letter it now).
    pub fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }

    /// Whether no route delivers the message's path now (keep it).
    pub fn is_kept(&self) -> bool {
        self.kind == Kind::Kept
    }

    /// Whether the gateway answered itself, not the upstream: shed by the
    /// route's own limit (`max_in_flight`, or the upstream's cap), the key
    /// in flight elsewhere (with this payload or another one), the reply
    /// deadline, or its store failed. A
    /// [`Worker`](tower_idempotency_queue::Worker) postpones such a delivery without
    /// counting the attempt, and its breaker does not count it against the
    /// upstream.
    pub fn is_held(&self) -> bool {
        self.kind == Kind::Held
    }

    /// What the upstream answered and how long it took, when this attempt
    /// reached it (a non-2xx answer, or one whose body was cut); `None` when
    /// the gateway answered itself (no route, shed, the store failed).
    pub fn upstream(&self) -> Option<UpstreamAnswer> {
        self.upstream
    }
}

impl fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// How a [`Worker`](tower_idempotency_queue::Worker) settles the entry.
impl Failure for DeliveryError {
    fn disposition(&self) -> Disposition {
        match self.kind {
            Kind::Retry => Disposition::Retry,
            Kind::Permanent => Disposition::Permanent,
            Kind::Kept => Disposition::Keep,
            Kind::Held => Disposition::Hold,
            Kind::Paused => Disposition::Pause,
        }
    }
}

impl std::error::Error for DeliveryError {}

/// Who sent a queued notification, as its ingest wrote it in the
/// `x-forwarded-*` headers: the delivery forwards it as it would have been
/// forwarded at once (`x-forwarded-proto: https` for a sender over TLS), so
/// the last `x-forwarded-for` hop, the sender's address, is taken off here
/// to be added back. `None` (headers kept as they are) when the ingest knew
/// no sender.
fn sender(headers: &mut HeaderMap) -> Option<ClientConn> {
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    let (last, before) = hops.split_last()?;
    let ip: IpAddr = last.parse().ok()?;
    let before = match before {
        [] => None,
        hops => Some(HeaderValue::from_str(&hops.join(", ")).ok()?),
    };
    let tls = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    match before {
        Some(value) => headers.insert("x-forwarded-for", value),
        None => headers.remove("x-forwarded-for"),
    };
    Some(ClientConn {
        addr: SocketAddr::new(ip, 0),
        tls,
    })
}

/// Delivers queued notifications to the upstream, each through the dedup
/// layer of the [`Gateway`] route its path matches now (so an entry the
/// queue hands out again does not reach the upstream twice once it
/// succeeded), whether that route acknowledges first or not. `Ok` when the
/// upstream answered 2xx (or the dedup layer replayed such an answer);
/// `Err` otherwise (see [`DeliveryError`]). The copies of one key (on a
/// route that does not verify its sender, see
/// [`RouteOptions::ack_then_deliver`](super::RouteOptions::ack_then_deliver))
/// are delivered one at a time. An entry for one of a route's
/// destinations ([`RouteOptions::deliver_to`](super::RouteOptions::deliver_to))
/// goes to that destination alone, through a claim of its own. Give it to a
/// [`Worker`](tower_idempotency_queue::Worker); from [`Gateway::deliverer`].
pub struct Deliver<S> {
    pub(crate) gateway: Gateway<S>,
    turns: Arc<Turns>,
    /// Whether only entries of an acknowledge-then-deliver route are
    /// delivered (see [`Deliver::ack_routes_only`]).
    ack_only: bool,
}

impl<S> Clone for Deliver<S> {
    fn clone(&self) -> Self {
        Self {
            gateway: self.gateway.clone(),
            turns: self.turns.clone(),
            ack_only: self.ack_only,
        }
    }
}

impl<S> Deliver<S> {
    /// Delivers only the entries whose path an acknowledge-then-deliver
    /// route matches now; any other is kept (reported as kept, never
    /// dead-lettered for it) until one does. For a queue whose entries are
    /// not authenticated (see `tower_idempotency_queue::Sealed`): anyone
    /// who can write to it could otherwise have an entry delivered through
    /// a synchronous route, whose requests the gateway verifies on arrival.
    /// Defaults to `false`: an entry of a route made synchronous since it
    /// was queued is delivered through that route's dedup layer.
    pub fn ack_routes_only(mut self, on: bool) -> Self {
        self.ack_only = on;
        self
    }
}

/// The path of a queued entry, read once: the entrance queues a path in
/// its canonical form, so any other (`/wx/../alipay/notify`,
/// `/wx/%2e%2e/alipay/notify`, a `;`) was written by someone else, and an
/// upstream could read it as another route than the one it matches here:
/// dead-lettered, never delivered.
fn queued_path(message: &Message) -> Result<&str, DeliveryError> {
    let path = message.uri.path();
    let why = match super::path::strict(path) {
        Ok(normal) if normal == path => return Ok(path),
        Ok(normal) => format!("it reads as {normal}"),
        Err(why) => why.to_string(),
    };
    Err(DeliveryError::permanent(format!(
        "queued path {path} is not canonical ({why}): dead-lettered, never delivered"
    )))
}

/// One lock per key being delivered: the copies of a key never run at the
/// same time here. Another instance's copy can still be in flight when one
/// of these runs: the dedup layer says so ([`Mismatched::InFlight`]), and
/// the copy is postponed.
#[derive(Default)]
struct Turns(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Turns {
    async fn run<T>(&self, key: &str, fut: impl Future<Output = T>) -> T {
        let lock = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(key.to_owned()).or_default().clone()
        };
        let _done = TurnDone {
            turns: self,
            key,
            lock: &lock,
        };
        let _turn = lock.lock().await;
        fut.await
    }
}

/// Forgets a key's lock once no delivery holds or waits for it.
struct TurnDone<'a> {
    turns: &'a Turns,
    key: &'a str,
    lock: &'a Arc<tokio::sync::Mutex<()>>,
}

impl Drop for TurnDone<'_> {
    fn drop(&mut self) {
        let mut map = self.turns.0.lock().unwrap_or_else(|p| p.into_inner());
        // The map's and this delivery's: nobody else waits.
        if Arc::strong_count(self.lock) <= 2 {
            map.remove(self.key);
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
    type Response = Delivered;
    type Error = DeliveryError;
    type Future = BoxFuture<Result<Delivered, DeliveryError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), DeliveryError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, message: Message) -> Self::Future {
        let path = match queued_path(&message) {
            Ok(path) => path,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        if self.ack_only {
            let acked =
                (self.gateway.shared.routes.find(path)).is_some_and(|(r, _)| r.ack.is_some());
            if !acked {
                let e = DeliveryError::kept(format!(
                    "{path} is no acknowledge-then-deliver route's, and this queue's entries are not authenticated: kept, not delivered"
                ));
                return Box::pin(std::future::ready(Err(e)));
            }
        }
        let (gateway, turns) = (self.gateway.clone(), self.turns.clone());
        Box::pin(async move {
            let key = original_key(&message.key).to_owned();
            turns.run(&key, gateway.deliver(message)).await
        })
    }
}

impl<S: Store> Gateway<S> {
    /// Whether a route acknowledges, then delivers (a worker is needed; it
    /// is also needed while the queue holds entries of earlier runs).
    pub fn has_ack_routes(&self) -> bool {
        self.shared
            .routes
            .iter()
            .any(|(_, route)| route.ack.is_some())
    }

    /// A service that delivers the queued notifications; give it to a
    /// [`Worker`](tower_idempotency_queue::Worker) over the queue given to
    /// [`GatewayBuilder::queue`](super::GatewayBuilder::queue), and run that
    /// worker whenever the queue holds entries, even when no route
    /// acknowledges first any more.
    pub fn deliverer(&self) -> Deliver<S> {
        Deliver {
            gateway: self.clone(),
            turns: Arc::default(),
            ack_only: false,
        }
    }

    /// Delivers one queued notification through the dedup layer of the
    /// route its path matches now, without verifying it again. `Ok` once the
    /// upstream answered 2xx, or the dedup layer replayed such an answer of
    /// an earlier delivery. An entry whose path is not in its canonical form
    /// (`/a/../b`, `/a/%2e%2e/b`) fails for good (dead-letter it): the
    /// entrance queues no such path.
    pub async fn deliver(&self, message: Message) -> Result<Delivered, DeliveryError> {
        let path = queued_path(&message)?.to_owned();
        let Some((route, _)) = self.shared.routes.find(&path) else {
            return Err(DeliveryError::kept(format!(
                "no route for {path}: kept until one delivers it"
            )));
        };
        let stack: Option<&Stack<S>> = match (&message.destination, route.auto_limit) {
            // An entry for one of the route's destinations: that
            // destination's stack, its own claim and upstream.
            (Some(d), _) => match route.destinations.iter().find(|(name, ..)| **name == **d) {
                // A paused destination's entry is held, as a paused route's.
                Some((_, _, Some(gate))) if gate.holds_delivery(&path) => {
                    return Err(DeliveryError {
                        kind: Kind::Paused,
                        ..DeliveryError::new(format!(
                            "the destination {d} of {path} is paused: held until it resumes"
                        ))
                    });
                }
                Some((_, stack, _)) => Some(stack),
                None => {
                    return Err(DeliveryError::kept(format!(
                        "the route of {path} has no destination `{d}` now: kept until it has"
                    )))
                }
            },
            (None, None) => route
                .deliver
                .as_ref()
                .or_else(|| route.stacks.first().map(|g| &g.stack)),
            (None, Some(_)) => detect(&message.headers, &message.body).and_then(|name| {
                let guard = route.stacks.iter().find(|g| &*g.name == name);
                guard.map(|g| &g.stack)
            }),
        };
        let Some(stack) = stack else {
            return Err(DeliveryError::kept(format!(
                "the route of {path} guards no channel this notification is from: kept until one delivers it"
            )));
        };
        // A paused route's entry is held before anything runs: no claim in
        // the store, no call; looked at again only after a long wait.
        if (route.pause.as_ref()).is_some_and(|gate| gate.holds_delivery(&path)) {
            return Err(DeliveryError::paused(&path));
        }
        // A panic below is caught as on a request (500, counted as
        // panicked): the delivery fails and is retried.
        let mut req = message.to_request();
        if let Some(conn) = sender(req.headers_mut()) {
            req.extensions_mut().insert(conn);
        }
        if message.destination.is_some() {
            let key = super::destination::NotificationKey(message.notification_key().into());
            req.extensions_mut().insert(key);
        }
        if let Some(reopen) = &route.reopen {
            let (mut parts, body) = req.into_parts();
            // It was read at ingest: a key changed since leaves it unplaced
            // (forwarded as if there were no order).
            if let Err(e) = reopen.reopen(&mut parts, &body) {
                tracing::warn!(path = %path, error = %e, "a queued notification cannot be read again for the route's order (its key changed since it was queued?): delivered unplaced");
            }
            req = http::Request::from_parts(parts, body);
        }
        let run = run_stack(stack.clone(), req.map(Full::new));
        let res = super::panic::catching("queue", run).await;
        let status = res.status();
        let refused = res.extensions().get::<Outcome>().copied();
        let upstream = res.extensions().get::<UpstreamAnswer>().copied();
        let failed = res
            .extensions()
            .get::<super::forward::UpstreamFailed>()
            .copied();
        let mismatched = res.extensions().get::<Mismatched>().copied();
        let paused = res.extensions().get::<super::RoutePaused>().is_some();
        let stale = res.extensions().get::<Stale>().is_some();
        // Read the whole answer: the dedup layer records it at its end.
        let mut body = std::pin::pin!(res.into_body());
        while let Some(frame) = body.frame().await {
            if let Err(e) = frame {
                return Err(DeliveryError {
                    upstream,
                    ..DeliveryError::new(format!("upstream answer cut: {e}"))
                });
            }
        }
        match refused {
            // Another payload of the key still runs (on another instance:
            // this one's copies take turns): it may yet fail and release
            // the key, so this copy waits its turn, never dead-lettered.
            Some(Outcome::Mismatch) if mismatched == Some(Mismatched::InFlight) => {
                return Err(DeliveryError {
                    kind: Kind::Held,
                    ..DeliveryError::new(
                        "the key is in flight with another payload elsewhere: postponed, not counted",
                    )
                });
            }
            Some(Outcome::Mismatch) => {
                return Err(DeliveryError::permanent(
                    "idempotency key reused with a different payload: the key ran with another one",
                ))
            }
            Some(Outcome::KeyMissing) => {
                return Err(DeliveryError::permanent("the notification has no key"))
            }
            _ => {}
        }
        if paused {
            // Paused since the check above: held as there.
            Err(DeliveryError::paused(&path))
        } else if status.is_success() {
            Ok(Delivered {
                status,
                upstream,
                stale,
            })
        } else if let Some(
            own @ (Outcome::Shed
            | Outcome::InFlightRejected
            | Outcome::ReplyDeadline
            | Outcome::StoreError),
        ) = refused
        {
            // The gateway's own answer: the upstream was not called (or
            // still runs), so it says nothing of it.
            Err(DeliveryError {
                kind: Kind::Held,
                ..DeliveryError::new(format!(
                    "the gateway answered {status} itself ({}): postponed, not counted",
                    own.as_str()
                ))
            })
        } else if let (Some(failed), None) = (failed, upstream) {
            // No answer: what happened to the call, not the route's reply.
            Err(DeliveryError::new(format!("upstream {}", failed.0)))
        } else {
            // The upstream's own status when it answered (the route's reply
            // to the channel may be another: a preset's failure answer).
            let said = upstream.map_or(status, |u| u.status);
            Err(DeliveryError {
                upstream,
                ..DeliveryError::new(format!("upstream answered {said}"))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sender;
    use http::HeaderMap;

    #[test]
    fn the_sender_of_a_queued_notification_from_its_headers() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "203.0.113.7, 10.0.0.1".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        let conn = sender(&mut h).unwrap();
        assert!(conn.tls);
        assert_eq!(conn.addr.ip().to_string(), "10.0.0.1");
        assert_eq!(h["x-forwarded-for"], "203.0.113.7");

        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "::1".parse().unwrap());
        h.insert("x-forwarded-proto", "http".parse().unwrap());
        let conn = sender(&mut h).unwrap();
        assert!(!conn.tls);
        assert!(h.get("x-forwarded-for").is_none());

        // No sender known at ingest: nothing is made up.
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        assert!(sender(&mut h).is_none());
        h.insert("x-forwarded-for", "not-an-ip".parse().unwrap());
        assert!(sender(&mut h).is_none());
        assert_eq!(h["x-forwarded-for"], "not-an-ip");
    }
}
