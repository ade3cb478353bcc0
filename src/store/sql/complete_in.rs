//! Completing a record inside the handler's own transaction.

use super::ops::owner_bytes;
use super::{map_err, millis, mysql, postgres, sqlite, CompleteArgs};
use crate::store::codec::encode;
use crate::store::{ActiveClaim, CompletedRecord, StoreError, StoredResponse};
use sqlx::mysql::MySqlConnection;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Database, Transaction};
use std::future::Future;
use std::pin::Pin;

mod sealed {
    pub trait Sealed {}
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A connection (or transaction) to a database that a
/// [`SqlStore`](super::SqlStore) can live in: PostgreSQL, MySQL / MariaDB
/// or SQLite, bare, pooled, or inside a [`Transaction`].
///
/// Implemented for `PgConnection`, `MySqlConnection`, `SqliteConnection`,
/// and for a [`Transaction`] or [`PoolConnection`] of one of them. Sealed.
pub trait SqlConnection: sealed::Sealed + Send {
    #[doc(hidden)]
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>>;
}

impl sealed::Sealed for PgConnection {}
impl SqlConnection for PgConnection {
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>> {
        Box::pin(postgres::complete(self, args))
    }
}

impl sealed::Sealed for MySqlConnection {}
impl SqlConnection for MySqlConnection {
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>> {
        Box::pin(mysql::complete(self, args))
    }
}

impl sealed::Sealed for SqliteConnection {}
impl SqlConnection for SqliteConnection {
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>> {
        Box::pin(sqlite::complete(self, args))
    }
}

impl<DB: Database> sealed::Sealed for Transaction<'_, DB> where DB::Connection: SqlConnection {}
impl<DB: Database> SqlConnection for Transaction<'_, DB>
where
    DB::Connection: SqlConnection,
{
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>> {
        (**self).complete_record(args)
    }
}

impl<DB: Database> sealed::Sealed for PoolConnection<DB> where DB::Connection: SqlConnection {}
impl<DB: Database> SqlConnection for PoolConnection<DB>
where
    DB::Connection: SqlConnection,
{
    fn complete_record<'a>(
        &'a mut self,
        args: &'a CompleteArgs<'a>,
    ) -> BoxFuture<'a, sqlx::Result<bool>> {
        (**self).complete_record(args)
    }
}

impl ActiveClaim {
    /// Writes this claim's completed record, replaying `response`, on
    /// `conn`: typically the handler's own transaction on the database of
    /// the [`SqlStore`](super::SqlStore), so that the business write and the
    /// record commit together or not at all.
    ///
    /// `Ok(true)`: written (visible once the transaction commits); the dedup
    /// layer then writes no record of its own for this call. `Ok(false)`:
    /// this claim no longer owns the key (its lease ran out and another
    /// copy took it over): **roll back**, the other copy runs the work.
    /// The row stays locked until the transaction ends, so a copy that
    /// would take over waits for it.
    ///
    /// Answer with the same response: later copies replay `response`, the
    /// first copy gets what the handler returns. Give only end-to-end
    /// headers (no `Connection`, `Transfer-Encoding`).
    ///
    /// **Only behind a layer whose store is this database's
    /// [`SqlStore`](super::SqlStore)** (alone, or as the back of a
    /// [`TieredStore`](crate::store::TieredStore)): the layer trusts the
    /// handler's record and writes none of its own, so with a memory or
    /// Redis store the record would be lost and the next copy would run
    /// again.
    ///
    /// ```no_run
    /// use bytes::Bytes;
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::store::{ActiveClaim, StoredResponse};
    ///
    /// # async fn handler(pool: sqlx::PgPool, claim: ActiveClaim) -> Result<(), Box<dyn std::error::Error>> {
    /// let response = StoredResponse {
    ///     status: StatusCode::OK,
    ///     headers: HeaderMap::new(),
    ///     body: Bytes::from_static(b"paid"),
    ///     trailers: None,
    ///     body_omitted: false,
    /// };
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
    pub async fn complete_in<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let record = CompletedRecord {
            fingerprint: self.fingerprint(),
            response: response.clone(),
        };
        let bytes = encode(&record);
        let args = CompleteArgs {
            key: self.key().as_bytes(),
            owner: owner_bytes(self.owner()),
            fingerprint: self.fingerprint().to_bytes(),
            bytes: &bytes,
            window_ms: millis(self.window()),
        };
        let done = conn
            .complete_record(&args)
            .await
            .map_err(|e| map_err("complete_in", e))?;
        if done {
            self.mark_completed();
        }
        Ok(done)
    }
}
