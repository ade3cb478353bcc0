//! The `upstream` subcommand: a trivial HTTP/1.1 server that counts hits,
//! in all and per `Idempotency-Key`.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::SUCCESS;

/// The JSON answer with an empty pad; `--body-bytes` below it is plain text.
const PADDED_PREFIX: &str = r#"{"code":"SUCCESS","pad":""#;
const PADDED_SUFFIX: &str = r#""}"#;

/// What every connection shares: the answer and the counts.
struct State {
    body: Bytes,
    content_type: &'static str,
    hits: AtomicU64,
    per_key: Mutex<HashMap<String, u32>>,
}

/// The answer's body and content type: the WeChat success reply, or exactly
/// `n` bytes.
fn answer(body_bytes: Option<usize>) -> (Bytes, &'static str) {
    let Some(n) = body_bytes else {
        return (Bytes::from_static(SUCCESS.as_bytes()), "application/json");
    };
    let min = PADDED_PREFIX.len() + PADDED_SUFFIX.len();
    if n < min {
        return (Bytes::from(vec![b'x'; n]), "text/plain");
    }
    let mut body = String::with_capacity(n);
    body.push_str(PADDED_PREFIX);
    body.extend(std::iter::repeat_n('x', n - min));
    body.push_str(PADDED_SUFFIX);
    debug_assert_eq!(body.len(), n);
    (Bytes::from(body), "application/json")
}

pub(crate) fn run_upstream(listen: SocketAddr, body_bytes: Option<usize>) -> ExitCode {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        let listener = match TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("proxy_bench: cannot listen on {listen}: {e}");
                return ExitCode::from(1);
            }
        };
        let addr = listener.local_addr().expect("bound address");
        println!("upstream on {addr}");
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        let (body, content_type) = answer(body_bytes);
        let state = Arc::new(State {
            body,
            content_type,
            hits: AtomicU64::new(0),
            per_key: Mutex::new(HashMap::new()),
        });
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let state = state.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(upstream_answer(req, &state).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

async fn upstream_answer(req: Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    if req.method() == hyper::Method::GET && req.uri().path() == "/__hits" {
        let n = state.hits.load(Ordering::SeqCst);
        return Response::new(Full::new(Bytes::from(n.to_string())));
    }
    if req.method() == hyper::Method::GET && req.uri().path() == "/__keys" {
        let prefix = req
            .uri()
            .query()
            .and_then(|q| q.strip_prefix("prefix="))
            .unwrap_or_default();
        return Response::new(Full::new(Bytes::from(key_summary(state, prefix))));
    }
    // Behind the gateway the client's own key is `idempotency-client-key`
    // (`idempotency-key` is the stored key's hash); other proxies forward
    // `idempotency-key` as the client sent it.
    let key = req
        .headers()
        .get("idempotency-client-key")
        .or_else(|| req.headers().get("idempotency-key"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // Read the whole body, as a real handler would.
    let _ = req.into_body().collect().await;
    state.hits.fetch_add(1, Ordering::Relaxed);
    if let Some(key) = key {
        let mut per_key = state.per_key.lock().expect("not poisoned");
        *per_key.entry(key).or_default() += 1;
    }
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", state.content_type)
        .body(Full::new(state.body.clone()))
        .expect("static response")
}

/// `keys=K total=T max=M dist=1:K1,2:K2` over the keys starting with `prefix`.
fn key_summary(state: &State, prefix: &str) -> String {
    let per_key = state.per_key.lock().expect("not poisoned");
    let mut dist = BTreeMap::<u32, u64>::new();
    let (mut keys, mut total, mut max) = (0u64, 0u64, 0u32);
    for (_, &n) in per_key.iter().filter(|(k, _)| k.starts_with(prefix)) {
        keys += 1;
        total += u64::from(n);
        max = max.max(n);
        *dist.entry(n).or_default() += 1;
    }
    let dist: Vec<String> = dist.iter().map(|(n, k)| format!("{n}:{k}")).collect();
    let dist = if dist.is_empty() {
        "-".to_owned()
    } else {
        dist.join(",")
    };
    format!("keys={keys} total={total} max={max} dist={dist}")
}
