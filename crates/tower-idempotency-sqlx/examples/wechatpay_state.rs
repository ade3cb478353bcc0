//! A WeChat Pay handler whose orders only move forward: "already paid:
//! answer success", with the seed's version check, in SQLite (sqlx).
//!
//! ```sh
//! cargo run -p tower-idempotency-sqlx --features sqlite --example wechatpay_state   # 127.0.0.1:3002 (or $ADDR), database in ./orders.db (or $DB)
//! curl -s -XPOST localhost:3002/notify/wechatpay -H 'content-type: application/json' -d '{"id":"EV-1","create_time":"2026-01-01T00:00:00+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{"original_type":"transaction","algorithm":"AEAD_AES_256_GCM","ciphertext":"{\"out_trade_no\":\"O-1\",\"transaction_id\":\"4200000001\",\"trade_state\":\"SUCCESS\",\"amount\":{\"total\":1999}}","associated_data":"transaction","nonce":"n"}}'
//! sqlite3 orders.db 'select * from orders; select * from payments'
//! ```
//!
//! The dedup layers run each notification once; the order's state is the
//! handler's: `StateMachine::advance` moves `UNPAID` (or `PAYING`) to `PAID`
//! with `UPDATE orders SET status = 'PAID', version = version + 1 WHERE
//! order_no = ? AND status IN ('UNPAID', 'PAYING') AND version = ?`, in the
//! transaction that also writes the payment and completes the idempotency
//! record (`claim.complete_in`). A second notification of the same payment
//! (another id) finds the order paid and answers success; a payment of a
//! closed order is answered success too (WeChat Pay must stop retrying) and
//! logged for a refund, without touching the order.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::path::Path;
use std::time::Duration;
use tower_idempotency::store::{ActiveClaim, StoreError, StoredResponse};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency_sqlx::{CompleteIn, SqlStore, StateMachine, StateMove};

/// Orders with their state and version, and the payments recorded.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    order_no  TEXT PRIMARY KEY,
    amount    INTEGER NOT NULL,
    status    TEXT NOT NULL DEFAULT 'UNPAID',
    version   INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS payments (
    order_no        TEXT NOT NULL,
    transaction_id  TEXT NOT NULL
);
";

/// Opens (creating if needed) the database at `path`.
pub async fn open(path: &Path) -> sqlx::Result<SqlitePool> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    sqlx::raw_sql(SCHEMA).execute(&pool).await?;
    Ok(pool)
}

/// The application state.
#[derive(Clone, Debug)]
pub struct Shop {
    pool: SqlitePool,
    store: SqlStore,
    orders: StateMachine,
}

impl Shop {
    /// A shop over `pool`, its idempotency records in the same database.
    pub async fn new(pool: SqlitePool) -> Result<Self, StoreError> {
        let orders = StateMachine::new("orders")
            .and_then(|m| m.with_columns("order_no", "status", "version"))
            .expect("plain identifiers");
        Ok(Self {
            store: SqlStore::sqlite(pool.clone()).await?,
            pool,
            orders,
        })
    }
}

/// The fields of a WeChat Pay v3 notification this handler reads.
#[derive(Debug, Deserialize)]
pub struct Notification {
    event_type: String,
    resource: Resource,
}

#[derive(Debug, Deserialize)]
struct Resource {
    ciphertext: String,
}

#[derive(Debug, Deserialize)]
struct Transaction {
    out_trade_no: String,
    transaction_id: String,
    trade_state: String,
}

/// A real handler takes the resource the verify layer decrypted
/// (`DecryptedResource`, with the APIv3 key); this demo's sender puts the
/// transaction's JSON in `ciphertext` in clear, so that it runs without keys.
fn decrypt(resource: &Resource) -> Option<Transaction> {
    serde_json::from_str(&resource.ciphertext).ok()
}

/// The notification handler: 200 once the notification is handled (now or
/// before), 500 when the database failed (WeChat Pay retries).
async fn wechat_notify(
    State(shop): State<Shop>,
    claim: Option<Extension<ActiveClaim>>,
    Json(notification): Json<Notification>,
) -> StatusCode {
    let Some(tx) = decrypt(&notification.resource) else {
        return StatusCode::BAD_REQUEST;
    };
    if notification.event_type != "TRANSACTION.SUCCESS" || tx.trade_state != "SUCCESS" {
        return StatusCode::OK;
    }
    let claim = claim.map(|Extension(claim)| claim);
    match pay(&shop, claim.as_ref(), &tx).await {
        Ok(Some(_)) => StatusCode::OK,
        // The claim was lost to another copy: it does the work.
        Ok(None) => StatusCode::SERVICE_UNAVAILABLE,
        Err(e) => {
            eprintln!("paying {} failed: {e}", tx.out_trade_no);
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// Moves the order to PAID and records the payment, with the idempotency
/// record, in one transaction; `None` when the claim was lost.
async fn pay(
    shop: &Shop,
    claim: Option<&ActiveClaim>,
    tx: &Transaction,
) -> Result<Option<StateMove>, Box<dyn std::error::Error + Send + Sync>> {
    // IMMEDIATE: the write lock up front, so that the read and the update
    // of the move are one writer's.
    let mut db = shop.pool.begin_with("BEGIN IMMEDIATE").await?;
    let moved = shop
        .orders
        .advance(&mut db, &tx.out_trade_no, &["UNPAID", "PAYING"], "PAID")
        .await?;
    match &moved {
        StateMove::Moved { .. } => {
            sqlx::query("INSERT INTO payments (order_no, transaction_id) VALUES (?, ?)")
                .bind(&tx.out_trade_no)
                .bind(&tx.transaction_id)
                .execute(&mut *db)
                .await?;
        }
        // Already paid: answer success.
        StateMove::AlreadyThere { .. } => {}
        StateMove::Refused { status, .. } => {
            eprintln!(
                "payment {} of order {} in state {status}: refund it",
                tx.transaction_id, tx.out_trade_no
            );
        }
        _ => eprintln!("payment {} of an unknown order", tx.transaction_id),
    }
    let done = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
    if let Some(claim) = claim
        && !claim.complete_in(&mut db, &done).await?
    {
        db.rollback().await?;
        return Ok(None);
    }
    db.commit().await?;
    Ok(Some(moved))
}

/// The app: the WeChat Pay v3 stack over the shop's `SqlStore`.
pub fn app(shop: Shop) -> Router {
    Router::new()
        .route(
            "/notify/wechatpay",
            post(wechat_notify)
                .layer(IdempotencyLayer::wechatpay_v3().with_store(shop.store.clone())),
        )
        .with_state(shop)
}

#[allow(dead_code)] // unused when this file is included by tests/sql/wechatpay_state.rs
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DB").unwrap_or_else(|_| "orders.db".to_owned());
    let pool = open(Path::new(&db)).await?;
    sqlx::query("INSERT OR IGNORE INTO orders (order_no, amount) VALUES ('O-1', 1999)")
        .execute(&pool)
        .await?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3002".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on {}, database {db}", listener.local_addr()?);
    axum::serve(listener, app(Shop::new(pool).await?)).await?;
    Ok(())
}
