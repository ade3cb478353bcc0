//! The gateway against a slow or hung upstream: the reply deadline
//! (`--upstream-timeout` on guarded routes) and the run limit
//! (`--max-run`).

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;

use common::upstream::{Replies, Upstream};
use common::vectors::{WECHATPAY_V3_VECTORS, WECHAT_FAIL, WECHAT_SUCCESS};
use common::{client, post};
use gateway_support::Proc;
use std::process::Stdio;
use std::time::{Duration, Instant};

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
    let up = Upstream::with(Replies::default().delay(Duration::from_secs(3))).await;
    let gw = start(&up.url(), &["--upstream-timeout", "1s"]);
    let client = client();
    let wx = WECHATPAY_V3_VECTORS[0].base();
    let (headers, body) = (wx.header_refs(), wx.body.clone());
    let t0 = Instant::now();

    let first = post(&client, gw.addr, "/wx/notify", &headers, body.clone()).await;
    let took = t0.elapsed();
    assert_eq!((first.status, first.text().as_str()), (500, WECHAT_FAIL));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2900),
        "the failure reply came after {took:?}, not at the 1 s deadline"
    );

    tokio::time::sleep_until((t0 + Duration::from_millis(1500)).into()).await;
    let second = post(&client, gw.addr, "/wx/notify", &headers, body.clone()).await;
    assert_eq!(
        up.total(),
        1,
        "the copy at 1.5 s was forwarded again (it got {} {})",
        second.status,
        second.text()
    );

    tokio::time::sleep_until((t0 + Duration::from_millis(4500)).into()).await;
    let third = post(&client, gw.addr, "/wx/notify", &headers, body).await;
    assert_eq!((third.status, third.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(third.replayed(), "the copy at 4.5 s ran again");
    assert_eq!(up.total(), 1);
}

/// Issue: a hung upstream blocked its key forever. With a lease of 300 ms
/// and a run limit of 1 s, the call is given up at 1 s and a copy sent 3 s
/// later is forwarded again (not 409, not the failure reply for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_frees_its_key_at_the_run_limit() {
    let up = Upstream::with(Replies::default().delay(Duration::from_secs(3600))).await;
    let gw = start(&up.url(), &["--lease", "300ms", "--max-run", "1s"]);
    let client = client();
    let wx = WECHATPAY_V3_VECTORS[0].base();
    let (headers, body) = (wx.header_refs(), wx.body.clone());

    let t0 = Instant::now();
    let first = post(&client, gw.addr, "/wx/notify", &headers, body.clone()).await;
    assert_eq!((first.status, first.text().as_str()), (500, WECHAT_FAIL));
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the caller waited {:?} for a hung upstream",
        t0.elapsed()
    );
    assert_eq!(up.total(), 1);

    tokio::time::sleep_until((t0 + Duration::from_secs(3)).into()).await;
    let again = post(&client, gw.addr, "/wx/notify", &headers, body).await;
    assert_ne!(again.status, 409, "the key is still blocked");
    assert_eq!(
        up.total(),
        2,
        "the copy at 3 s was not forwarded again ({} {})",
        again.status,
        again.text()
    );
}

/// SIGTERM after the reply deadline: the drain waits for the upstream call
/// still running in the background (on the gateway's task tracker), its
/// success is written to Redis, and the next instance replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_call_past_its_reply_deadline() {
    if !support_redis::redis_available() {
        return;
    }
    let redis = support_redis::RedisServer::start();
    let store = format!("redis://127.0.0.1:{}", redis.port());
    let up = Upstream::with(Replies::default().delay(Duration::from_millis(2000))).await;
    let more = ["--store", store.as_str(), "--upstream-timeout", "300ms"];
    let mut a = start(&up.url(), &more);
    let client = client();
    let wx = WECHATPAY_V3_VECTORS[0].base();
    let (headers, body) = (wx.header_refs(), wx.body.clone());
    let t0 = Instant::now();
    let first = post(&client, a.addr, "/wx/notify", &headers, body.clone()).await;
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

    let b = start(&up.url(), &more);
    let again = post(&client, b.addr, "/wx/notify", &headers, body).await;
    assert_eq!((again.status, again.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(again.replayed(), "the background call's success was lost");
    assert_eq!(up.total(), 1);
}
