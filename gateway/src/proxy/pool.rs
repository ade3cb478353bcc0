//! [`Pool`]: a forwarder's keep-alive HTTP/1.1 connections to its one
//! upstream, reused call after call.
//!
//! hyper-util's `legacy::Client` serves any number of hosts: every call
//! builds a pool key (scheme and authority), hashes it with SipHash to
//! check out and again to give back, and attaches the connection's
//! details to every answer. A forwarder has one upstream, so its pool is a
//! list: the connection given back last is taken first (it is the least
//! likely to have been closed by the upstream's idle timeout). Connecting
//! stays with hyper-util's `HttpConnector` and hyper-rustls (TCP, the
//! connect timeout, TLS), and HTTP/1.1 with hyper's own client connection;
//! only the choice of connection is ours.

use super::ProxyBody;
use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

/// The idle connections of one upstream, the last given back first.
pub(crate) struct Pool {
    connector: HttpsConnector<HttpConnector>,
    /// The upstream's scheme and authority: what the connector dials.
    target: Uri,
    idle_timeout: Duration,
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    /// Oldest first: each given back at the back, and taken from there.
    conns: VecDeque<(SendRequest<ProxyBody>, Instant)>,
    /// Whether a task closes the connections idle past the timeout while
    /// no call takes or gives back one.
    reaping: bool,
}

/// Why a call failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// No connection could be made (TCP or TLS).
    Connect(BoxError),
    /// The call failed on its connection (refused, reset, a bad answer, or
    /// the request's own body failed).
    Call(hyper::Error),
}

impl CallError {
    /// Whether no connection could be made.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, Self::Connect(_))
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connect(_) => f.write_str("could not connect to the upstream"),
            Self::Call(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl std::error::Error for CallError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Connect(e) => Some(&**e),
            Self::Call(e) => e.source(),
        }
    }
}

impl Pool {
    pub(crate) fn new(
        connector: HttpsConnector<HttpConnector>,
        target: Uri,
        idle_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            connector,
            target,
            idle_timeout,
            idle: Mutex::default(),
        })
    }

    /// Sends `req` (origin form, `Host` set) on an idle connection, or on a
    /// new one when none is ready. A request that an idle connection closed
    /// before it was written (the upstream's idle timeout racing the call)
    /// is sent again on another: it never reached the upstream. `now` is
    /// the call's start (an idle connection older than the idle timeout is
    /// closed, not used).
    pub(crate) async fn send(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
        now: Instant,
    ) -> Result<Response<PooledBody>, CallError> {
        loop {
            let (mut sender, reused) = match self.checkout(now) {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(res) => {
                    let (parts, body) = res.into_parts();
                    let mut body = PooledBody {
                        body,
                        conn: Some((sender, Arc::clone(self))),
                    };
                    if body.body.is_end_stream() {
                        body.give_back();
                    }
                    return Ok(Response::from_parts(parts, body));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(CallError::Call(e.into_error())),
                },
            }
        }
    }

    /// The idle connection given back last that is ready and not past the
    /// idle timeout; closes the ones that are not.
    fn checkout(&self, now: Instant) -> Option<SendRequest<ProxyBody>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((sender, since)) = idle.conns.pop_back() {
            if now.saturating_duration_since(since) >= self.idle_timeout {
                // The rest are older still.
                idle.conns.clear();
                return None;
            }
            if sender.is_ready() {
                return Some(sender);
            }
        }
        None
    }

    /// A new connection, ready for a request.
    async fn connect(&self) -> Result<SendRequest<ProxyBody>, CallError> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(CallError::Connect)?;
        let io = connector
            .call(self.target.clone())
            .await
            .map_err(CallError::Connect)?;
        let (mut sender, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| CallError::Connect(e.into()))?;
        // The connection's own errors reach the call it was serving.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        sender
            .ready()
            .await
            .map_err(|e| CallError::Connect(e.into()))?;
        Ok(sender)
    }

    /// Keeps `sender` for the next call once its connection is ready again
    /// (at once, usually: the answer has been read to its end).
    fn give_back(self: Arc<Self>, mut sender: SendRequest<ProxyBody>) {
        if sender.is_ready() {
            self.keep(sender);
        } else if !sender.is_closed() {
            // Still writing the request's body (the upstream answered
            // before reading it all): kept once that is done.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if sender.ready().await.is_ok() {
                        self.keep(sender);
                    }
                });
            }
        }
    }

    fn keep(self: Arc<Self>, sender: SendRequest<ProxyBody>) {
        let now = Instant::now();
        let start_reaper = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            idle.conns.push_back((sender, now));
            expire(&mut idle.conns, now, self.idle_timeout);
            !std::mem::replace(&mut idle.reaping, true)
        };
        if start_reaper {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(reap(Arc::downgrade(&self), self.idle_timeout));
            } else {
                self.idle
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .reaping = false;
            }
        }
    }
}

/// Closes the connections idle past `timeout` (the oldest are in front).
fn expire(
    conns: &mut VecDeque<(SendRequest<ProxyBody>, Instant)>,
    now: Instant,
    timeout: Duration,
) {
    while conns.front().is_some_and(|(sender, since)| {
        sender.is_closed() || now.saturating_duration_since(*since) >= timeout
    }) {
        conns.pop_front();
    }
}

/// Every `timeout`, closes the connections idle past it, until none is
/// idle (the next one given back starts it again) or the pool is gone.
async fn reap(pool: Weak<Pool>, timeout: Duration) {
    let period = timeout.max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(period).await;
        let Some(pool) = pool.upgrade() else { return };
        let mut idle = pool.idle.lock().unwrap_or_else(PoisonError::into_inner);
        expire(&mut idle.conns, Instant::now(), timeout);
        if idle.conns.is_empty() {
            idle.reaping = false;
            return;
        }
    }
}

/// An upstream's answer body that gives its connection back to the pool
/// once read to its end; dropped before that, the connection is closed
/// (what is left of the answer cannot be skipped).
pub(crate) struct PooledBody {
    body: Incoming,
    conn: Option<(SendRequest<ProxyBody>, Arc<Pool>)>,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.conn.take() {
            pool.give_back(sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        match &frame {
            Some(Ok(_)) if !self.body.is_end_stream() => {}
            Some(Err(_)) => self.conn = None,
            _ => self.give_back(),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
