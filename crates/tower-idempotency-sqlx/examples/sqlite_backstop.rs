//! The full recipe for payment notifications: the dedup layers in front, and
//! the business backstop behind them, in an embedded SQLite database (sqlx).
//!
//! ```sh
//! cargo run -p tower-idempotency-sqlx --features sqlite --example sqlite_backstop   # 127.0.0.1:3001 (or $ADDR), database in ./shop.db (or $DB)
//! curl -s -XPOST localhost:3001/notify/wechatpay -H 'content-type: application/json' -d '{"id":"EV-1","create_time":"2026-01-01T00:00:00+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{"original_type":"transaction","algorithm":"AEAD_AES_256_GCM","ciphertext":"{\"out_trade_no\":\"O-1\",\"transaction_id\":\"4200000001\",\"trade_state\":\"SUCCESS\",\"amount\":{\"total\":1999}}","associated_data":"transaction","nonce":"n"}}'
//! sqlite3 shop.db 'select * from orders; select * from points_ledger'   # run the curl again: still one award
//! ```
//!
//! Two lines of defence, each enough on its own for a different failure:
//!
//! 1. **The layers** (`IdempotencyLayer::wechatpay_v3()` on the route, over
//!    a `SqlStore` in the same database): the seven copies of a notification
//!    that WeChat Pay sends within seconds reach the handler once; the others
//!    wait for it and get the same `{"code":"SUCCESS","message":"成功"}`.
//!    The handler writes the idempotency record **in its own transaction**
//!    (`claim.complete_in(&mut db, &response)`), so the payment and "this
//!    notification is done" commit together: an instance that dies before
//!    the commit leaves neither (the retry runs), one that dies after it
//!    leaves both (the retry replays). Records outlive restarts: they are
//!    rows of `idempotency_records`, created by the store.
//! 2. **The backstop** (in the same transaction): `UPDATE orders SET
//!    status='PAID' WHERE order_no=? AND status='UNPAID'`, and points only
//!    when that update changed a row. It holds when the layers are not there
//!    or cannot see a repeat: a second notification id for one payment.
//!
//! `app(shop, false)` leaves the dedup layers out (only the channel's reply
//! format stays), so `tests/sqlite_backstop.rs` can show the backstop alone
//! holding under a storm.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::normalize::NormalizeLayer;
use tower_idempotency::store::{ActiveClaim, StoreError, StoredResponse};
use tower_idempotency::{IdempotencyLayer, Preset};
use tower_idempotency_sqlx::{CompleteIn, SqlStore};

/// The schema: users with points, orders and the points ledger. The
/// idempotency records live in the store's own table
/// (`idempotency_records`, created by `SqlStore::sqlite`). The ledger has no
/// unique index on purpose, so a double award would show.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS users (
    id      INTEGER PRIMARY KEY,
    points  INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS orders (
    order_no        TEXT PRIMARY KEY,
    user_id         INTEGER NOT NULL REFERENCES users(id),
    amount          INTEGER NOT NULL,          -- in cents (fen)
    status          TEXT NOT NULL DEFAULT 'UNPAID',
    transaction_id  TEXT,
    paid_at         TEXT
);
CREATE TABLE IF NOT EXISTS points_ledger (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id   INTEGER NOT NULL REFERENCES users(id),
    order_no  TEXT NOT NULL,
    points    INTEGER NOT NULL
);
";

/// Opens (creating if needed) the database at `path`: WAL, so readers never
/// block the writer, and a busy timeout, so concurrent writers queue instead
/// of failing.
pub async fn open(path: &Path) -> sqlx::Result<SqlitePool> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    sqlx::raw_sql(SCHEMA).execute(&pool).await?;
    Ok(pool)
}

/// Creates a user (if new) and an unpaid order of `amount` cents.
pub async fn place_order(
    pool: &SqlitePool,
    order_no: &str,
    user_id: i64,
    amount: i64,
) -> sqlx::Result<()> {
    sqlx::query("INSERT OR IGNORE INTO users (id) VALUES (?)")
        .bind(user_id)
        .execute(pool)
        .await?;
    sqlx::query("INSERT INTO orders (order_no, user_id, amount) VALUES (?, ?, ?)")
        .bind(order_no)
        .bind(user_id)
        .bind(amount)
        .execute(pool)
        .await?;
    Ok(())
}

