//! The Redis stores (standalone, with a key prefix, a 3-master Cluster, and
//! picked at run time in an `Either`) against the conformance suite every
//! store passes, and what only Redis does. The servers are started here
//! (see `support_redis`).

use test_support::support_redis;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::testing::*;
use tower_idempotency::store::{Claim, MemoryStore, OwnerToken, Store};

/// Keeps whatever the store needs (a server) alive for one test.
type Guard = Option<Arc<dyn Any + Send + Sync>>;

mod redis_setup {
    use super::support_redis::{shared_cluster, shared_standalone};
    use super::*;
    use tower_idempotency_redis::{RedisClusterStore, RedisStore};

    pub(super) async fn standalone() -> Option<(RedisStore, Guard)> {
        let server = shared_standalone()?;
        let store = RedisStore::standalone(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    pub(super) async fn cluster() -> Option<(RedisClusterStore, Guard)> {
        let cluster = shared_cluster()?;
        let store = RedisStore::cluster(cluster.urls()).await.unwrap();
        Some((store, Some(cluster)))
    }

    /// Memory or Redis picked at run time: here Redis.
    pub(super) async fn either() -> Option<(
        tower_idempotency::store::Either<MemoryStore, RedisStore>,
        Guard,
    )> {
        let (store, guard) = standalone().await?;
        Some((tower_idempotency::store::Either::Right(store), guard))
    }

    /// Standalone with a key prefix: the same cases hold.
    pub(super) async fn prefixed() -> Option<(RedisStore, Guard)> {
        let (store, guard) = standalone().await?;
        Some((store.key_prefix("tenant-a:"), guard))
    }
}

use redis_setup::standalone as redis_standalone_setup;
use redis_setup::{cluster as redis_cluster_setup, prefixed as redis_prefixed_setup};

store_tests!(redis_standalone, redis_standalone_setup);
store_tests!(redis_prefixed, redis_prefixed_setup);
store_tests!(redis_cluster, redis_cluster_setup);
store_tests!(either_redis, redis_setup::either);

/// What only the Redis store does.
mod redis_only {
    use super::support_redis::{
        self, redis_available, shared_cluster, shared_standalone, RedisServer,
    };
    use super::*;
    use tower_idempotency::store::StoreErrorKind;
    use tower_idempotency_redis::RedisStore;

    #[tokio::test]
    async fn complete_after_lease_ran_out_unclaimed_still_records() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let key = unique_key("late-complete");
        let owner = OwnerToken::new();
        store
            .claim(&key, fp("l"), owner, Duration::from_millis(100))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        let rec = record(fp("l"), false, true);
        assert!(store
            .complete(&key, owner, rec.clone(), WINDOW)
            .await
            .unwrap());
        assert_same(&completed(claim(&store, &key, fp("l"), LEASE).await), &rec);
    }

    /// Claims until the store has counted `want` data losses (5 s at most).
    async fn until_losses(store: &RedisStore, want: u64) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store.data_loss_events() < want && std::time::Instant::now() < deadline {
            // Errors while a server restarts are expected; the look goes on.
            let _ = store
                .claim(&unique_key("epoch"), fp("e"), OwnerToken::new(), LEASE)
                .await;
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        store.data_loss_events()
    }

    #[tokio::test]
    async fn a_redis_that_lost_its_data_is_noticed() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let port = server.port();
        let store = RedisStore::standalone(server.url())
            .await
            .unwrap()
            .epoch_check_interval(Some(Duration::from_millis(50)));
        // First use writes the marker; nothing lost yet.
        assert_eq!(until_losses(&store, 1).await, 0);
        let marker = |port| support_redis::raw_command(port, "GET idem:epoch").unwrap();
        assert!(!marker(port).starts_with("$-1"), "no marker written");
        // FLUSHALL is noticed, and the marker written again.
        assert!(support_redis::raw_command(port, "FLUSHALL")
            .unwrap()
            .starts_with("+OK"));
        assert_eq!(until_losses(&store, 1).await, 1, "FLUSHALL not noticed");
        assert!(!marker(port).starts_with("$-1"), "marker not rewritten");
        // A restart that kept the data set is not a loss...
        server.stop();
        server.restart();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            until_losses(&store, 2).await,
            1,
            "a kept data set is no loss"
        );
        // ...a restart without persistence is.
        server.stop_without_saving();
        server.restart();
        assert_eq!(until_losses(&store, 2).await, 2, "restart not noticed");
        // And a healthy server counts nothing more.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(until_losses(&store, 3).await, 2);
    }

    #[tokio::test]
    async fn take_token_deletes_only_tokens() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let key = unique_key("not-a-token");
        let owner = OwnerToken::new();
        store.claim(&key, fp("t"), owner, LEASE).await.unwrap();
        assert!(!store.take_token(&key, OwnerToken::new()).await.unwrap());
        assert_in_flight(&claim(&store, &key, fp("t"), LEASE).await, fp("t"));
    }

    #[tokio::test]
    async fn key_prefix_is_applied() {
        let Some(server) = shared_standalone() else {
            return;
        };
        let store = RedisStore::standalone(server.url())
            .await
            .unwrap()
            .key_prefix("shop:");
        let key = unique_key("prefix");
        assert_acquired(&claim(&store, &key, fp("p"), LEASE).await);
        let mut conn = store.connection().clone();
        let exists: (bool, bool) = redis::pipe()
            .exists(format!("shop:{key}"))
            .exists(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, (true, false));
        // Client text cannot choose a Cluster hash tag.
        let braces = format!("{key}:{{tag}}%");
        assert_acquired(&claim(&store, &braces, fp("p"), LEASE).await);
        let stored: bool = redis::cmd("EXISTS")
            .arg(format!("shop:{key}:%7Btag%7D%25"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(stored);
        assert_in_flight(&claim(&store, &braces, fp("q"), LEASE).await, fp("p"));
        // Ttl of the claim is the lease.
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("shop:{key}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 29_000 && ttl <= 30_000, "pttl {ttl}");
    }

    #[tokio::test]
    async fn foreign_values_are_corrupt() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let mut conn = store.connection().clone();
        for junk in [&b"hello"[..], &[0xF1, 1, 2][..], &[1, 2, 3][..]] {
            let key = unique_key("junk");
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(junk)
                .query_async(&mut conn)
                .await
                .unwrap();
            let err = store
                .claim(&key, fp("j"), OwnerToken::new(), LEASE)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{err}");
        }
        // A key of another type is a backend error, not a panic.
        let key = unique_key("hash");
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("f")
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
        let err = store
            .claim(&key, fp("j"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Backend, "{err}");
    }

    #[tokio::test]
    async fn a_paused_server_times_out_and_recovers() {
        if !redis_available() {
            return;
        }
        // Its own server: the pause would stall every other test.
        let server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("pause");
        assert_acquired(&claim(&store, &key, fp("t"), LEASE).await);
        let reply =
            super::support_redis::raw_command(server.port(), "CLIENT PAUSE 1500 ALL").unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
        let err = store
            .claim(&key, fp("t"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Timeout, "{err}");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_in_flight(&claim(&store, &key, fp("t"), LEASE).await, fp("t"));
    }

    #[tokio::test]
    async fn a_cancelled_claim_leaves_no_orphan() {
        if !redis_available() {
            return;
        }
        let server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("cancelled");
        // Warm the script cache, so the claim below is one EVALSHA.
        assert_acquired(&claim(&store, &unique_key("warm"), fp("w"), LEASE).await);
        let reply =
            super::support_redis::raw_command(server.port(), "CLIENT PAUSE 500 ALL").unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
        // The layer's store timeout gives up while the server holds the claim
        // back; the server runs it afterwards.
        let cancelled = tokio::time::timeout(
            Duration::from_millis(100),
            store.claim(&key, fp("c"), OwnerToken::new(), LEASE),
        )
        .await;
        assert!(cancelled.is_err(), "the claim was not cancelled");
        tokio::time::sleep(Duration::from_millis(700)).await;
        // Nobody owns that claim: it was released, not left for the lease.
        assert_acquired(&claim(&store, &key, fp("c"), LEASE).await);
    }

    #[tokio::test]
    async fn a_restarted_server_is_reconnected() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("restart");
        let owner = OwnerToken::new();
        store.claim(&key, fp("s"), owner, LEASE).await.unwrap();
        server.stop();
        let err = store
            .claim(&key, fp("s"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_ne!(err.kind(), StoreErrorKind::Corrupt, "{err}");
        server.restart();
        // The first command after the restart may still meet the old
        // connection; the next ones succeed.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let claim = loop {
            match store.claim(&key, fp("s"), OwnerToken::new(), LEASE).await {
                Ok(claim) => break claim,
                Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // SHUTDOWN SAVE kept the claim.
        assert_in_flight(&claim, fp("s"));
        assert!(store.release(&key, owner).await.unwrap());
    }

    #[tokio::test]
    async fn a_long_outage_fails_fast_and_recovers() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("outage");
        assert_acquired(&claim(&store, &key, fp("o"), LEASE).await);
        server.stop();
        // Longer than the connection's reconnect budget; every call fails
        // well within the layer's one-second store timeout.
        let down = std::time::Instant::now();
        while down.elapsed() < Duration::from_secs(4) {
            let start = std::time::Instant::now();
            let err = store
                .claim(&key, fp("o"), OwnerToken::new(), LEASE)
                .await
                .unwrap_err();
            assert_ne!(err.kind(), StoreErrorKind::Corrupt, "{err}");
            assert!(start.elapsed() < Duration::from_millis(900), "{err}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        server.restart();
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            match store.claim(&key, fp("o"), OwnerToken::new(), LEASE).await {
                Ok(claim) => break assert_in_flight(&claim, fp("o")),
                Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn cluster_spreads_keys_over_every_master() {
        let Some(cluster) = shared_cluster() else {
            return;
        };
        let store = RedisStore::cluster(cluster.urls()).await.unwrap();
        let mut owners = Vec::new();
        for i in 0..60 {
            let key = unique_key(&format!("spread-{i}"));
            let owner = OwnerToken::new();
            let got = store.claim(&key, fp("c"), owner, LEASE).await.unwrap();
            assert!(matches!(got, Claim::Acquired(_)));
            owners.push((key, owner));
        }
        for node in cluster.nodes() {
            let reply = super::support_redis::raw_command(node.port(), "DBSIZE").unwrap();
            let n: i64 = reply.trim().trim_start_matches(':').parse().unwrap();
            assert!(n > 0, "node {} holds no key", node.port());
        }
        for (key, owner) in owners {
            assert!(store.release(&key, owner).await.unwrap());
        }
    }
}
