//! The gateway example against a slow or hung upstream: the reply deadline
//! (`--upstream-timeout` on guarded routes) and the run limit
//! (`--max-run`). Build the gateway first:
//! `cargo build --all-features --example gateway`.

mod common;
mod gateway_support;
#[cfg(feature = "redis")]
mod support_redis;

use bytes::Bytes;
use common::{client, post, serve};
use gateway_support::Proc;
use http::{Request, Response};
use http_body_util::Full;
use std::convert::Infallible;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WECHAT_SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
const WECHAT_FAIL: &str = r#"{"code":"FAIL","message":"失败"}"#;

const WECHAT_V3_HEADERS: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("Wechatpay-Nonce", "EcZ9Cmy4Xyx1i6RlJQzLcCyEqDa26NBz"),
    ("Wechatpay-Timestamp", "1624523846"),
    ("Wechatpay-Serial", "D7CE59D1F522D701"),
    ("Wechatpay-Signature", "tJHIiIS9eB2hAYstmAmbbD3ZE5LiIm/Ug5tuL4fC0YOFRWIHV39UFIZXC0e9Wl6lBu6sKvkqDkzpqzBsVHyXFlbYZTOQrVdG4b6LfTnK4mikv9++ixJMd3vTf2yCqvBkh98zs3Ds5zsYQakzbcwhmw4fMJs4nPLws28H0UW9FjDR//rxELLwXvV1VEA1IBLX70xptjL8hrfUjEE8kkry6yNJTHZRU8CAc7qHli2Ng1V1qb9ARbK8A3ThmFmPQvRGrapI/jS2laKKgYUmfdEdkNO6B2Cke5e8VTxY406ArAmQ90GAihDwIcb16TQMnzCMBoutnwZKNiKRACrFmtxw2Q=="),
];

fn notification() -> Bytes {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/wechatpay_v3_notify_wechatpay-go.json");
    Bytes::from(std::fs::read(path).unwrap())
}

/// An upstream that counts its calls and answers 200 after `delay`.
async fn slow_upstream(delay: Duration) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let count = calls.clone();
    let svc = tower::service_fn(move |_req: Request<hyper::body::Incoming>| {
        count.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(delay).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    });
    let (addr, _task) = serve(svc).await;
    (format!("http://{addr}"), calls)
}

fn start(upstream: &str, more: &[&str]) -> Proc {
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        upstream,
        "--route",
        "/wx=wechatpay-v3",
    ];
    args.extend_from_slice(more);
    Proc::start(&args, &[], Stdio::null())
}

/// Issue: a slow upstream ran twice. The upstream takes 3 s, the reply
/// deadline is 1 s: the first copy gets WeChat Pay's failure reply at the
/// deadline, the upstream call goes on, a copy at 1.5 s is not forwarded
/// again, and a copy at 4.5 s gets the recorded success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_runs_once_and_its_success_is_replayed() {
    let (upstream, calls) = slow_upstream(Duration::from_secs(3)).await;
    let gw = start(&upstream, &["--upstream-timeout", "1s"]);
    let client = client();
    let body = notification();
    let t0 = Instant::now();

    let first = post(
        &client,
        gw.addr,
        "/wx/notify",
        WECHAT_V3_HEADERS,
        body.clone(),
    )
    .await;
    let took = t0.elapsed();
    assert_eq!((first.status, first.text().as_str()), (500, WECHAT_FAIL));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2900),
        "the failure reply came after {took:?}, not at the 1 s deadline"
    );

    tokio::time::sleep_until((t0 + Duration::from_millis(1500)).into()).await;
    let second = post(
        &client,
        gw.addr,
        "/wx/notify",
        WECHAT_V3_HEADERS,
        body.clone(),
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the copy at 1.5 s was forwarded again (it got {} {})",
        second.status,
        second.text()
    );

    tokio::time::sleep_until((t0 + Duration::from_millis(4500)).into()).await;
    let third = post(&client, gw.addr, "/wx/notify", WECHAT_V3_HEADERS, body).await;
    assert_eq!((third.status, third.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(third.replayed(), "the copy at 4.5 s ran again");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Issue: a hung upstream blocked its key forever. With a lease of 300 ms
/// and a run limit of 1 s, the call is given up at 1 s and a copy sent 3 s
/// later is forwarded again (not 409, not the failure reply for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_frees_its_key_at_the_run_limit() {
    let (upstream, calls) = slow_upstream(Duration::from_secs(3600)).await;
    let gw = start(&upstream, &["--lease", "300ms", "--max-run", "1s"]);
    let client = client();
    let body = notification();

    let t0 = Instant::now();
    let first = post(
        &client,
        gw.addr,
        "/wx/notify",
        WECHAT_V3_HEADERS,
        body.clone(),
    )
    .await;
    assert_eq!((first.status, first.text().as_str()), (500, WECHAT_FAIL));
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the caller waited {:?} for a hung upstream",
        t0.elapsed()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    tokio::time::sleep_until((t0 + Duration::from_secs(3)).into()).await;
    let again = post(&client, gw.addr, "/wx/notify", WECHAT_V3_HEADERS, body).await;
    assert_ne!(again.status, 409, "the key is still blocked");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the copy at 3 s was not forwarded again ({} {})",
        again.status,
        again.text()
    );
}

/// SIGTERM after the reply deadline: the drain waits for the upstream call
/// still running in the background (on the gateway's task tracker), its
/// success is written to Redis, and the next instance replays it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_call_past_its_reply_deadline() {
    if !support_redis::redis_available() {
        return;
    }
    let redis = support_redis::RedisServer::start();
    let store = format!("redis://127.0.0.1:{}", redis.port());
    let (upstream, calls) = slow_upstream(Duration::from_millis(2000)).await;
    let more = ["--store", store.as_str(), "--upstream-timeout", "300ms"];
    let mut a = start(&upstream, &more);
    let client = client();
    let body = notification();
    let t0 = Instant::now();
    let first = post(
        &client,
        a.addr,
        "/wx/notify",
        WECHAT_V3_HEADERS,
        body.clone(),
    )
    .await;
    assert_eq!((first.status, first.text().as_str()), (500, WECHAT_FAIL));
    assert!(
        t0.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t0.elapsed()
    );
    a.signal(libc::SIGTERM);
    let status = loop {
        if let Some(status) = a.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "exited after {:?}, before the upstream answered",
        t0.elapsed()
    );

    let b = start(&upstream, &more);
    let again = post(&client, b.addr, "/wx/notify", WECHAT_V3_HEADERS, body).await;
    assert_eq!((again.status, again.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(again.replayed(), "the background call's success was lost");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