/// The application state: the pool, the idempotency store in the same
/// database, and how often the handler was entered (to show what the layers
/// keep away from the database).
#[derive(Clone, Debug)]
pub struct Shop {
    pool: SqlitePool,
    store: SqlStore,
    entries: Arc<AtomicUsize>,
}

impl Shop {
    /// A shop over `pool`; creates the store's table if it is missing.
    pub async fn new(pool: SqlitePool) -> Result<Self, StoreError> {
        Ok(Self {
            store: SqlStore::sqlite(pool.clone()).await?,
            pool,
            entries: Arc::default(),
        })
    }

    /// How many times the notification handler was entered.
    pub fn handler_entries(&self) -> usize {
        self.entries.load(Ordering::SeqCst)
    }
}

/// A WeChat Pay v3 notification (the fields this handler reads; its `id`
/// is the layers' key).
#[derive(Debug, Deserialize)]
pub struct Notification {
    /// `TRANSACTION.SUCCESS` for a payment.
    pub event_type: String,
    /// The encrypted transaction.
    pub resource: Resource,
}

/// The `resource` of a notification.
#[derive(Debug, Deserialize)]
pub struct Resource {
    /// `transaction` for payments.
    pub original_type: String,
    /// The transaction, encrypted with AEAD_AES_256_GCM.
    pub ciphertext: String,
}

/// The decrypted transaction (the fields this handler reads).
#[derive(Debug, Deserialize)]
pub struct Transaction {
    /// The merchant's order number.
    pub out_trade_no: String,
    /// WeChat Pay's transaction id: one per payment.
    pub transaction_id: String,
    /// `SUCCESS` when paid.
    pub trade_state: String,
    /// The amount.
    pub amount: Amount,
}

/// The amount of a transaction.
#[derive(Debug, Deserialize)]
pub struct Amount {
    /// In cents (fen).
    pub total: i64,
}

/// Decrypts the resource. A real handler first verifies the
/// `Wechatpay-Signature` header, then decrypts `ciphertext` with
/// AEAD_AES_256_GCM under the merchant's APIv3 key (`nonce`,
/// `associated_data`). This demo's sender puts the transaction's JSON in
/// `ciphertext` in clear, so that it runs without keys.
fn decrypt(resource: &Resource) -> Option<Transaction> {
    serde_json::from_str(&resource.ciphertext).ok()
}

/// A notification body as this demo's sender writes it; `create_time` changes
/// on every retry (WeChat Pay re-timestamps and re-signs each copy).
pub fn notification(
    notify_id: &str,
    order_no: &str,
    transaction_id: &str,
    total: i64,
    create_time: &str,
) -> String {
    let transaction = serde_json::json!({
        "out_trade_no": order_no,
        "transaction_id": transaction_id,
        "trade_state": "SUCCESS",
        "amount": { "total": total, "currency": "CNY" },
    });
    serde_json::json!({
        "id": notify_id,
        "create_time": create_time,
        "resource_type": "encrypt-resource",
        "event_type": "TRANSACTION.SUCCESS",
        "summary": "支付成功",
        "resource": {
            "original_type": "transaction",
            "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": transaction.to_string(),
            "associated_data": "transaction",
            "nonce": "demo-nonce",
        },
    })
    .to_string()
}

/// Points for a payment: one per yuan.
fn points_for(amount: i64) -> i64 {
    amount / 100
}

