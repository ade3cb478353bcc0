//! The fencing recipe of the README on real databases (PostgreSQL started
//! by `support_sql`, and SQLite): a stale owner, whose lease ran out while
//! it still worked, and the newer owner that took the key over both write
//! the business row with
//! `UPDATE … SET …, fence = :token WHERE id = :id AND fence < :token`.
//! Whatever the order of their writes, the newer owner's write is the one
//! that stays; a stale write after the newer one affects no row, and one
//! before it is overwritten (and, made in one transaction with
//! `complete_in`, rolled back).

use test_support::support_sql;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use std::time::Duration;
use support_sql::{shared_postgres, SqliteFile};
use tower_idempotency::store::{ActiveClaim, Claim, OwnerToken, Ownership, Store, StoredResponse};
use tower_idempotency::Fingerprint;
use tower_idempotency_sqlx::{CompleteIn, SqlStore};

/// Which owner writes first.
#[derive(Debug, Clone, Copy)]
enum Order {
    NewerFirst,
    StaleFirst,
}

/// The business table of one database, and its statements.
struct Orders {
    store: SqlStore,
    table: String,
}

impl Orders {
    async fn new(store: SqlStore) -> Self {
        let table = format!("orders_{:x}", OwnerToken::new().as_u128() as u64);
        let this = Self { store, table };
        this.exec(&format!(
            "CREATE TABLE {} (id TEXT PRIMARY KEY, state TEXT NOT NULL, fence BIGINT NOT NULL)",
            this.table
        ))
        .await;
        this
    }

    async fn exec(&self, sql: &str) -> u64 {
        if let Some(pool) = self.store.as_postgres() {
            sqlx::query(sql)
                .execute(pool)
                .await
                .unwrap()
                .rows_affected()
        } else {
            let pool = self.store.as_sqlite().unwrap();
            sqlx::query(sql)
                .execute(pool)
                .await
                .unwrap()
                .rows_affected()
        }
    }

    /// The recipe: the write of the owner holding `token`.
    fn update(&self, id: &str, state: &str, token: u64) -> String {
        format!(
            "UPDATE {} SET state = '{state}', fence = {token} WHERE id = '{id}' AND fence < {token}",
            self.table
        )
    }

    async fn write(&self, id: &str, state: &str, token: u64) -> u64 {
        self.exec(&self.update(id, state, token)).await
    }

    async fn row(&self, id: &str) -> (String, i64) {
        let sql = format!("SELECT state, fence FROM {} WHERE id = '{id}'", self.table);
        if let Some(pool) = self.store.as_postgres() {
            sqlx::query_as(&sql).fetch_one(pool).await.unwrap()
        } else {
            sqlx::query_as(&sql)
                .fetch_one(self.store.as_sqlite().unwrap())
                .await
                .unwrap()
        }
    }

    /// A stale owner (its lease ran out) and the newer owner that took the
    /// key over, with their tokens.
    async fn two_owners(&self, key: &str) -> (Ownership, Ownership) {
        let fp = Fingerprint::of(b"order");
        let claim = |owner, lease| self.store.claim(key, fp, owner, lease);
        let Claim::Acquired(stale) = claim(OwnerToken::new(), Duration::from_millis(200))
            .await
            .unwrap()
        else {
            panic!("the first claim wins");
        };
        tokio::time::sleep(Duration::from_millis(350)).await;
        let Claim::Acquired(newer) = claim(OwnerToken::new(), Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("the lease ran out: the key is taken over");
        };
        assert!(newer.fence > stale.fence, "{newer:?} after {stale:?}");
        (stale, newer)
    }
}

async fn the_newer_owner_wins(store: SqlStore) {
    let orders = Orders::new(store).await;
    for order in [Order::NewerFirst, Order::StaleFirst] {
        let id = format!("{order:?}");
        let key = format!("idem:fencing:{:x}", OwnerToken::new().as_u128());
        assert_eq!(
            orders
                .exec(&format!(
                    "INSERT INTO {} (id, state, fence) VALUES ('{id}', 'new', 0)",
                    orders.table
                ))
                .await,
            1
        );
        let (stale, newer) = orders.two_owners(&key).await;
        match order {
            Order::NewerFirst => {
                assert_eq!(orders.write(&id, "newer", newer.fence).await, 1);
                assert_eq!(
                    orders.write(&id, "stale", stale.fence).await,
                    0,
                    "the stale write after the newer one is refused"
                );
            }
            Order::StaleFirst => {
                // Nothing newer has written yet: the stale write lands...
                assert_eq!(orders.write(&id, "stale", stale.fence).await, 1);
                // ...and the newer owner's overwrites it.
                assert_eq!(orders.write(&id, "newer", newer.fence).await, 1);
                // A second stale write (a retry of its own) is refused.
                assert_eq!(orders.write(&id, "stale", stale.fence).await, 0);
            }
        }
        let (state, fence) = orders.row(&id).await;
        assert_eq!(state, "newer", "{order:?}");
        assert_eq!(u64::try_from(fence).unwrap(), newer.fence, "{order:?}");
    }
}

/// A stale owner that writes in one transaction with `complete_in` finds
/// out that it lost the key, and rolls its write back: nothing of it stays,
/// even before the newer owner wrote.
async fn a_stale_transaction_rolls_back(store: SqlStore) {
    let orders = Orders::new(store.clone()).await;
    let id = "in-tx";
    orders
        .exec(&format!(
            "INSERT INTO {} (id, state, fence) VALUES ('{id}', 'new', 0)",
            orders.table
        ))
        .await;
    let key = format!("idem:fencing:{:x}", OwnerToken::new().as_u128());
    let (stale, newer) = orders.two_owners(&key).await;
    let claim = ActiveClaim::new(
        key.as_str().into(),
        stale.owner,
        Fingerprint::of(b"order"),
        Duration::from_secs(60),
    )
    .with_fence(stale.fence);
    assert_eq!(claim.fence(), stale.fence);
    let response = StoredResponse::new(
        StatusCode::OK,
        HeaderMap::new(),
        Bytes::from_static(b"paid"),
    );
    let sql = orders.update(id, "stale", claim.fence());
    let completed = if let Some(pool) = store.as_postgres() {
        let mut tx = pool.begin().await.unwrap();
        assert_eq!(
            sqlx::query(&sql)
                .execute(&mut *tx)
                .await
                .unwrap()
                .rows_affected(),
            1
        );
        let done = claim.complete_in(&mut tx, &response).await.unwrap();
        tx.rollback().await.unwrap();
        done
    } else {
        let mut tx = store.as_sqlite().unwrap().begin().await.unwrap();
        assert_eq!(
            sqlx::query(&sql)
                .execute(&mut *tx)
                .await
                .unwrap()
                .rows_affected(),
            1
        );
        let done = claim.complete_in(&mut tx, &response).await.unwrap();
        tx.rollback().await.unwrap();
        done
    };
    assert!(!completed, "the stale owner no longer owns the key");
    assert_eq!(orders.row(id).await, ("new".to_owned(), 0));
    assert_eq!(orders.write(id, "newer", newer.fence).await, 1);
    assert_eq!(orders.row(id).await.0, "newer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_newer_owner_wins() {
    let Some(pg) = shared_postgres() else {
        return;
    };
    let store = SqlStore::connect(pg.url()).await.unwrap();
    the_newer_owner_wins(store.clone()).await;
    a_stale_transaction_rolls_back(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_newer_owner_wins() {
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    the_newer_owner_wins(store.clone()).await;
    a_stale_transaction_rolls_back(store).await;
}
