//! The WeChat Pay state example on a real loopback server over a temp-file
//! SQLite database: a storm of copies pays an order once, another
//! notification of the paid order answers success and changes nothing, and
//! a closed order stays closed.

use test_support::common;
use test_support::support_sql::SqliteFile;
#[path = "../../examples/wechatpay_state.rs"]
mod example;

use common::{all_at_once, client, post, Answer};
use example::{app, open, Shop};
use std::net::SocketAddr;

const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;

/// A notification as the example's sender writes it (the transaction in
/// clear in `ciphertext`).
fn notification(id: &str, order_no: &str, transaction_id: &str) -> String {
    let transaction = serde_json::json!({
        "out_trade_no": order_no,
        "transaction_id": transaction_id,
        "trade_state": "SUCCESS",
        "amount": { "total": 1999, "currency": "CNY" },
    });
    serde_json::json!({
        "id": id,
        "create_time": "2026-01-01T00:00:00+08:00",
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

async fn send(addr: SocketAddr, body: String) -> Answer {
    post(
        &client(),
        addr,
        "/notify/wechatpay",
        &[("content-type", "application/json")],
        body,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_are_paid_once_and_never_move_back() {
    let file = SqliteFile::new();
    let pool = open(&file.path()).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO orders (order_no, amount) VALUES ('O-1', 1999);
         INSERT INTO orders (order_no, amount, status, version) VALUES ('O-2', 1999, 'CLOSED', 4);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = app(Shop::new(pool.clone()).await.unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    // Seven copies at once, then another notification of the same payment.
    let answers = all_at_once(7, |_| send(addr, notification("EV-1", "O-1", "4200000001"))).await;
    for a in answers {
        assert_eq!((a.status, a.text()), (200, SUCCESS.to_owned()));
    }
    let a = send(addr, notification("EV-2", "O-1", "4200000001")).await;
    assert_eq!((a.status, a.text()), (200, SUCCESS.to_owned()));
    // A payment of a closed order: success (stop retrying), order untouched.
    let a = send(addr, notification("EV-3", "O-2", "4200000002")).await;
    assert_eq!((a.status, a.text()), (200, SUCCESS.to_owned()));

    let orders: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT order_no, status, version FROM orders ORDER BY order_no")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        orders,
        [
            ("O-1".to_owned(), "PAID".to_owned(), 1),
            ("O-2".to_owned(), "CLOSED".to_owned(), 4)
        ]
    );
    let payments: Vec<(String, String)> =
        sqlx::query_as("SELECT order_no, transaction_id FROM payments")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(payments, [("O-1".to_owned(), "4200000001".to_owned())]);
}
