//! The SQL store (PostgreSQL, MariaDB, SQLite) and Redis in front of
//! PostgreSQL (`TieredStore`) against the conformance suite every store
//! passes, and what only the SQL store does. The servers are started here
//! (see `support_sql`).

use test_support::support_redis;
use test_support::support_sql;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::testing::*;
use tower_idempotency::store::{Claim, Forgotten, OwnerToken, Store};

/// Keeps whatever the store needs (a server) alive for one test.
type Guard = Option<Arc<dyn Any + Send + Sync>>;

mod sql_setup {
    use super::support_sql::{shared_mariadb, shared_postgres, SqliteFile};
    use super::*;
    use tower_idempotency_sqlx::SqlStore;

    pub(super) async fn postgres() -> Option<(SqlStore, Guard)> {
        let server = shared_postgres()?;
        let store = SqlStore::connect(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    pub(super) async fn mariadb() -> Option<(SqlStore, Guard)> {
        let server = shared_mariadb()?;
        let store = SqlStore::connect(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    /// A database file of its own per test.
    pub(super) async fn sqlite() -> Option<(SqlStore, Guard)> {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url()).await.unwrap();
        Some((store, Some(Arc::new(file))))
    }
}

/// Redis in front of PostgreSQL.
async fn tiered_redis_postgres() -> Option<(
    tower_idempotency::store::TieredStore<
        tower_idempotency_redis::RedisStore,
        tower_idempotency_sqlx::SqlStore,
    >,
    Guard,
)> {
    let redis = support_redis::shared_standalone()?;
    let front = tower_idempotency_redis::RedisStore::standalone(redis.url())
        .await
        .unwrap();
    let (back, pg) = sql_setup::postgres().await?;
    let guard: Guard = Some(Arc::new((redis, pg)));
    Some((
        tower_idempotency::store::TieredStore::new(front, back),
        guard,
    ))
}

store_tests!(tiered_redis_sql, tiered_redis_postgres);

/// The tiered store's fencing tokens are the database's: a Redis whose
/// fence counter ran ahead and was then lost (a restart without
/// persistence) changes nothing.
#[tokio::test]
async fn tiered_fences_grow_when_redis_lost_its_data() {
    let Some((store, _guard)) = tiered_redis_postgres().await else {
        return;
    };
    let key = unique_key("tiered-fence");
    let counter = format!("{{{key}}}%fence");
    let mut conn = store.front().connection().clone();
    let mut last = 0;
    for lost in [false, true, false, true] {
        let owner = OwnerToken::new();
        let got = store.claim(&key, fp("t"), owner, LEASE).await.unwrap();
        let f = fence(&got);
        assert!(f > last, "fence {f} after {last}");
        assert!(store.release(&key, owner).await.unwrap());
        // Redis's counter for the key runs far ahead, or is lost.
        let cmd = if lost {
            redis::cmd("DEL").arg(&counter).clone()
        } else {
            redis::cmd("SET")
                .arg(&counter)
                .arg("9000000000000000")
                .clone()
        };
        let _: () = cmd.query_async(&mut conn).await.unwrap();
        last = f;
    }
}
mod sql_races;
store_tests!(sql_postgres, sql_setup::postgres);
store_tests!(sql_mariadb, sql_setup::mariadb);
store_tests!(sql_sqlite, sql_setup::sqlite);

/// What only the SQL store does.
mod sql_only {
    use super::support_sql::SqliteFile;
    use super::*;
    use tower_idempotency_sqlx::SqlStore;

    async fn rows(store: &SqlStore) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
            .fetch_one(store.as_sqlite().unwrap())
            .await
            .unwrap()
    }

    /// Expired rows go in batches of the given size; live ones stay.
    #[tokio::test]
    async fn expired_rows_are_swept_in_bounded_batches() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url())
            .await
            .unwrap()
            .sweep(None, 10);
        for i in 0..25 {
            let key = unique_key(&format!("sweep-{i}"));
            let owner = OwnerToken::new();
            store
                .claim(&key, fp("s"), owner, Duration::from_millis(50))
                .await
                .unwrap();
        }
        let live = unique_key("sweep-live");
        assert_acquired(&claim(&store, &live, fp("s"), LEASE).await);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(rows(&store).await, 26);
        assert_eq!(store.sweep_expired(10).await.unwrap(), 25);
        assert_eq!(rows(&store).await, 1);
        assert_in_flight(&claim(&store, &live, fp("s"), LEASE).await, fp("s"));
        // And in the background.
        let store = store.sweep(Some(Duration::from_millis(50)), 3);
        for i in 0..7 {
            let key = unique_key(&format!("sweep-bg-{i}"));
            claim(&store, &key, fp("s"), Duration::from_millis(20)).await;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rows(&store).await > 1 {
            assert!(std::time::Instant::now() < deadline, "not swept");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Expired positions are swept with the records; live ones stay.
    #[tokio::test]
    async fn expired_positions_are_swept() {
        use tower_idempotency::store::{Advance, Position};
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url()).await.unwrap().sweep(None, 2);
        for i in 0..5 {
            let object = unique_key(&format!("sweep-position-{i}"));
            let got = store
                .advance(&object, Position::new(1, 0), Duration::from_millis(50))
                .await
                .unwrap();
            assert_eq!(got, Advance::Moved);
        }
        let live = unique_key("sweep-position-live");
        store
            .advance(&live, Position::new(7, 1), Duration::from_secs(60))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let positions = || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_positions")
                .fetch_one(store.as_sqlite().unwrap())
                .await
                .unwrap()
        };
        assert_eq!(positions().await, 6);
        assert_eq!(store.sweep_expired(2).await.unwrap(), 5);
        assert_eq!(positions().await, 1);
        assert_eq!(
            store.position(&live).await.unwrap(),
            Some(Position::new(7, 1))
        );
    }

    /// The fence outlives the row: a released claim stays (as a row of
    /// state 0) through a sweep, and a record swept after its window is
    /// followed by a larger token from the database's clock.
    #[tokio::test]
    async fn fences_grow_across_the_sweep() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url())
            .await
            .unwrap()
            .sweep(None, 10);
        let key = unique_key("fence-sweep");
        let mut last = 0;
        for _ in 0..5 {
            let owner = OwnerToken::new();
            let got = store.claim(&key, fp("s"), owner, LEASE).await.unwrap();
            let f = fence(&got);
            assert!(f > last, "fence {f} after {last}");
            assert!(store.release(&key, owner).await.unwrap());
            assert_eq!(
                store.sweep_expired(10).await.unwrap(),
                0,
                "kept with its fence"
            );
            last = f;
        }
        let owner = OwnerToken::new();
        let f = fence(&store.claim(&key, fp("s"), owner, LEASE).await.unwrap());
        assert!(f > last);
        let rec = record(fp("s"), false, false);
        assert!(store
            .complete(&key, owner, rec, Duration::from_millis(50))
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.sweep_expired(10).await.unwrap(), 1);
        assert_eq!(rows(&store).await, 0);
        let after = fence(&claim(&store, &key, fp("s"), LEASE).await);
        assert!(after > f, "after the sweep {after} after {f}");
    }

    /// Keys are bytes: no collation folds case or trailing spaces, and any
    /// byte (a NUL from a JSON `\u0000`) is stored as it is.
    #[tokio::test]
    async fn keys_are_compared_byte_for_byte() {
        let mut stores = vec![];
        let file = SqliteFile::new();
        stores.push(SqlStore::connect(&file.url()).await.unwrap());
        if let Some((s, _)) = sql_setup::mariadb().await {
            stores.push(s);
        }
        if let Some((s, _)) = sql_setup::postgres().await {
            stores.push(s);
        }
        for store in stores {
            let base = unique_key("bytes");
            for key in [
                base.clone(),
                base.to_uppercase(),
                format!("{base} "),
                format!("{base}\0x"),
                format!("{base}é"),
                format!("{base}e\u{301}"),
            ] {
                assert_acquired(&claim(&store, &key, fp("b"), LEASE).await);
            }
            assert_in_flight(&claim(&store, &base, fp("b"), LEASE).await, fp("b"));
        }
    }

    #[tokio::test]
    async fn unknown_urls_and_shared_memory_are_refused() {
        for url in ["redis://localhost/", "sqlite::memory:", "nonsense"] {
            let err = SqlStore::connect(url).await.unwrap_err();
            assert_eq!(
                err.kind(),
                tower_idempotency::store::StoreErrorKind::Unsupported,
                "{url}: {err}"
            );
        }
    }

    /// PostgreSQL: a waiter on another instance is woken by the owner's
    /// `NOTIFY`, long before its own poller (here once a second) would look.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_notify_wakes_waiters_of_other_instances() {
        let Some((owner_store, _g)) = sql_setup::postgres().await else {
            return;
        };
        let (waiter_store, _g2) = sql_setup::postgres().await.unwrap();
        let waiter_store = waiter_store.poll_interval(Duration::from_secs(1));
        for complete in [true, false] {
            let key = unique_key("notify");
            let owner = OwnerToken::new();
            owner_store
                .claim(&key, fp("n"), owner, LEASE)
                .await
                .unwrap();
            let Claim::InFlight { watch, .. } = claim(&waiter_store, &key, fp("n"), LEASE).await
            else {
                panic!("expected InFlight");
            };
            let woken = tokio::spawn(watch.changed());
            // The listener connects on the first wait.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if complete {
                let rec = record(fp("n"), false, false);
                assert!(owner_store
                    .complete(&key, owner, rec, WINDOW)
                    .await
                    .unwrap());
            } else {
                assert!(owner_store.release(&key, owner).await.unwrap());
            }
            tokio::time::timeout(Duration::from_millis(600), woken)
                .await
                .expect("woken by the NOTIFY, not the 1 s poller")
                .unwrap();
        }
    }

    /// Migrations run again (every constructor runs them) change nothing.
    #[tokio::test]
    async fn migrate_is_idempotent() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url()).await.unwrap();
        let key = unique_key("migrate");
        assert_acquired(&claim(&store, &key, fp("m"), LEASE).await);
        store.migrate().await.unwrap();
        let again = SqlStore::connect(&file.url()).await.unwrap();
        assert_in_flight(&claim(&again, &key, fp("m"), LEASE).await, fp("m"));
    }
}