/// The notification handler: 200 when the payment is recorded (now or
/// before), 500 when the database failed (WeChat Pay retries), 400 when the
/// notification cannot be read.
async fn wechat_notify(
    State(shop): State<Shop>,
    claim: Option<Extension<ActiveClaim>>,
    Json(notification): Json<Notification>,
) -> StatusCode {
    shop.entries.fetch_add(1, Ordering::SeqCst);
    if notification.event_type != "TRANSACTION.SUCCESS"
        || notification.resource.original_type != "transaction"
    {
        return StatusCode::OK; // nothing to do, but acknowledge it
    }
    let Some(tx) = decrypt(&notification.resource) else {
        return StatusCode::BAD_REQUEST;
    };
    if tx.trade_state != "SUCCESS" {
        return StatusCode::OK;
    }
    let claim = claim.map(|Extension(claim)| claim);
    match record_payment(&shop.pool, claim.as_ref(), &tx).await {
        Ok(Recorded::LostClaim) => StatusCode::SERVICE_UNAVAILABLE,
        Ok(_) => StatusCode::OK,
        Err(e) => {
            eprintln!("recording payment {} failed: {e}", tx.transaction_id);
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// What [`record_payment`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The order moved to PAID and the points were awarded.
    Paid,
    /// The order was not UNPAID with this amount (already paid, by this
    /// transaction or another, unknown, or the amount differs): no points.
    NotApplied,
    /// The claim on the notification was lost (its lease ran out and another
    /// copy took it over): rolled back, the other copy does the work.
    LostClaim,
}

/// What the handler answers, and what every later copy replays.
fn success() -> StoredResponse {
    StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new())
}

/// The payment, the backstop and (behind the layers) the idempotency
/// record, in one database transaction.
pub async fn record_payment(
    pool: &SqlitePool,
    claim: Option<&ActiveClaim>,
    tx: &Transaction,
) -> Result<Recorded, Box<dyn std::error::Error + Send + Sync>> {
    // IMMEDIATE takes the write lock up front: concurrent copies queue on the
    // busy timeout instead of failing to upgrade a read transaction.
    let mut db = pool.begin_with("BEGIN IMMEDIATE").await?;
    // The conditional update: only one transaction can move UNPAID to PAID.
    let paid: Option<(i64, i64)> = sqlx::query_as(
        "UPDATE orders SET status = 'PAID', transaction_id = ?, paid_at = CURRENT_TIMESTAMP
         WHERE order_no = ? AND status = 'UNPAID' AND amount = ?
         RETURNING user_id, amount",
    )
    .bind(&tx.transaction_id)
    .bind(&tx.out_trade_no)
    .bind(tx.amount.total)
    .fetch_optional(&mut *db)
    .await?;
    let recorded = match paid {
        // A row changed: this is the one delivery that awards the points.
        Some((user_id, amount)) => {
            let points = points_for(amount);
            sqlx::query("INSERT INTO points_ledger (user_id, order_no, points) VALUES (?, ?, ?)")
                .bind(user_id)
                .bind(&tx.out_trade_no)
                .bind(points)
                .execute(&mut *db)
                .await?;
            sqlx::query("UPDATE users SET points = points + ? WHERE id = ?")
                .bind(points)
                .bind(user_id)
                .execute(&mut *db)
                .await?;
            Recorded::Paid
        }
        None => Recorded::NotApplied,
    };
    // "This notification is done", committed with the payment or not at all.
    if let Some(claim) = claim
        && !claim.complete_in(&mut db, &success()).await?
    {
        db.rollback().await?;
        return Ok(Recorded::LostClaim);
    }
    db.commit().await?;
    Ok(recorded)
}

/// The app. With `with_layers`, the route has the full WeChat Pay v3 stack
/// (normalize, key, dedup over the shop's `SqlStore`); without, only the
/// channel's reply format, and the backstop alone stands between a storm and
/// the points.
pub fn app(shop: Shop, with_layers: bool) -> Router {
    let route = if with_layers {
        post(wechat_notify).layer(IdempotencyLayer::wechatpay_v3().with_store(shop.store.clone()))
    } else {
        post(wechat_notify).layer(NormalizeLayer::new(Preset::wechatpay_v3().reply().clone()))
    };
    Router::new()
        .route("/notify/wechatpay", route)
        .with_state(shop)
}

#[allow(dead_code)] // unused when this file is included by tests/sqlite_backstop.rs
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DB").unwrap_or_else(|_| "shop.db".to_owned());
    let pool = open(Path::new(&db)).await?;
    // A demo order for the curl above: O-1, 19.99 yuan, user 1.
    let exists: Option<(String,)> =
        sqlx::query_as("SELECT order_no FROM orders WHERE order_no = 'O-1'")
            .fetch_optional(&pool)
            .await?;
    if exists.is_none() {
        place_order(&pool, "O-1", 1, 1999).await?;
    }
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on {}, database {db}", listener.local_addr()?);
    axum::serve(listener, app(Shop::new(pool).await?, true)).await?;
    Ok(())
}
