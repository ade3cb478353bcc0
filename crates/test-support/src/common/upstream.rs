//! One recording upstream for every test: a real hyper server on loopback
//! (HTTP/1 and HTTP/2) that keeps every request it gets and answers 200
//! `upstream call N for PATH` (N counts the calls to that path), after the
//! configured delay and with the configured status. A request's own
//! `x-delay-ms` and `x-status` headers override both.

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A request as the upstream saw it, and the status it answered.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub status: u16,
}

impl Seen {
    /// The path, without the query.
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or_default()
    }
}

/// Picks the status of an answer from the request (before it is logged).
type StatusFn = Arc<dyn Fn(&Seen) -> u16 + Send + Sync>;

/// How the upstream answers. Defaults to 200 at once.
#[derive(Clone, Default)]
pub struct Replies {
    delay: Duration,
    status: Option<StatusFn>,
}

impl Replies {
    /// Waits `delay` before every answer.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Answers `status(request)`.
    pub fn status(mut self, status: impl Fn(&Seen) -> u16 + Send + Sync + 'static) -> Self {
        self.status = Some(Arc::new(status));
        self
    }
}

/// A running upstream; stopped on drop.
pub struct Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Upstream {
    /// Answers 200 at once, on 127.0.0.1:0.
    pub async fn start() -> Self {
        Self::with(Replies::default()).await
    }

    /// Answers as `replies` says, on 127.0.0.1:0.
    pub async fn with(replies: Replies) -> Self {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), replies)
    }

    /// Answers as `replies` says, on `listener`.
    pub fn start_on(listener: TcpListener, replies: Replies) -> Self {
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (log, replies) = (log.clone(), replies.clone());
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (log, replies) = (log.clone(), replies.clone());
                    async move { Ok::<_, Infallible>(answer(&log, &replies, req).await) }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, seen, task }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Calls of every path.
    pub fn total(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Calls whose path is `path`.
    pub fn calls(&self, path: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.path() == path)
            .count()
    }

    /// The last call of `path`.
    pub fn last(&self, path: &str) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|s| s.path() == path)
            .cloned()
            .unwrap_or_else(|| panic!("the upstream never saw {path}"))
    }

    /// Waits (up to 10 s) until `path` has been called.
    pub async fn wait_for_call(&self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.calls(path) == 0 {
            assert!(Instant::now() < deadline, "the upstream never saw {path}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    log: &Mutex<Vec<Seen>>,
    replies: &Replies,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let mut seen = Seen {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        headers: parts.headers.clone(),
        body,
        status: 200,
    };
    seen.status = match (header("x-status"), &replies.status) {
        (Some(status), _) => status as u16,
        (None, Some(pick)) => pick(&seen),
        (None, None) => 200,
    };
    let status = seen.status;
    let path = seen.path().to_owned();
    let n = {
        let mut log = log.lock().unwrap();
        log.push(seen);
        log.iter().filter(|s| s.path() == path).count()
    };
    let delay = header("x-delay-ms").map_or(replies.delay, Duration::from_millis);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut res = Response::new(Full::new(Bytes::from(format!(
        "upstream call {n} for {path}"
    ))));
    *res.status_mut() = StatusCode::from_u16(status).unwrap();
    res.headers_mut()
        .insert("content-type", "text/plain".parse().unwrap());
    res.headers_mut()
        .insert("x-upstream", "yes".parse().unwrap());
    res
}
