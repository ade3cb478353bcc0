//! The `upstream` subcommand: a trivial HTTP/1.1 server that counts hits.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::SUCCESS;

pub(crate) fn run_upstream(listen: SocketAddr) -> ExitCode {
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
        let hits = Arc::new(AtomicU64::new(0));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let hits = hits.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let hits = hits.clone();
                    async move { Ok::<_, Infallible>(upstream_answer(req, &hits).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

async fn upstream_answer(req: Request<Incoming>, hits: &AtomicU64) -> Response<Full<Bytes>> {
    if req.method() == hyper::Method::GET && req.uri().path() == "/__hits" {
        let n = hits.load(Ordering::SeqCst);
        return Response::new(Full::new(Bytes::from(n.to_string())));
    }
    // Read the whole body, as a real handler would.
    let _ = req.into_body().collect().await;
    hits.fetch_add(1, Ordering::Relaxed);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(SUCCESS.as_bytes())))
        .expect("static response")
}
