//! An acknowledge-then-deliver route with a named upstream: its queued
//! notifications are delivered to that upstream, never to the default one.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::vectors::{fixture, WECHAT_SUCCESS};
use common::{client, post};
use gateway_support::{temp_path, Proc};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_deliveries_go_to_their_routes_upstream() {
    let default = Upstream::start().await;
    let orders = Upstream::start().await;
    let dir = temp_path("ack-upstreams");
    std::fs::create_dir_all(&dir).unwrap();
    let text = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\ndata_dir = \"{}\"\nretry_backoff = \"200ms\"\n\
         [[upstreams]]\nname = \"orders\"\nurl = \"{}\"\n\
         [[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\nmode = \"ack-then-deliver\"\nupstream = \"orders\"\n",
        default.url(),
        dir.join("data").display(),
        orders.url(),
    );
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[],
        Stdio::null(),
    );
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let headers = [("content-type", "application/json")];
    for _ in 0..3 {
        let a = post(&client(), gw.addr, "/wx/notify", &headers, doc.to_vec()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.text(), WECHAT_SUCCESS);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while orders.calls("/wx/notify") == 0 {
        assert!(
            Instant::now() < deadline,
            "the queued notification was never delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Settled: one delivery to the route's upstream, none to the default.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(orders.calls("/wx/notify"), 1);
    assert_eq!(default.total(), 0);
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}
