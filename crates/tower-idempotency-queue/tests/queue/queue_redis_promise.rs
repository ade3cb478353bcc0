//! Redis Streams queue: a reclaimed entry counts an attempt, consumer
//! names do not pile up across restarts, and `replicas` holds the
//! acknowledgement until replicas have the entry. Each test starts its own
//! `redis-server` (skipped when none is installed).

use test_support::support_redis;

use std::time::Duration;
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{Ingested, Message, Queue, RedisStreamsQueue};

fn message(key: &str) -> Message {
    Message::new(key, Fingerprint::of(key.as_bytes()), "body")
}

#[tokio::test]
async fn a_reclaimed_entry_counts_an_attempt() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let redis = support_redis::RedisServer::start();
    let queue = RedisStreamsQueue::standalone(redis.url().as_str(), "q")
        .await
        .unwrap();
    queue.ingest(message("k")).await.unwrap();
    let lease = Duration::from_millis(100);
    let first = queue.fetch(10, lease).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].attempt, 1);
    // The worker died: never settled. Each reclaim is one more attempt.
    for attempt in 2..=3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let again = queue.fetch(10, lease).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].attempt, attempt);
    }
}

#[tokio::test]
async fn consumers_of_earlier_runs_do_not_pile_up() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let redis = support_redis::RedisServer::start();
    for _ in 0..5 {
        // One run: it joins, reads (nothing due) and exits.
        let queue = RedisStreamsQueue::standalone(redis.url().as_str(), "q")
            .await
            .unwrap();
        queue.fetch(10, Duration::from_secs(30)).await.unwrap();
    }
    let client = redis::Client::open(redis.url().as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let consumers: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg("{q}:s")
        .arg("workers")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        consumers.len() <= 1,
        "{} consumers: {consumers:?}",
        consumers.len()
    );
}

#[tokio::test]
async fn replicas_hold_the_acknowledgement_until_they_have_the_entry() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let redis = support_redis::RedisServer::start();
    let queue = RedisStreamsQueue::standalone(redis.url().as_str(), "q")
        .await
        .unwrap();
    let got = queue.clone().replicas(1).ingest(message("k")).await;
    assert!(got.is_err(), "no replica holds it: {got:?}");
    // Stored on the master all the same: the channel's retry is a
    // duplicate, acknowledged without replicas.
    let got = queue.ingest(message("k")).await.unwrap();
    assert_eq!(got, Ingested::Duplicate);
}

/// With `replicas`, a duplicate is acknowledged only once the replicas hold
/// the entry that another instance queued: the duplicate's own `WAIT` must
/// cover that entry, not only this connection's earlier writes. Here the
/// replica is stopped (SIGSTOP) after the queue connected: the entry
/// written by the other instance is on the master alone.
#[tokio::test]
async fn a_duplicate_waits_for_the_replicas_to_hold_the_entry() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let master = support_redis::RedisServer::start();
    let replica = support_redis::RedisServer::start();
    let of = format!("REPLICAOF 127.0.0.1 {}", master.port());
    assert!(support_redis::raw_command(replica.port(), &of)
        .unwrap()
        .starts_with("+OK"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !support_redis::raw_command(replica.port(), "INFO replication")
        .unwrap()
        .contains("master_link_status:up")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never synced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let other = RedisStreamsQueue::standalone(master.url().as_str(), "q")
        .await
        .unwrap();
    let here = RedisStreamsQueue::standalone(master.url().as_str(), "q")
        .await
        .unwrap()
        .replicas(1);
    // Both are set up, and replicated.
    assert!(here.ingest(message("warm")).await.is_ok());
    let pid = replica.pid().unwrap().to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    signal("-STOP");
    let queued = other.ingest(message("k")).await;
    let duplicate = here.ingest(message("k")).await;
    signal("-CONT");
    assert!(matches!(queued, Ok(Ingested::Queued(_))), "{queued:?}");
    assert!(
        duplicate.is_err(),
        "a duplicate was acknowledged while no replica held the entry: {duplicate:?}"
    );
}
