//! Redis Streams queue: a reclaimed entry counts an attempt, consumer
//! names do not pile up across restarts, and `replicas` holds the
//! acknowledgement until replicas have the entry. Each test starts its own
//! `redis-server` (skipped when none is installed).

use test_support::support_redis;

use std::time::Duration;
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{Ingested, Message, Queue, RedisStreamsQueue, SharedPacing};

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

/// A dead consumer's expired entries are reclaimed within about one lease
/// by small fetches, however many live entries (renewed, so not expired)
/// are pending ahead of them: Redis scans at most ten times `COUNT`
/// pending entries per `XAUTOCLAIM`, so the scan must go on from where the
/// last one stopped.
#[tokio::test]
async fn expired_entries_behind_live_ones_are_reclaimed_by_small_fetches() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let open = || RedisStreamsQueue::standalone(url.as_str(), "q");
    let (live, dead, other) = (
        open().await.unwrap(),
        open().await.unwrap(),
        open().await.unwrap(),
    );
    let lease = Duration::from_millis(400);
    for n in 1..=30 {
        live.ingest(message(&format!("k{n:02}"))).await.unwrap();
    }
    let held = live.fetch(30, lease).await.unwrap();
    assert_eq!(held.len(), 30);
    for n in 31..=40 {
        dead.ingest(message(&format!("k{n:02}"))).await.unwrap();
    }
    assert_eq!(dead.fetch(10, lease).await.unwrap().len(), 10);
    // The dead consumer never comes back; the live one renews its entries
    // every quarter lease while another instance fetches 1, 2 or 3 at a
    // time, for two leases past the dead one's expiry.
    let mut reclaimed = std::collections::BTreeSet::new();
    let until = tokio::time::Instant::now() + lease * 3;
    let mut round = 0;
    while tokio::time::Instant::now() < until {
        for d in &held {
            assert!(live.renew(d, lease).await.unwrap());
        }
        let got = other.fetch(round % 3 + 1, lease).await.unwrap();
        round += 1;
        for d in got {
            assert!(
                d.message.key.as_str() > "k30",
                "a live, renewed entry was reclaimed: {}",
                d.message.key
            );
            reclaimed.insert(d.message.key.clone());
        }
        tokio::time::sleep(lease / 4).await;
    }
    let want: std::collections::BTreeSet<String> = (31..=40).map(|n| format!("k{n:02}")).collect();
    assert_eq!(reclaimed, want, "reclaimed after {round} fetches");
}

/// A lane's shared slots live as long as the longest lease taken: a slot
/// taken with a short lease does not expire one taken with a long lease.
#[tokio::test]
async fn a_short_slot_lease_does_not_expire_a_longer_one() {
    if !support_redis::redis_available() {
        return eprintln!("skipped: no redis-server");
    }
    let redis = support_redis::RedisServer::start();
    let queue = RedisStreamsQueue::standalone(redis.url().as_str(), "q")
        .await
        .unwrap();
    let (long, short) = (Duration::from_secs(30), Duration::from_millis(100));
    assert!(queue.take_slot("/a", 2, long).await.unwrap().is_some());
    assert!(queue.take_slot("/a", 2, short).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The short one ran out: one place again, not two.
    assert!(queue.take_slot("/a", 2, long).await.unwrap().is_some());
    assert_eq!(
        queue.take_slot("/a", 2, long).await.unwrap(),
        None,
        "the slot held for 30 s was forgotten with the set"
    );
}
