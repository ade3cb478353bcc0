//! Shared test support: real hyper servers on loopback and a small client,
//! the recording upstream, the table of channel vectors and the channel
//! scenarios, the fault-injecting store, the in-memory trace exporter.

pub mod faults;
// Also included by `support_redis`; a test may include both.
pub mod otel;
pub mod port;
pub mod scenarios;
pub mod server;
pub mod temp;
pub mod upstream;
pub mod vectors;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use port::{free_addr, free_port};

/// Serves `svc` (any tower service over hyper's incoming bodies) on
/// 127.0.0.1:0 with HTTP/1 and HTTP/2; returns the bound address.
pub async fn serve<S, B>(svc: S) -> (SocketAddr, JoinHandle<()>)
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let svc = svc.clone();
            tokio::spawn(async move {
                let hyper_svc = hyper_util::service::TowerToHyperService::new(svc);
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), hyper_svc)
                    .await;
            });
        }
    });
    (addr, task)
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub trailers: Option<http::HeaderMap>,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// Reads a response whole, trailers included.
pub async fn read<B>(res: Response<B>) -> Answer
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = res.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// The longest [`post`] waits for a whole answer. Every deadline a server
/// under test keeps is far shorter, so an answer this late means a request
/// hung: the test fails saying so (and its servers print their logs)
/// instead of waiting for CI's time limit.
pub const ANSWER_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// POSTs `body` with `headers` to `http://addr{path}` over real TCP.
pub async fn post(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut req = Request::post(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let answer = async {
        let res = client
            .request(req.body(Full::new(body.into())).unwrap())
            .await
            .unwrap();
        read(res).await
    };
    tokio::time::timeout(ANSWER_LIMIT, answer)
        .await
        .unwrap_or_else(|_| panic!("no answer from {addr}{path} within {ANSWER_LIMIT:?}"))
}

/// A request for `oneshot` tests.
pub fn request(
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Request<Full<Bytes>> {
    let mut req = Request::post(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Full::new(body.into())).unwrap()
}

/// Counts calls of a handler.
#[derive(Clone, Default)]
pub struct Counter(Arc<std::sync::atomic::AtomicUsize>);

impl Counter {
    pub fn bump(&self) -> usize {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A randomized test's seed: the environment variable `var` when set (to
/// replay a schedule), otherwise the clock's nanoseconds. Printed, so that a
/// failure can be replayed.
pub fn seed(var: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("schedule seed {seed} (replay: {var}={seed})");
    seed
}

/// Runs `n` copies of `make()` at the same instant and collects their outputs.
pub async fn all_at_once<F, Fut, T>(n: usize, make: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let fut = make(i);
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            fut.await
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}
