//! The axum example, served on a real loopback server and hit with storms.

use test_support::common;
#[path = "../../examples/axum.rs"]
mod example;
use test_support::verify_support;

use common::vectors::{check, ALIPAY, ALIPAY_VECTORS, WECHATPAY_V3, WECHATPAY_V3_VECTORS};
use common::{all_at_once, client, post};
use example::{app, Shop};
use std::time::Duration;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::verify::VerifyLayer;

async fn start() -> (std::net::SocketAddr, Shop) {
    let shop = Shop::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The wechatpay-go test keys, the clock at that vector's signing time.
    let now = verify_support::wechatpay_v3().now;
    let keys = VerifyLayer::new(verify_support::wechatpay_v3_keys())
        .clock(move || verify_support::at(now));
    let router = app(shop.clone(), MemoryStore::new(), keys);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (addr, shop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wechat_storm_runs_after_pay_once_and_every_copy_gets_success() {
    let (addr, shop) = start().await;
    let client = client();
    // wechatpay-go's signed and encrypted notification.
    let wx = WECHATPAY_V3_VECTORS[0].base();
    let answers = all_at_once(7, |_| {
        let (client, wx) = (client.clone(), wx.clone());
        async move {
            post(
                &client,
                addr,
                "/notify/wechatpay",
                &wx.header_refs(),
                wx.body.clone(),
            )
            .await
        }
    })
    .await;
    let success = WECHATPAY_V3.success.expect("a fixed reply");
    for a in &answers {
        check(a, success, "wechat copy");
    }
    assert_eq!(
        shop.after_pay_runs("3119dfba-e649-5eec-ab1e-3412bc4d2e17"),
        1
    );
    // The official doc's notification is not signed by these keys: refused,
    // the handler not called.
    let doc = WECHATPAY_V3_VECTORS[1].base();
    let a = post(
        &client,
        addr,
        "/notify/wechatpay",
        &doc.header_refs(),
        doc.body.clone(),
    )
    .await;
    assert_eq!(
        (a.status, a.text()),
        (401, common::vectors::WECHAT_FAIL.to_owned())
    );
    assert_eq!(shop.after_pay_runs("EV-2018022511223320873"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alipay_retries_get_the_seven_bytes() {
    let (addr, shop) = start().await;
    let client = client();
    // trade_status_sync: notify_id 2019081500222155624068450559358070 for
    // the order 20190815155618536-564-57.
    let ali = ALIPAY_VECTORS[0].base();
    for _ in 0..3 {
        let a = post(
            &client,
            addr,
            "/notify/alipay",
            &ali.header_refs(),
            ali.body.clone(),
        )
        .await;
        check(&a, ALIPAY.success.expect("a fixed reply"), "alipay retry");
    }
    assert_eq!(shop.after_pay_runs("20190815155618536-564-57"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triple_click_creates_one_order() {
    let (addr, shop) = start().await;
    let client = client();
    let headers = [
        ("idempotency-key", "click-1"),
        ("content-type", "application/json"),
        ("authorization", "Bearer u1"),
    ];
    let answers = all_at_once(3, |i| {
        let client = client.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(i as u64 * 30)).await;
            post(
                &client,
                addr,
                "/api/orders",
                &headers,
                r#"{"sku":"tea","qty":2}"#,
            )
            .await
        }
    })
    .await;
    for a in &answers {
        assert_eq!(a.status, 201);
        assert_eq!(a.body, answers[0].body);
    }
    assert_eq!(answers.iter().filter(|a| a.replayed()).count(), 2);
    assert_eq!(shop.orders_created(), 1);
    // Another payload under the same key is refused.
    let a = post(
        &client,
        addr,
        "/api/orders",
        &headers,
        r#"{"sku":"tea","qty":200}"#,
    )
    .await;
    assert_eq!(a.status, 422);
    // A missing key is a clear 400.
    let a = post(
        &client,
        addr,
        "/api/orders",
        &[("content-type", "application/json")],
        "{}",
    )
    .await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("Idempotency-Key"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_flow_three_submits_one_order() {
    let (addr, shop) = start().await;
    let client = client();
    let req = http::Request::get(format!("http://{addr}/orders/token"))
        .header("authorization", "Bearer u7")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let issued = common::read(client.request(req).await.unwrap()).await;
    assert_eq!(issued.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&issued.body).unwrap();
    let token = v["token"].as_str().unwrap().to_owned();
    let answers = all_at_once(3, |_| {
        let (client, token) = (client.clone(), token.clone());
        async move {
            let headers = [
                ("idempotency-token", token.as_str()),
                ("authorization", "Bearer u7"),
                ("content-type", "application/json"),
            ];
            post(&client, addr, "/orders", &headers, r#"{"sku":"tea"}"#).await
        }
    })
    .await;
    for a in &answers {
        assert_eq!(a.status, 201, "{}", a.text());
        assert_eq!(a.body, answers[0].body);
    }
    assert_eq!(shop.orders_created(), 1);
    // The same token from another user is refused.
    let headers = [
        ("idempotency-token", token.as_str()),
        ("authorization", "Bearer mallory"),
        ("content-type", "application/json"),
    ];
    let a = post(&client, addr, "/orders", &headers, r#"{"sku":"tea"}"#).await;
    assert_eq!(a.status, 400);
    assert_eq!(shop.orders_created(), 1);
}

#[tokio::test]
async fn handlers_can_take_the_key_as_an_extractor() {
    use axum::routing::post;
    use tower::ServiceExt;
    use tower_idempotency::{IdempotencyKey, IdempotencyLayer};
    async fn with_key(key: IdempotencyKey) -> String {
        key.as_str().to_owned()
    }
    async fn maybe(key: Option<IdempotencyKey>) -> String {
        format!("{}", key.is_some())
    }
    let app = axum::Router::new()
        .route(
            "/a",
            post(with_key).layer(IdempotencyLayer::idempotency_key()),
        )
        .route("/b", post(maybe))
        .route("/c", post(with_key));
    let req = common::request("/a", &[("idempotency-key", "k-9")], "{}");
    let a = common::read(app.clone().oneshot(req).await.unwrap()).await;
    assert_eq!(a.status, 200);
    assert!(
        a.text().starts_with("idem:idempotency-key:/a:"),
        "{}",
        a.text()
    );
    assert!(a.text().ends_with(":k-9"), "{}", a.text());
    let b = common::read(
        app.clone()
            .oneshot(common::request("/b", &[], "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(b.text(), "false");
    // A route without the layers has no key: a clear 400.
    let c = common::read(app.oneshot(common::request("/c", &[], "{}")).await.unwrap()).await;
    assert_eq!(c.status, 400);
}
