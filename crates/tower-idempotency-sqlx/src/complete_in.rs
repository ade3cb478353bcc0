//! Completing a record inside the handler's own transaction.

#[cfg(feature = "mysql")]
use super::mysql;
#[cfg(feature = "postgres")]
use super::postgres;
#[cfg(feature = "sqlite")]
use super::sqlite;
use super::state::{RowId, StateMachine};
use super::{map_err, millis, owner_bytes, CompleteArgs};
#[cfg(feature = "mysql")]
use sqlx::mysql::MySqlConnection;
use sqlx::pool::PoolConnection;
#[cfg(feature = "postgres")]
use sqlx::postgres::PgConnection;
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqliteConnection;
use sqlx::{Database, Transaction};
use std::future::Future;
use std::pin::Pin;
use tower_idempotency_core::store::codec::encode;
use tower_idempotency_core::store::{
    ActiveClaim, CompletedRecord, StoreError, StoreErrorKind, StoredResponse,
};

mod sealed {
    pub trait Sealed {}
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a completion in the handler's transaction failed.
#[doc(hidden)]
#[derive(Debug)]
pub enum CompleteInError {
    /// The database failed.
    Sql(sqlx::Error),
    /// The transaction's isolation level, which `complete_in` refuses.
    Isolation(String),
}

impl From<sqlx::Error> for CompleteInError {
    fn from(e: sqlx::Error) -> Self {
        Self::Sql(e)
    }
}

/// What a completion in the handler's transaction found: `Some(true)` done,
/// `Some(false)` the key is no longer the owner's, `None` no row of the key.
type Completed<'a> = BoxFuture<'a, Result<Option<bool>, CompleteInError>>;

/// A connection (or transaction) to a database that a
/// [`SqlStore`](crate::SqlStore) can live in: PostgreSQL, MySQL / MariaDB
/// or SQLite, bare, pooled, or inside a [`Transaction`].
///
/// Implemented for `PgConnection` (feature `postgres`), `MySqlConnection`
/// (feature `mysql`), `SqliteConnection` (feature `sqlite`), and for a
/// [`Transaction`] or [`PoolConnection`] of one of them. Sealed.
pub trait SqlConnection: sealed::Sealed + Send {
    #[doc(hidden)]
    fn complete_record<'a>(&'a mut self, args: &'a CompleteArgs<'a>) -> Completed<'a>;
    #[doc(hidden)]
    fn read_state<'a>(&'a mut self, m: &'a StateMachine, id: RowId<'a>) -> StateRead<'a>;
    #[doc(hidden)]
    fn move_state<'a>(
        &'a mut self,
        m: &'a StateMachine,
        id: RowId<'a>,
        from: &'a [&'a str],
        to: &'a str,
        version: i64,
    ) -> BoxFuture<'a, sqlx::Result<bool>>;
}

/// A row's state and version, if the row exists.
type StateRead<'a> = BoxFuture<'a, sqlx::Result<Option<(String, i64)>>>;

/// The two statements of a [`StateMachine`] move on one database:
/// `$select` writes the read, `$p` the `i`-th placeholder.
macro_rules! state_statements {
    ($select:expr, $p:expr) => {
        fn read_state<'a>(&'a mut self, m: &'a StateMachine, id: RowId<'a>) -> StateRead<'a> {
            Box::pin(async move {
                let sql = $select(m);
                let q = sqlx::query_as::<_, (String, i64)>(&sql);
                let q = match id {
                    RowId::Text(s) => q.bind(s),
                    RowId::Int(n) => q.bind(n),
                };
                q.fetch_optional(&mut *self).await
            })
        }

        fn move_state<'a>(
            &'a mut self,
            m: &'a StateMachine,
            id: RowId<'a>,
            from: &'a [&'a str],
            to: &'a str,
            version: i64,
        ) -> BoxFuture<'a, sqlx::Result<bool>> {
            Box::pin(async move {
                let sql = m.update(from.len(), $p);
                let q = sqlx::query(&sql).bind(to);
                let mut q = match id {
                    RowId::Text(s) => q.bind(s),
                    RowId::Int(n) => q.bind(n),
                };
                for state in from {
                    q = q.bind(*state);
                }
                let done = q.bind(version).execute(&mut *self).await?;
                Ok(done.rows_affected() == 1)
            })
        }
    };
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for PgConnection {}
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl SqlConnection for PgConnection {
    fn complete_record<'a>(&'a mut self, args: &'a CompleteArgs<'a>) -> Completed<'a> {
        Box::pin(postgres::complete_in(self, args))
    }
    state_statements!(
        |m: &StateMachine| m.select("TEXT", "BIGINT", "$1", " FOR UPDATE"),
        |i| format!("${i}")
    );
}

#[cfg(feature = "mysql")]
impl sealed::Sealed for MySqlConnection {}
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl SqlConnection for MySqlConnection {
    fn complete_record<'a>(&'a mut self, args: &'a CompleteArgs<'a>) -> Completed<'a> {
        Box::pin(mysql::complete_in(self, args))
    }
    state_statements!(
        |m: &StateMachine| m.select("CHAR", "SIGNED", "?", " FOR UPDATE"),
        |_| "?".to_owned()
    );
}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for SqliteConnection {}
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl SqlConnection for SqliteConnection {
    fn complete_record<'a>(&'a mut self, args: &'a CompleteArgs<'a>) -> Completed<'a> {
        Box::pin(sqlite::complete_in(self, args))
    }
    state_statements!(
        |m: &StateMachine| m.select("TEXT", "INTEGER", "?1", ""),
        |i| format!("?{i}")
    );
}

