//! The SQLite backstop example on a real loopback server over a temp-file
//! database: storms of WeChat Pay v3 notifications, with and without the
//! dedup layers.

use test_support::common;
#[path = "../../examples/sqlite_backstop.rs"]
mod example;

use common::{all_at_once, client, post, Answer};
use example::{app, notification, open, place_order, Shop};
use sqlx::SqlitePool;
use std::net::SocketAddr;
use std::path::PathBuf;

const SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
const COPIES: usize = 7;
const ORDERS: usize = 12;

/// A database file in a fresh directory under the system temp dir, removed
/// on drop.
struct TempDb {
    dir: PathBuf,
    pool: SqlitePool,
}

impl TempDb {
    async fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = open(&dir.join("shop.db")).await.unwrap();
        for i in 0..ORDERS {
            // Order i: user i % 3, (i + 1) yuan and 50 fen.
            place_order(
                &pool,
                &order_no(i),
                (i % 3) as i64,
                (i as i64 + 1) * 100 + 50,
            )
            .await
            .unwrap();
        }
        Self { dir, pool }
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn order_no(i: usize) -> String {
    format!("O-{i:04}")
}

fn transaction_id(i: usize) -> String {
    format!("42000000{i:08}")
}

/// Copy `copy` of the notification for order `i`: same id, new timestamp.
fn body(i: usize, copy: usize) -> String {
    notification(
        &format!("EV-{i:04}"),
        &order_no(i),
        &transaction_id(i),
        (i as i64 + 1) * 100 + 50,
        &format!("2026-01-01T00:00:{copy:02}+08:00"),
    )
}

async fn start(shop: Shop, with_layers: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = app(shop, with_layers);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Every order gets `COPIES` copies of its notification, all at the same
/// instant.
async fn storm(addr: SocketAddr) -> Vec<Answer> {
    let client = client();
    all_at_once(ORDERS * COPIES, |n| {
        let client = client.clone();
        let (i, copy) = (n % ORDERS, n / ORDERS);
        async move {
            post(
                &client,
                addr,
                "/notify/wechatpay",
                &[("content-type", "application/json")],
                body(i, copy),
            )
            .await
        }
    })
    .await
}

/// Checks the database: every order PAID, one ledger entry and the right
/// points per user.
async fn assert_paid_once(pool: &SqlitePool) {
    let unpaid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE status <> 'PAID'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(unpaid, 0);
    let awards: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_no, count(*) FROM points_ledger GROUP BY order_no")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(awards.len(), ORDERS, "{awards:?}");
    assert!(awards.iter().all(|(_, n)| *n == 1), "{awards:?}");
    for user in 0..3i64 {
        let points: i64 = sqlx::query_scalar("SELECT points FROM users WHERE id = ?")
            .bind(user)
            .fetch_one(pool)
            .await
            .unwrap();
        let expected: i64 = (0..ORDERS)
            .filter(|i| (*i % 3) as i64 == user)
            .map(|i| (i as i64 + 1) * 100 + 50)
            .map(|amount| amount / 100)
            .sum();
        assert_eq!(points, expected, "user {user}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layers_the_backstop_alone_awards_points_once() {
    let db = TempDb::new("no-layers").await;
    let shop = Shop::new(db.pool.clone()).await.unwrap();
    let addr = start(shop.clone(), false).await;
    let answers = storm(addr).await;
    for a in &answers {
        assert_eq!((a.status, a.text().as_str()), (200, SUCCESS));
    }
    // Every copy reached the handler and the database…
    assert_eq!(shop.handler_entries(), ORDERS * COPIES);
    // …and still each order was paid once.
    assert_paid_once(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_layers_repeats_never_reach_the_handler() {
    let db = TempDb::new("layers").await;
    let shop = Shop::new(db.pool.clone()).await.unwrap();
    let addr = start(shop.clone(), true).await;
    let answers = storm(addr).await;
    for a in &answers {
        assert_eq!((a.status, a.text().as_str()), (200, SUCCESS));
    }
    assert_eq!(
        answers.iter().filter(|a| a.replayed()).count(),
        ORDERS * (COPIES - 1)
    );
    assert_eq!(shop.handler_entries(), ORDERS, "one entry per notification");
    assert_paid_once(&db.pool).await;

    // A late retry (15 s later, in real life) is replayed too.
    let a = post(
        &client(),
        addr,
        "/notify/wechatpay",
        &[("content-type", "application/json")],
        body(0, 8),
    )
    .await;
    assert_eq!((a.status, a.text().as_str()), (200, SUCCESS));
    assert!(a.replayed());
    assert_eq!(shop.handler_entries(), ORDERS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_records_are_still_there() {
    let db = TempDb::new("restart").await;
    let first = Shop::new(db.pool.clone()).await.unwrap();
    let addr = start(first.clone(), true).await;
    storm(addr).await;
    assert_eq!(first.handler_entries(), ORDERS);

    // A new instance over the same database: the records were committed
    // with the payments, so every retry replays and none runs.
    let second = Shop::new(db.pool.clone()).await.unwrap();
    let addr = start(second.clone(), true).await;
    let answers = storm(addr).await;
    for a in &answers {
        assert_eq!((a.status, a.text().as_str()), (200, SUCCESS));
        assert!(a.replayed());
    }
    assert_eq!(second.handler_entries(), 0);
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE state = 2")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        records, ORDERS as i64,
        "one completed record per notification"
    );
    assert_paid_once(&db.pool).await;
}

/// A second notification id for a payment already made: the layers run it
/// (another key), the conditional update awards nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_notification_id_for_one_payment_awards_nothing() {
    let db = TempDb::new("second-id").await;
    let shop = Shop::new(db.pool.clone()).await.unwrap();
    let addr = start(shop.clone(), true).await;
    storm(addr).await;
    for i in 0..ORDERS {
        let other_id = notification(
            &format!("EV-OTHER-{i:04}"),
            &order_no(i),
            &transaction_id(i),
            (i as i64 + 1) * 100 + 50,
            "2026-01-01T00:01:00+08:00",
        );
        let a = post(
            &client(),
            addr,
            "/notify/wechatpay",
            &[("content-type", "application/json")],
            other_id,
        )
        .await;
        assert_eq!((a.status, a.text().as_str()), (200, SUCCESS));
        assert!(!a.replayed());
    }
    assert_eq!(shop.handler_entries(), 2 * ORDERS);
    assert_paid_once(&db.pool).await;
}
