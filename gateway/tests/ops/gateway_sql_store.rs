//! The gateway with `--store postgres://…` and `--store sqlite:PATH`: two
//! instances share one PostgreSQL; a restarted instance over the same SQLite
//! file replays instead of forwarding again.

use crate::gateway_support;
use test_support::common;
use test_support::support_sql;

use common::upstream::Upstream;
use common::vectors::{WECHATPAY_V3_VECTORS, WECHAT_SUCCESS};
use common::{all_at_once, client};
use gateway_support::storm::{headers_with, send, Headers, K};
use gateway_support::Gateway;
use support_sql::{shared_postgres, SqliteFile};

/// K copies of the WeChat Pay v3 vector (the upstream takes 300 ms), spread
/// over the gateways: one upstream call, K successes; later copies replay.
async fn storm_over(gateways: &[&Gateway], up: &Upstream, path: &str) {
    let client = client();
    let v = &WECHATPAY_V3_VECTORS[0];
    let headers: Headers = headers_with(v, &[("x-delay-ms", "300")]);
    let answers = all_at_once(K, |i| {
        let url = gateways[i % gateways.len()].url(path);
        let (client, headers, body) = (client.clone(), headers.clone(), v.base().body);
        async move { send(&client, &url, &headers, body).await }
    })
    .await;
    for a in &answers {
        assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    }
    assert_eq!(up.calls(path), 1);
    for gw in gateways {
        let r = send(&client, &gw.url(path), &v.base().headers, v.base().body).await;
        assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
        assert!(r.replayed());
    }
    assert_eq!(up.calls(path), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_postgres() {
    let Some(pg) = shared_postgres() else {
        return;
    };
    let up = Upstream::start().await;
    let a = Gateway::start(&up.url(), &["--store", pg.url()]);
    let b = Gateway::start(&up.url(), &["--store", pg.url()]);
    // A path of its own: the shared server keeps records of earlier runs.
    let path = format!(
        "/sql/{:x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    );
    storm_over(&[&a, &b], &up, &path).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_over_sqlite_replays() {
    let file = SqliteFile::new();
    let store = file.url();
    let up = Upstream::start().await;
    let first = Gateway::start(&up.url(), &["--store", &store]);
    storm_over(&[&first], &up, "/sqlite/restart").await;
    drop(first);
    let second = Gateway::start(&up.url(), &["--store", &store]);
    let v = &WECHATPAY_V3_VECTORS[0];
    let r = send(
        &client(),
        &second.url("/sqlite/restart"),
        &v.base().headers,
        v.base().body,
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(r.replayed(), "the record outlived the process");
    assert_eq!(up.calls("/sqlite/restart"), 1);
}

#[test]
fn bad_sql_store_urls_are_refused() {
    use std::process::{Command, Stdio};
    for bad in ["sqlite:", "sqlite::memory:", "postgres://"] {
        let out = Command::new(gateway_support::gateway_bin())
            .args([
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:9",
                "--store",
                bad,
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
    }
    // A password in the URL is never printed.
    let out = Command::new(gateway_support::gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .args(["--store", "postgres://app:s3cret-pw@127.0.0.1:9/shop"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("s3cret-pw"), "{all}");
}