/// A transaction or a pooled connection does what the connection under it
/// does.
macro_rules! through_the_connection {
    ($($ty:ty),*) => {$(
        impl<DB: Database> sealed::Sealed for $ty where DB::Connection: SqlConnection {}
        impl<DB: Database> SqlConnection for $ty
        where
            DB::Connection: SqlConnection,
        {
            fn complete_record<'a>(&'a mut self, args: &'a CompleteArgs<'a>) -> Completed<'a> {
                (**self).complete_record(args)
            }
            fn read_state<'a>(&'a mut self, m: &'a StateMachine, id: RowId<'a>) -> StateRead<'a> {
                (**self).read_state(m, id)
            }
            fn move_state<'a>(
                &'a mut self,
                m: &'a StateMachine,
                id: RowId<'a>,
                from: &'a [&'a str],
                to: &'a str,
                version: i64,
            ) -> BoxFuture<'a, sqlx::Result<bool>> {
                (**self).move_state(m, id, from, to, version)
            }
        }
    )*};
}

through_the_connection!(Transaction<'_, DB>, PoolConnection<DB>);

/// Completing a claim's record inside the handler's own transaction, on
/// the database of a [`SqlStore`](crate::SqlStore): a method of
/// [`ActiveClaim`] (the claim the dedup layer puts in the request's
/// extensions) once this trait is in scope.
pub trait CompleteIn {
    /// Writes this claim's completed record, replaying `response`, on
    /// `conn`: typically the handler's own transaction on the database of
    /// the [`SqlStore`](crate::SqlStore), so that the business write and the
    /// record commit together or not at all.
    ///
    /// `Ok(true)`: written (visible once the transaction commits). When the
    /// handler then answers a success, the layer checks that the record was
    /// committed (one owner-checked `UPDATE` that frees the claim if it is
    /// still in flight) and writes no record of its own; if the transaction
    /// did not commit (rolled back, or its `COMMIT` failed), the caller gets
    /// a retryable failure instead of the handler's success, the claim is
    /// released, and a consumed client token is given back.
    ///
    /// `Ok(false)`: this claim no longer owns the key (its lease ran out and
    /// another copy took it over): **roll back**, the other copy runs the
    /// work. The row stays locked until the transaction ends, so a copy that
    /// would take over waits for it.
    ///
    /// `Err`: the database failed, or the call cannot be kept:
    /// - the key has **no row** on this database: the layer's store is not
    ///   this database's [`SqlStore`](crate::SqlStore) (a memory or Redis
    ///   store, another database), or the claim's expired row was swept.
    ///   A row written here would not be the layer's record, and the next
    ///   copy would run again, so nothing is written;
    /// - PostgreSQL, a transaction at **REPEATABLE READ or SERIALIZABLE**:
    ///   the layer renews the claim's lease (an update of this row) every
    ///   lease/3 while the handler runs, and at those levels the handler's
    ///   update of a row changed since its snapshot fails with a
    ///   serialization error. Begin the transaction at READ COMMITTED (the
    ///   default).
    ///
    /// Answer with the same response: later copies replay `response`, the
    /// first copy gets what the handler returns. Give only end-to-end
    /// headers (no `Connection`, `Transfer-Encoding`).
    ///
    /// Only behind a layer whose store is this database's
    /// [`SqlStore`](crate::SqlStore), alone or as the back of a
    /// [`TieredStore`](https://docs.rs/tower-idempotency/latest/tower_idempotency/store/struct.TieredStore.html).
    ///
    /// ```no_run
    /// use bytes::Bytes;
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::store::{ActiveClaim, StoredResponse};
    /// use tower_idempotency_sqlx::CompleteIn;
    ///
    /// # #[cfg(feature = "postgres")]
    /// # async fn handler(pool: sqlx::PgPool, claim: ActiveClaim) -> Result<(), Box<dyn std::error::Error>> {
    /// let response = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::from_static(b"paid"));
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE orders SET status = 'PAID' WHERE order_no = $1")
    ///     .bind("O-1")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// if claim.complete_in(&mut tx, &response).await? {
    ///     tx.commit().await?;
    /// } else {
    ///     tx.rollback().await?; // another copy owns the key now
    /// }
    /// # Ok(()) }
    /// ```
    fn complete_in<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

impl CompleteIn for ActiveClaim {
    async fn complete_in<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let record = CompletedRecord::new(self.fingerprint(), response.clone());
        let bytes = encode(&record);
        let args = CompleteArgs {
            key: self.key().as_bytes(),
            owner: owner_bytes(self.owner()),
            fingerprint: self.fingerprint().to_bytes(),
            bytes: &bytes,
            window_ms: millis(self.window()),
        };
        match conn.complete_record(&args).await {
            Ok(Some(done)) => {
                if done {
                    self.mark_completed();
                }
                Ok(done)
            }
            Ok(None) => Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "complete_in: this database holds no claim of the key: the layer's store must be \
                 this database's SqlStore (alone or behind a TieredStore), not a memory or Redis \
                 store or another database; nothing was written, roll back",
            )),
            Err(CompleteInError::Isolation(level)) => Err(StoreError::new(
                StoreErrorKind::Unsupported,
                format!(
                    "complete_in: the transaction runs at {}: the layer's lease renewals make \
                     its write fail there; begin it at READ COMMITTED",
                    level.to_uppercase()
                ),
            )),
            Err(CompleteInError::Sql(e)) => Err(map_err("complete_in", e)),
        }
    }
}
