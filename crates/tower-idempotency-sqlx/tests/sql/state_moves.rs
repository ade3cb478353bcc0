//! `StateMachine::advance` on PostgreSQL, MariaDB and SQLite: the seed's
//! `UPDATE … WHERE status IN (…) AND version = ?` in the handler's
//! transaction, answering moved, already there, refused or missing; on
//! PostgreSQL and MariaDB, many transactions at once move a row once.

use test_support::support_sql::{shared_mariadb, shared_postgres, SqliteFile};
use tower_idempotency::store::OwnerToken;
use tower_idempotency_sqlx::{SqlStore, StateMachine, StateMove};

/// A table name no other test (or earlier run) uses.
fn table() -> String {
    format!("orders_{:x}", OwnerToken::new().as_u128() as u64)
}

macro_rules! state_tests {
    ($name:ident, $server:expr, $pool:ident, concurrent = $concurrent:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let server = $server;
            let Some((url, _guard)) = server else { return };
            let store = SqlStore::connect(&url).await.unwrap();
            let pool = store.$pool().unwrap().clone();
            let table = table();
            sqlx::query(&format!(
                "CREATE TABLE {table} (order_id VARCHAR(64) PRIMARY KEY, state VARCHAR(32) NOT NULL, v INT NOT NULL)"
            ))
            .execute(&pool)
            .await
            .unwrap();
            for (id, state, v) in [("o1", "pending", 0), ("o2", "closed", 3), ("o3", "paying", 7)] {
                sqlx::query(&format!("INSERT INTO {table} VALUES ('{id}', '{state}', {v})"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            let orders = StateMachine::new(&table)
                .unwrap()
                .with_columns("order_id", "state", "v")
                .unwrap();
            let paid = |id: &'static str| {
                let (pool, orders) = (pool.clone(), orders.clone());
                async move {
                    let mut tx = pool.begin().await.unwrap();
                    let moved = orders
                        .advance(&mut tx, id, &["pending", "paying"], "paid")
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    moved
                }
            };
            assert_eq!(paid("o1").await, StateMove::Moved { version: 1 });
            assert_eq!(paid("o1").await, StateMove::AlreadyThere { version: 1 });
            assert_eq!(
                paid("o2").await,
                StateMove::Refused { status: "closed".into(), version: 3 }
            );
            assert_eq!(paid("o9").await, StateMove::Missing);
            // A rolled-back move leaves the row as it was.
            {
                let mut tx = pool.begin().await.unwrap();
                let moved = orders
                    .advance(&mut tx, "o3", &["paying"], "paid")
                    .await
                    .unwrap();
                assert_eq!(moved, StateMove::Moved { version: 8 });
                tx.rollback().await.unwrap();
            }
            if $concurrent {
                // Eight transactions at once: one moves the row, the others
                // find it paid.
                let tasks: Vec<_> = (0..8).map(|_| tokio::spawn(paid("o3"))).collect();
                let mut moved = 0;
                for t in tasks {
                    match t.await.unwrap() {
                        StateMove::Moved { version } => {
                            assert_eq!(version, 8);
                            moved += 1;
                        }
                        StateMove::AlreadyThere { version } => assert_eq!(version, 8),
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!(moved, 1);
            } else {
                assert_eq!(paid("o3").await, StateMove::Moved { version: 8 });
            }
            let (state, v): (String, i64) = sqlx::query_as(&format!(
                "SELECT state, CAST(v AS {}) FROM {table} WHERE order_id = 'o3'",
                if stringify!($pool) == "as_mysql" { "SIGNED" } else { "BIGINT" }
            ))
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!((state.as_str(), v), ("paid", 8));
        }
    };
}

state_tests!(
    postgres_moves_a_rows_state_once,
    shared_postgres().map(|s| (s.url().to_owned(), s)),
    as_postgres,
    concurrent = true
);
state_tests!(
    mariadb_moves_a_rows_state_once,
    shared_mariadb().map(|s| (s.url().to_owned(), s)),
    as_mysql,
    concurrent = true
);
state_tests!(
    sqlite_moves_a_rows_state_once,
    {
        let file = SqliteFile::new();
        Some((file.url(), file))
    },
    as_sqlite,
    concurrent = false
);
