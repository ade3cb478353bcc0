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
//!
//! A connection is given back only when its exchange ended cleanly: the
//! request's body written whole (an upstream that answered before reading
//! it may never read the rest, and a connection kept to finish writing it
//! would hold the upstream with no call slot and no deadline), and the
//! connection idle with nothing more from the upstream (bytes that belong
//! to no request mean the upstream has lost track of the exchange: the
//! answer just read may be another request's, so it ends with an error
//! and is never recorded). Every connection not given back is closed at
//! once, whatever is left of its request's body.

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
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

/// The longest an answer read to its end waits for its connection to be
/// ready for another request (hyper finishing the request's last bytes)
/// before the connection is closed instead of kept.
const SETTLE: Duration = Duration::from_secs(1);

/// The idle connections of one upstream, the last given back first.
pub(crate) struct Pool {
    connector: HttpsConnector<HttpConnector>,
    /// The upstream's scheme and authority: what the connector dials.
    target: Uri,
    idle_timeout: Duration,
    /// Whether connections are kept for the next call at all.
    keepalive: bool,
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    /// Oldest first: each given back at the back, and taken from there.
    conns: VecDeque<(Conn, Instant)>,
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
        keepalive: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            connector,
            target,
            idle_timeout,
            keepalive,
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
        req: Request<ProxyBody>,
        now: Instant,
    ) -> Result<Response<PooledBody>, CallError> {
        let mut req = req.map(Sent::new);
        loop {
            let (mut conn, reused) = match self.checkout(now) {
                Some(conn) => (conn, true),
                None => (self.connect().await?, false),
            };
            // The connection learns from the body whether it was written whole.
            let whole = req.body().is_whole();
            conn.whole.store(whole, Ordering::Release);
            req.body_mut().whole = Some(Arc::clone(&conn.whole));
            match conn.sender.try_send_request(req).await {
                Ok(res) => {
                    let (parts, body) = res.into_parts();
                    let body = PooledBody {
                        body,
                        conn: Some((conn, Arc::clone(self))),
                        settle: None,
                        last: None,
                    };
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
    fn checkout(&self, now: Instant) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((conn, since)) = idle.conns.pop_back() {
            if now.saturating_duration_since(since) >= self.idle_timeout {
                // The rest are older still.
                idle.conns.clear();
                return None;
            }
            if conn.sender.is_ready() {
                return Some(conn);
            }
        }
        None
    }

    /// A new connection, ready for a request.
    async fn connect(&self) -> Result<Conn, CallError> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(CallError::Connect)?;
        let io = connector
            .call(self.target.clone())
            .await
            .map_err(CallError::Connect)?;
        let (sender, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| CallError::Connect(e.into()))?;
        // The connection's own errors reach the call it was serving; how it
        // ended reaches the answer waiting for it to settle.
        let (ended, ending) = oneshot::channel();
        let task = tokio::spawn(async move {
            let stray = conn.await.as_ref().is_err_and(is_stray);
            let _ = ended.send(stray);
        })
        .abort_handle();
        let mut conn = Conn {
            sender,
            task,
            ending,
            whole: Arc::default(),
        };
        conn.sender
            .ready()
            .await
            .map_err(|e| CallError::Connect(e.into()))?;
        Ok(conn)
    }

    /// Keeps `conn` for the next call.
    fn keep(self: Arc<Self>, conn: Conn) {
        let now = Instant::now();
        let start_reaper = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            idle.conns.push_back((conn, now));
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

/// Whether a connection's error says the upstream sent what no request
/// asked for (bytes while the connection was idle, or after an answer
/// ended): not an I/O error, nor the connection closed or cut off.
fn is_stray(e: &hyper::Error) -> bool {
    use std::error::Error as _;
    !(e.is_incomplete_message()
        || e.is_closed()
        || e.is_canceled()
        || e.is_user()
        || e.is_body_write_aborted()
        || e.is_timeout()
        || e.source().is_some_and(|s| s.is::<std::io::Error>()))
}

/// One connection to the upstream: closed when dropped (its task aborted,
/// with whatever is left of the request's body), unless it is idle in the
/// pool.
struct Conn {
    sender: SendRequest<Sent>,
    task: tokio::task::AbortHandle,
    /// Resolves when the connection has ended: whether the upstream sent
    /// bytes that belong to no request.
    ending: oneshot::Receiver<bool>,
    /// Whether the current request's body has been handed to hyper whole.
    whole: Arc<AtomicBool>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A request's body that notes when it has been read to its end: its end
/// seen, or as many bytes as its exact size (hyper stops polling a body of
/// known length once that many are written).
pub(crate) struct Sent {
    body: ProxyBody,
    /// The bytes still to come, when the size is known.
    left: Option<u64>,
    /// The flag of the connection it is written on (set for each attempt:
    /// no allocation of its own).
    whole: Option<Arc<AtomicBool>>,
}

impl Sent {
    fn new(body: ProxyBody) -> Self {
        Self {
            left: body.size_hint().exact(),
            body,
            whole: None,
        }
    }

    /// Whether hyper has had the whole body.
    fn is_whole(&self) -> bool {
        self.left == Some(0) || self.body.is_end_stream()
    }
}

impl Body for Sent {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        let whole = match &frame {
            None => true,
            Some(Ok(frame)) => {
                if let (Some(left), Some(data)) = (&mut self.left, frame.data_ref()) {
                    *left = left.saturating_sub(data.len() as u64);
                }
                self.is_whole()
            }
            Some(Err(_)) => false,
        };
        if whole && let Some(flag) = &self.whole {
            flag.store(true, Ordering::Release);
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

/// Closes the connections idle past `timeout` (the oldest are in front).
fn expire(conns: &mut VecDeque<(Conn, Instant)>, now: Instant, timeout: Duration) {
    while conns.front().is_some_and(|(conn, since)| {
        conn.sender.is_closed() || now.saturating_duration_since(*since) >= timeout
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
/// once read to its end and settled (see the module's documentation);
/// dropped before that, the connection is closed (what is left of the
/// answer cannot be skipped).
pub(crate) struct PooledBody {
    body: Incoming,
    /// Until the answer has ended and its connection settled.
    conn: Option<(Conn, Arc<Pool>)>,
    /// How long the settling connection may still take.
    settle: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The answer's last frame, handed on once its connection has settled
    /// (a reader that knows the answer's length reads no further).
    last: Option<Frame<Bytes>>,
}

/// An answer read from a connection on which the upstream then sent bytes
/// no request asked for: it may be another request's answer.
#[derive(Debug)]
pub(crate) struct Desynced;

impl fmt::Display for Desynced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the upstream sent bytes that belong to no request: its answer is not trusted")
    }
}

impl std::error::Error for Desynced {}

impl PooledBody {
    /// Once the answer has ended: keeps the connection if its exchange
    /// ended cleanly, closes it otherwise; `Err` when the upstream sent
    /// more than the answer.
    fn poll_settle(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Desynced>> {
        let Some((conn, pool)) = &mut self.conn else {
            return Poll::Ready(Ok(()));
        };
        if !pool.keepalive || !conn.whole.load(Ordering::Acquire) {
            // Its request's body is not written whole: closed with it.
            self.conn = None;
            return Poll::Ready(Ok(()));
        }
        if let Poll::Ready(stray) = Pin::new(&mut conn.ending).poll(cx) {
            self.conn = None;
            return Poll::Ready(match stray {
                Ok(true) => Err(Desynced),
                _ => Ok(()),
            });
        }
        match conn.sender.poll_ready(cx) {
            Poll::Ready(Ok(())) => {
                if let Some((conn, pool)) = self.conn.take() {
                    pool.keep(conn);
                }
                Poll::Ready(Ok(()))
            }
            // Closed: how it ended is on its way (`ending`).
            Poll::Ready(Err(_)) => Poll::Pending,
            Poll::Pending => {
                let settle = self
                    .settle
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(SETTLE)));
                ready!(settle.as_mut().poll(cx));
                self.conn = None;
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.last.is_none() && !self.body.is_end_stream() {
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) if !self.body.is_end_stream() => {
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Ok(frame)) => self.last = Some(frame),
                Some(Err(e)) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                None => {}
            }
        }
        match ready!(self.poll_settle(cx)) {
            Ok(()) => Poll::Ready(self.last.take().map(Ok)),
            Err(e) => {
                self.last = None;
                tracing::warn!("{e}; connection closed");
                Poll::Ready(Some(Err(e.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
