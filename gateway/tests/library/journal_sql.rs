//! The journal in a SQL database (`Journal::connect`): the same records as
//! the redb file on SQLite, PostgreSQL and MariaDB (real servers, see
//! `tests/support_sql`), copies from two instances sharing the database
//! merged without loss, and retention pruned in bounded batches.

use test_support::support_sql;

use idempotency_gateway::journal::{
    Business, Journal, JournalEvent, JournalFilter, JournalOptions,
};
use std::time::Duration;
use tower_idempotency::Outcome;

async fn open(url: &str, options: JournalOptions) -> Journal {
    let (journal, writer) = Journal::connect(url, options).await.unwrap();
    tokio::spawn(writer);
    journal
}

/// Records, reads and filters on `url`; two journals on it (two gateway
/// instances) add copies of one key concurrently and none is lost.
async fn same_records_and_no_lost_copy(url: &str) {
    let tag = format!("{}-{}", std::process::id(), url.len());
    let a = open(url, JournalOptions::new()).await;
    let b = open(url, JournalOptions::new()).await;
    let key = format!("idem:wechatpay-v2:/notify/wx::{tag}");
    let mut business = Business::default();
    business.transaction_id = Some(format!("4200{tag}"));
    business.out_trade_no = Some("O1".into());
    business.amount_minor = Some(101);
    business.trade_state = Some("SUCCESS".into());
    a.record(
        JournalEvent::new(
            key.as_str(),
            "wechatpay-v2",
            "/notify/wx",
            Outcome::Executed,
        )
        .status(200)
        .upstream(200, Duration::from_millis(7))
        .business(business.clone())
        .body("<xml>支付0123456789</xml>".as_bytes(), 16),
    );
    a.flush().await;
    let copies = 40;
    let (ja, jb, k) = (a.clone(), b.clone(), key.clone());
    let sent = tokio::spawn(async move {
        for n in 0..copies {
            let journal = if n % 2 == 0 { &ja } else { &jb };
            journal.record(JournalEvent::new(
                k.as_str(),
                "wechatpay-v2",
                "/notify/wx",
                Outcome::Replayed,
            ));
            if n % 5 == 0 {
                journal.flush().await;
            }
        }
    });
    sent.await.unwrap();
    a.flush().await;
    b.flush().await;
    let record = b.get(&key).await.unwrap().expect("journaled");
    assert_eq!(record.copies, 1 + copies, "{record:?}");
    assert_eq!(record.outcomes["executed"], 1);
    assert_eq!(record.outcomes["replayed"], copies);
    assert_eq!(record.transaction_id, business.transaction_id);
    assert_eq!(record.amount_minor, Some(101));
    assert_eq!(record.upstream_status, Some(200));
    assert_eq!(record.body.as_deref(), Some("<xml>支付01234".as_bytes()));
    assert_eq!((record.body_bytes, record.body_truncated), (Some(27), true));

    // Filters read the same way as the redb file's.
    let other = format!("idem:stripe:/notify/stripe::{tag}");
    a.record(JournalEvent::new(
        other.as_str(),
        "stripe",
        "/notify/stripe",
        Outcome::Mismatch,
    ));
    a.flush().await;
    let mine = |f: JournalFilter| {
        let a = a.clone();
        let tag = tag.clone();
        async move {
            let found = a.query(&f).await.unwrap();
            found
                .into_iter()
                .filter(|r| r.key.ends_with(&tag))
                .map(|r| r.key)
                .collect::<Vec<_>>()
        }
    };
    let mut both = mine(JournalFilter::default()).await;
    both.sort();
    assert_eq!(both, vec![other.clone(), key.clone()]);
    assert_eq!(
        mine(JournalFilter::default().route("/notify/stripe")).await,
        vec![other.clone()]
    );
    assert_eq!(
        mine(JournalFilter::default().outcome("executed")).await,
        vec![key.clone()]
    );
    let later = record.last_seen_ms + 1;
    assert!(mine(JournalFilter::default().since_ms(later))
        .await
        .contains(&other));
    assert!(!mine(JournalFilter::default().since_ms(later))
        .await
        .contains(&key));
    assert_eq!(b.get("absent").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_the_same_records() {
    let file = support_sql::SqliteFile::new();
    same_records_and_no_lost_copy(&file.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_the_same_records() {
    let Some(db) = support_sql::shared_postgres() else {
        return;
    };
    same_records_and_no_lost_copy(db.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_keeps_the_same_records() {
    let Some(db) = support_sql::shared_mariadb() else {
        return;
    };
    same_records_and_no_lost_copy(db.url()).await;
}

/// 2,500 records past the retention (more than two batches of 1,000) are
/// all removed; a recent one stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_is_pruned_in_batches() {
    let file = support_sql::SqliteFile::new();
    let options = JournalOptions::new()
        .retention(Duration::from_secs(3600))
        .prune_every(Duration::from_millis(100));
    let journal = open(&file.url(), options).await;
    let old = now_ms() - 2 * 3600 * 1000;
    for n in 0..2500 {
        let key = format!("old-{n}");
        journal.record(JournalEvent::new(key, "stripe", "/r", Outcome::Executed).at_ms(old));
        if n % 500 == 0 {
            journal.flush().await;
        }
    }
    journal.record(JournalEvent::new(
        "recent",
        "stripe",
        "/r",
        Outcome::Executed,
    ));
    journal.flush().await;
    let all = JournalFilter::default().max_records(usize::MAX);
    let mut left = journal.query(&all).await.unwrap().len();
    for _ in 0..200 {
        if left == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = journal.query(&all).await.unwrap().len();
    }
    assert_eq!(left, 1, "the old records are pruned, the recent one stays");
    assert!(journal.get("recent").await.unwrap().is_some());
    assert!(journal.get("old-2499").await.unwrap().is_none());
}

/// A batch the database refuses every time (its table is gone) is dropped
/// and counted, never lost silently; the writer goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_cannot_be_written_is_counted() {
    let file = support_sql::SqliteFile::new();
    let journal = open(&file.url(), JournalOptions::new()).await;
    journal.record(JournalEvent::new(
        "first",
        "stripe",
        "/r",
        Outcome::Executed,
    ));
    journal.flush().await;
    assert_eq!(journal.dropped(), 0);
    let pool = sqlx::SqlitePool::connect(&file.url()).await.unwrap();
    sqlx::query("DROP TABLE idempotency_journal")
        .execute(&pool)
        .await
        .unwrap();
    for n in 0..3 {
        journal.record(JournalEvent::new(
            format!("k{n}"),
            "stripe",
            "/r",
            Outcome::Executed,
        ));
    }
    journal.flush().await;
    assert_eq!(journal.dropped(), 3, "the refused batch is counted");
    pool.close().await;
}

/// Pages of a SQL journal (`Journal::page` with its cursor) hold every
/// record once, in time order, whatever the page size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_hold_every_record_once() {
    let file = support_sql::SqliteFile::new();
    let journal = open(&file.url(), JournalOptions::new()).await;
    let t0 = now_ms() - 10_000;
    for n in 0..25_u64 {
        // Three records share each millisecond: the cursor breaks ties by key.
        let event = JournalEvent::new(format!("k{n:02}"), "stripe", "/r", Outcome::Executed);
        journal.record(event.at_ms(t0 + n / 3));
    }
    journal.flush().await;
    let mut seen = Vec::new();
    let mut filter = JournalFilter::default().max_records(4);
    loop {
        let page = journal.page(&filter).await.unwrap();
        assert!(page.records.len() <= 4);
        seen.extend(page.records.into_iter().map(|r| r.key));
        match page.next {
            Some(next) => {
                let text = next.to_string();
                filter = JournalFilter::default()
                    .max_records(4)
                    .after(text.parse().unwrap());
            }
            None => break,
        }
    }
    let want: Vec<String> = (0..25).map(|n| format!("k{n:02}")).collect();
    assert_eq!(seen, want);
    // Bounded scans: a filter that matches little still answers page by page.
    let page = journal
        .page(&JournalFilter::default().key_suffix("k24").scan(10))
        .await
        .unwrap();
    assert!(page.records.is_empty() && page.next.is_some());
}

/// Milliseconds since the Unix epoch, now.
fn now_ms() -> u64 {
    let since = std::time::UNIX_EPOCH.elapsed().unwrap();
    u64::try_from(since.as_millis()).unwrap()
}
