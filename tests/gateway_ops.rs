//! The gateway example as an operator runs it: logs that never block,
//! health endpoints, environment variables, a config file, stalled
//! clients. Each test starts the built binary (build it first:
//! `cargo build --all-features --example gateway`).

mod common;
mod gateway_support;

use bytes::Bytes;
use common::{client, serve};
use gateway_support::{get, Proc};
use http::{Request, Response};
use http_body_util::Full;
use std::convert::Infallible;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// An upstream that answers 200 `ok N` and counts its calls.
async fn counting_upstream() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let count = calls.clone();
    let svc = tower::service_fn(move |_req: Request<hyper::body::Incoming>| {
        let n = count.fetch_add(1, Ordering::SeqCst) + 1;
        async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!("ok {n}"))))) }
    });
    let (addr, _task) = serve(svc).await;
    (format!("http://{addr}"), calls)
}

/// A log collector that stops reading (stderr is a pipe nobody reads)
/// must not stop the gateway: it keeps answering, losing log lines.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_log_sink_does_not_stop_the_gateway() {
    let (upstream, calls) = counting_upstream().await;
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/api=idempotency-key",
        ],
        &[("RUST_LOG", "debug")],
        Stdio::piped(), // never read
    );
    let client = client();
    let n = 2_000;
    for i in 0..n {
        let req = Request::post(format!("http://{}/api/orders", gw.addr))
            .header("idempotency-key", format!("order-{i}"))
            .body(Full::new(Bytes::from(format!("{{\"order\":{i}}}"))))
            .unwrap();
        let res = tokio::time::timeout(Duration::from_secs(20), client.request(req))
            .await
            .unwrap_or_else(|_| {
                panic!("request {i} got no answer within 20 s: the gateway stalled")
            })
            .unwrap();
        assert_eq!(res.status(), 200, "request {i}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), n);
}
