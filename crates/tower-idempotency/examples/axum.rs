//! An axum app with a verified WeChat Pay v3 notification route (its
//! handler takes the decrypted resource), an Alipay notification route, an
//! `Idempotency-Key` client API, and the one-time token flow
//! (`GET /orders/token`, then `POST /orders` with the token), all sharing one
//! in-memory store.
//!
//! The WeChat Pay keys come from `WECHATPAY_SERIAL`, `WECHATPAY_PLATFORM_KEY`
//! (a PEM file) and `WECHATPAY_APIV3_KEY`; without them, wechatpay-go's test
//! keys of `tests/fixtures/`.
//!
//! ```sh
//! cargo run --example axum            # listens on 127.0.0.1:3000 (or $ADDR)
//! # Idempotency-Key: a double click sends the same key twice.
//! curl -s -XPOST localhost:3000/api/orders -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"tea","qty":2}'
//! curl -si -XPOST localhost:3000/api/orders -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"tea","qty":2}'  # replayed
//! # One-time token: ask for one, then submit with it.
//! T=$(curl -s -H 'authorization: Bearer u1' localhost:3000/orders/token | sed 's/.*"token":"\([0-9a-f]*\)".*/\1/')
//! curl -s -XPOST localhost:3000/orders -H "idempotency-token: $T" -H 'authorization: Bearer u1' -H 'content-type: application/json' -d '{"sku":"tea"}'
//! ```
//!
//! The handlers know nothing of idempotency or of the channels' reply
//! formats: they answer 2xx on success, and the layers do the rest.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get_service;
use axum::routing::post;
use axum::{Json, Router};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::token::IssueToken;
use tower_idempotency::verify::{DecryptedResource, VerifyLayer, WechatPayV3Keys};
use tower_idempotency::{IdempotencyLayer, Preset};

/// The business side: orders and how often the "after pay" side effects ran.
#[derive(Clone, Debug, Default)]
pub struct Shop {
    paid: Arc<Mutex<HashMap<String, u32>>>,
    orders: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl Shop {
    /// How often the side effects of a payment ran for `order`.
    pub fn after_pay_runs(&self, order: &str) -> u32 {
        self.paid.lock().unwrap().get(order).copied().unwrap_or(0)
    }

    /// How many orders were created.
    pub fn orders_created(&self) -> usize {
        self.orders.lock().unwrap().len()
    }

    fn do_after_pay(&self, order: &str) {
        *self
            .paid
            .lock()
            .unwrap()
            .entry(order.to_owned())
            .or_default() += 1;
    }
}

/// WeChat Pay v3: the layers checked the signature and decrypted
/// `resource`; act on the transaction.
async fn wechat_notify(
    State(shop): State<Shop>,
    DecryptedResource(resource): DecryptedResource,
    Json(notification): Json<serde_json::Value>,
) -> StatusCode {
    let (Some(id), Ok(_transaction)) = (
        notification["id"].as_str(),
        serde_json::from_slice::<serde_json::Value>(&resource),
    ) else {
        return StatusCode::BAD_REQUEST;
    };
    shop.do_after_pay(id);
    StatusCode::OK
}

/// Alipay: verify `sign` here (elided), then act on `out_trade_no`.
async fn alipay_notify(State(shop): State<Shop>, body: String) -> StatusCode {
    let out_trade_no = form_urlencoded::parse(body.as_bytes())
        .find(|(k, _)| k == "out_trade_no")
        .map(|(_, v)| v.into_owned());
    match out_trade_no {
        Some(order) => {
            shop.do_after_pay(&order);
            StatusCode::OK
        }
        None => StatusCode::BAD_REQUEST,
    }
}

/// A client API: create an order. A double click sends the same key twice.
async fn create_order(
    State(shop): State<Shop>,
    Json(order): Json<serde_json::Value>,
) -> (StatusCode, Json<serde_json::Value>) {
    let mut orders = shop.orders.lock().unwrap();
    orders.push(order.clone());
    let id = orders.len();
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "order_id": id, "order": order })),
    )
}

/// The app: one store shared by every route (keys are scoped by route).
pub fn app(shop: Shop, store: MemoryStore, wechat_keys: impl Into<VerifyLayer>) -> Router {
    // The token issuer takes this layer's store, principal and prefix.
    let orders = IdempotencyLayer::new_in(Preset::client_token(), store.clone());
    Router::new()
        .route(
            "/notify/wechatpay",
            post(wechat_notify).layer(
                IdempotencyLayer::new_in(Preset::wechatpay_v3(), store.clone()).verify(wechat_keys),
            ),
        )
        .route(
            "/notify/alipay",
            post(alipay_notify).layer(IdempotencyLayer::new_in(Preset::alipay(), store.clone())),
        )
        .route(
            "/api/orders",
            post(create_order).layer(IdempotencyLayer::new_in(
                Preset::idempotency_key(),
                store.clone(),
            )),
        )
        .route("/orders/token", get_service(IssueToken::for_layer(&orders)))
        .route("/orders", post(create_order).layer(orders))
        .with_state(shop)
}

#[allow(dead_code)] // unused when this file is included by tests/axum_example.rs
#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on {}", listener.local_addr()?);
    let keys = wechat_keys().map_err(std::io::Error::other)?;
    axum::serve(listener, app(Shop::default(), MemoryStore::new(), keys)).await
}

/// The WeChat Pay keys from the environment, or the test keys.
#[allow(dead_code)] // unused when this file is included by tests/axum_example.rs
fn wechat_keys() -> Result<WechatPayV3Keys, Box<dyn std::error::Error + Send + Sync>> {
    let var = |name, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let serial = var("WECHATPAY_SERIAL", "D7CE59D1F522D701");
    let pem = std::fs::read(var(
        "WECHATPAY_PLATFORM_KEY",
        "tests/fixtures/wechatpay_v3_platform_cert.pem",
    ))?;
    let api_v3_key = var("WECHATPAY_APIV3_KEY", "testMchAPIv3Key0");
    Ok(WechatPayV3Keys::new()
        .platform_key(serial, pem)?
        .api_v3_key(api_v3_key)?)
}
