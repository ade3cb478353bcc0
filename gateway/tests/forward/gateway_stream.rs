//! Bodies stream through the gateway: a 200 MiB upload to a path no route
//! guards does not grow the gateway's memory by more than a few MiB.

use crate::gateway_support;
use test_support::common;

use bytes::Bytes;
use common::serve;
use gateway_support::Proc;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::convert::Infallible;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn a_200_mib_upload_to_an_unrouted_path_streams() {
    // The upstream reads the body frame by frame and counts its bytes.
    let received = Arc::new(AtomicU64::new(0));
    let count = received.clone();
    let svc = tower::service_fn(move |req: Request<hyper::body::Incoming>| {
        let count = count.clone();
        async move {
            let mut body = req.into_body();
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    count.fetch_add(data.len() as u64, Ordering::SeqCst);
                }
            }
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"stored"))))
        }
    });
    let (upstream, _task) = serve(svc).await;
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &format!("http://{upstream}"),
            "--route",
            "/notify=wechatpay-v3",
            "--upstream-timeout",
            "120s",
        ],
        &[("RUST_LOG", "warn")],
        Stdio::null(),
    );
    let baseline = gw.rss_kib();

    // Sample the gateway's RSS while the upload runs.
    let peak = Arc::new(AtomicU64::new(baseline));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done, pid) = (peak.clone(), done.clone(), gw.child.id());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    && let Some(kib) = status
                        .lines()
                        .find_map(|l| l.strip_prefix("VmRSS:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                {
                    peak.fetch_max(kib, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let total = 200 * MIB;
    let chunk = Bytes::from(vec![b'x'; MIB]);
    let frames = futures_util::stream::iter(
        (0..total / MIB).map(move |_| Ok::<_, Infallible>(http_body::Frame::data(chunk.clone()))),
    );
    let client: Client<_, StreamBody<_>> = Client::builder(TokioExecutor::new()).build_http();
    let req = Request::post(format!("http://{}/upload/big", gw.addr))
        .body(StreamBody::new(frames))
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(120), client.request(req))
        .await
        .expect("the upload finished within 120 s")
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();

    assert_eq!(status, 200, "{body:?}");
    assert_eq!(received.load(Ordering::SeqCst), total as u64);
    let grew = peak.load(Ordering::SeqCst).saturating_sub(baseline);
    eprintln!("gateway RSS: baseline {baseline} KiB, grew by {grew} KiB during a 200 MiB upload");
    assert!(
        grew < 16 * 1024,
        "the gateway's RSS grew by {grew} KiB during a 200 MiB upload: the body was buffered"
    );
}
