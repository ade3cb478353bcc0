//! An axum app with a WeChat Pay v3 notification route, an Alipay
//! notification route, an `Idempotency-Key` client API, and the one-time
//! token flow (`GET /orders/token`, then `POST /orders` with the token), all
//! sharing one in-memory store.
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
use tower_idempotency::{IdempotencyLayer, Preset};

/// The business side: orders and how often the "after pay" side effects ran.
#[derive(Clone, Default)]
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

/// WeChat Pay v3: verify the signature and decrypt `resource` here (elided),
/// then act on the transaction.
async fn wechat_notify(
    State(shop): State<Shop>,
    Json(notification): Json<serde_json::Value>,
) -> StatusCode {
    let Some(id) = notification["id"].as_str() else {
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
pub fn app(shop: Shop, store: MemoryStore) -> Router {
    // The token issuer takes this layer's store, principal and prefix.
    let orders = IdempotencyLayer::new_in(Preset::client_token(), store.clone());
    Router::new()
        .route(
            "/notify/wechatpay",
            post(wechat_notify).layer(IdempotencyLayer::new_in(
                Preset::wechatpay_v3(),
                store.clone(),
            )),
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
    axum::serve(listener, app(Shop::default(), MemoryStore::new())).await
}
