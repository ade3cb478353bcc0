//! The [`Store`] operations of [`SqlStore`].

#[cfg(feature = "mysql")]
use super::mysql;
#[cfg(feature = "postgres")]
use super::postgres;
#[cfg(feature = "sqlite")]
use super::sqlite;
use super::{
    corrupt, map_err, millis, owner_bytes, CompleteArgs, Pool, Row, SqlStore, COMPLETED, IN_FLIGHT,
    RELEASED,
};
use bytes::Bytes;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency_core::store::codec::{decode, encode};
use tower_idempotency_core::store::{
    Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Ownership, Position, RecordState,
    Store, StoreError, StoreErrorKind, Watch,
};
use tower_idempotency_core::Fingerprint;

/// How often a claim tries again when the row changed between its two
/// statements (deleted, or expired, in between).
const CLAIM_ATTEMPTS: usize = 4;

/// Runs `f` again after a deadlock or serialization failure (concurrent
/// upserts of one key in InnoDB can deadlock; the database rolls one back).
pub(super) async fn retrying<T, F, Fut>(mut f: F) -> sqlx::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = sqlx::Result<T>>,
{
    let mut attempt = 0;
    loop {
        match f().await {
            Err(sqlx::Error::Database(e))
                if attempt < 5 && matches!(e.code().as_deref(), Some("40001" | "40P01")) =>
            {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(2 << attempt)).await;
            }
            other => return other,
        }
    }
}

impl SqlStore {
    /// Reads the row of `key` (`peek`: without the response bytes).
    pub(super) async fn read(&self, key: &[u8], peek: bool) -> sqlx::Result<Option<Row>> {
        read(&self.pool, key, peek).await
    }
}

pub(super) async fn read(pool: &Pool, key: &[u8], peek: bool) -> sqlx::Result<Option<Row>> {
    match *pool {
        #[cfg(feature = "postgres")]
        Pool::Postgres(ref p) => {
            let stmt = if peek { postgres::PEEK } else { postgres::READ };
            let r = sqlx::query(stmt).bind(key).fetch_optional(p).await?;
            r.as_ref().map(postgres::row).transpose()
        }
        #[cfg(feature = "mysql")]
        Pool::MySql(ref p) => {
            let stmt = if peek { mysql::PEEK } else { mysql::READ };
            let r = sqlx::query(stmt).bind(key).fetch_optional(p).await?;
            r.as_ref().map(mysql::row).transpose()
        }
        #[cfg(feature = "sqlite")]
        Pool::Sqlite(ref p) => {
            let stmt = if peek { sqlite::PEEK } else { sqlite::READ };
            let r = sqlx::query(stmt).bind(key).fetch_optional(p).await?;
            r.as_ref().map(sqlite::row).transpose()
        }
    }
}

/// A fence as the table keeps it (`BIGINT`, never negative).
fn fence_of(fence: i64) -> u64 {
    u64::try_from(fence).unwrap_or(0)
}

fn owner_of(row: &Row) -> Result<[u8; 16], StoreError> {
    row.owner
        .as_deref()
        .and_then(|o| <[u8; 16]>::try_from(o).ok())
        .ok_or_else(|| corrupt("in-flight row without a 16-byte owner token"))
}

impl Store for SqlStore {
    /// One upsert whose `WHERE` compares the kept position (MySQL: an
    /// upsert whose assignments compare it, and a read of the row it
    /// locked, in one transaction); when refused, one read of the position
    /// that refused it.
    async fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> Result<Advance, StoreError> {
        super::positions::advance(&self.pool, object.as_bytes(), position, ttl)
            .await
            .map_err(|e| map_err("advance", e))
    }

    /// One read; the time to live is the database's clock's.
    async fn position(&self, object: &str) -> Result<Option<Position>, StoreError> {
        super::positions::read(&self.pool, object.as_bytes())
            .await
            .map_err(|e| map_err("position", e))
    }

    /// One read; the lease and the window are the database's clock's.
    async fn inspect(&self, key: &str) -> Result<RecordState, StoreError> {
        let row = self
            .read(key.as_bytes(), false)
            .await
            .map_err(|e| map_err("inspect", e))?;
        let Some(row) = row.filter(|r| r.remaining > 0) else {
            return Ok(RecordState::Absent);
        };
        let left = Duration::from_millis(u64::try_from(row.remaining).unwrap_or(0));
        match row.state {
            IN_FLIGHT => {
                let fp = row
                    .fingerprint
                    .as_deref()
                    .and_then(|f| <[u8; 16]>::try_from(f).ok())
                    .ok_or_else(|| corrupt("in-flight row without a fingerprint"))?;
                Ok(RecordState::InFlight {
                    fingerprint: Fingerprint::from_bytes(fp),
                    age: None,
                    lease_left: left,
                })
            }
            COMPLETED => {
                let bytes = row
                    .response
                    .ok_or_else(|| corrupt("completed row without a response"))?;
                Ok(RecordState::Completed {
                    record: Arc::new(decode(&Bytes::from(bytes))?),
                    left,
                })
            }
            // A client token, not a record.
            _ => Ok(RecordState::Absent),
        }
    }

    /// One conditional `UPDATE` of the completed row (it becomes a
    /// released row that keeps its fence); when it changes nothing, one
    /// read tells an in-flight key from an absent one. A record completed
    /// between the two (the owner's completion racing this call) is
    /// forgotten in turn, never answered `Absent`.
    async fn forget(&self, key: &str) -> Result<Forgotten, StoreError> {
        let k = key.as_bytes();
        let err = |e| map_err("forget", e);
        for _ in 0..CLAIM_ATTEMPTS {
            let deleted = match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => sqlx::query(postgres::FORGET)
                    .bind(k)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => sqlx::query(mysql::FORGET)
                    .bind(k)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlx::query(sqlite::FORGET)
                    .bind(k)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
            }
            .map_err(err)?;
            if deleted > 0 {
                return Ok(Forgotten::Deleted);
            }
            match self.read(k, true).await.map_err(err)? {
                Some(r) if r.state == IN_FLIGHT && r.remaining > 0 => {
                    return Ok(Forgotten::InFlight)
                }
                // Completed since the update looked: forget it now.
                Some(r) if r.state == COMPLETED && r.remaining > 0 => continue,
                _ => return Ok(Forgotten::Absent),
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Backend,
            "sql forget: the row kept changing under the call",
        ))
    }

    /// One conditional `UPDATE`: a live completed row gets the new record
    /// and window; a claim, a token or no row is left alone (`false`).
    async fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let k = key.as_bytes();
        let bytes = encode(&record);
        let fp = record.fingerprint.to_bytes();
        let ms = millis(window);
        let changed = retrying(|| async {
            match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => sqlx::query(postgres::REPLACE)
                    .bind(k)
                    .bind(&fp[..])
                    .bind(&bytes[..])
                    .bind(ms)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => sqlx::query(mysql::REPLACE)
                    .bind(&fp[..])
                    .bind(&bytes[..])
                    .bind(ms)
                    .bind(k)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlx::query(sqlite::REPLACE)
                    .bind(k)
                    .bind(&fp[..])
                    .bind(&bytes[..])
                    .bind(ms)
                    .execute(p)
                    .await
                    .map(|r| r.rows_affected()),
            }
        })
        .await
        .map_err(|e| map_err("replace", e))?;
        Ok(changed > 0)
    }

    /// The statements run in a task of their own. A caller that gives up
    /// (the layer's store timeout) does not stop a statement the server
    /// already runs: it may still commit the claim, after the layer's
    /// release found nothing to release. So the task itself releases a
    /// claim that it won for a caller that is gone, after the claim.
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, true).await
    }

    /// As [`claim`](Self::claim); a key in flight starts no poller.
    async fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, false).await
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let bytes = encode(&record);
        let args = CompleteArgs {
            key: key.as_bytes(),
            owner: owner_bytes(token),
            fingerprint: record.fingerprint.to_bytes(),
            bytes: &bytes,
            window_ms: millis(window),
        };
        let err = |e| map_err("complete", e);
        let done = retrying(|| async {
            match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => postgres::complete(&mut *p.acquire().await?, &args).await,
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => mysql::complete(&mut *p.acquire().await?, &args).await,
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlite::complete(&mut *p.acquire().await?, &args).await,
            }
        })
        .await
        .map_err(err)?;
        if done {
            self.wake_local_waiters(key.as_bytes());
        }
        Ok(done)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (k, owner, ms) = (key.as_bytes(), owner_bytes(token), millis(lease));
        let n = retrying(|| async {
            Ok(match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => {
                    let q = sqlx::query(postgres::RENEW).bind(k).bind(&owner[..]);
                    q.bind(ms).execute(p).await?.rows_affected()
                }
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => {
                    let q = sqlx::query(sqlite::RENEW).bind(k).bind(&owner[..]);
                    q.bind(ms).execute(p).await?.rows_affected()
                }
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => {
                    let q = sqlx::query(mysql::RENEW).bind(ms).bind(ms).bind(k);
                    q.bind(&owner[..]).execute(p).await?.rows_affected()
                }
            })
        })
        .await
        .map_err(|e| map_err("renew", e))?;
        Ok(n == 1)
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        let (k, owner) = (key.as_bytes(), owner_bytes(token));
        let n = retrying(|| async {
            Ok(match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => sqlx::query(postgres::RELEASE)
                    .bind(k)
                    .bind(&owner[..])
                    .fetch_all(p)
                    .await?
                    .len() as u64,
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlx::query(sqlite::RELEASE)
                    .bind(k)
                    .bind(&owner[..])
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => sqlx::query(mysql::RELEASE)
                    .bind(k)
                    .bind(&owner[..])
                    .execute(p)
                    .await?
                    .rows_affected(),
            })
        })
        .await
        .map_err(|e| map_err("release", e))?;
        if n == 1 {
            self.wake_local_waiters(k);
        }
        Ok(n == 1)
    }

    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        let (k, ms) = (key.as_bytes(), millis(ttl));
        retrying(|| async {
            match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => sqlx::query(postgres::PUT_TOKEN)
                    .bind(k)
                    .bind(ms)
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlx::query(sqlite::PUT_TOKEN)
                    .bind(k)
                    .bind(ms)
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => sqlx::query(mysql::PUT_TOKEN)
                    .bind(k)
                    .bind(ms)
                    .execute(p)
                    .await?
                    .rows_affected(),
            };
            Ok(())
        })
        .await
        .map_err(|e| map_err("put_token", e))
    }

    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        let (k, o) = (key.as_bytes(), owner_bytes(owner));
        let n = retrying(|| async {
            Ok(match self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(ref p) => sqlx::query(postgres::TAKE_TOKEN)
                    .bind(k)
                    .bind(&o[..])
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(ref p) => sqlx::query(sqlite::TAKE_TOKEN)
                    .bind(k)
                    .bind(&o[..])
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "mysql")]
                Pool::MySql(ref p) => sqlx::query(mysql::TAKE_TOKEN)
                    .bind(&o[..])
                    .bind(k)
                    .bind(&o[..])
                    .execute(p)
                    .await?
                    .rows_affected(),
            })
        })
        .await
        .map_err(|e| map_err("take_token", e))?;
        Ok(n == 1)
    }
}

impl SqlStore {
    /// A claim (`watched`: a key in flight gets this instance's shared
    /// poller), its statements in a task of their own (see
    /// [`claim`](Store::claim)).
    async fn claim_in(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
        watched: bool,
    ) -> Result<Claim, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self
                .claim_now(key, fingerprint, token, lease, watched)
                .await;
        }
        /// Tells the task that its caller is gone.
        struct Gone(Arc<AtomicBool>);
        impl Drop for Gone {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let gone = Arc::new(AtomicBool::new(false));
        let _caller = Gone(gone.clone());
        let (store, key) = (self.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            if gone.load(Ordering::Acquire) {
                return Err(StoreError::new(
                    StoreErrorKind::Backend,
                    "sql claim: the caller gave up",
                ));
            }
            let claim = store
                .claim_now(&key, fingerprint, token, lease, watched)
                .await;
            if gone.load(Ordering::Acquire) && matches!(claim, Ok(Claim::Acquired(_))) {
                // Nobody will run it: free the key now, not after the lease.
                let _ = store.release(&key, token).await;
            }
            claim
        });
        match task.await {
            Ok(claim) => claim,
            Err(e) => Err(StoreError::new(
                StoreErrorKind::Backend,
                format!("sql claim: the task failed: {e}"),
            )),
        }
    }

    /// One claim, in the caller's task.
    async fn claim_now(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
        watched: bool,
    ) -> Result<Claim, StoreError> {
        let k = key.as_bytes();
        let owner = owner_bytes(token);
        let fp = fingerprint.to_bytes();
        let lease_ms = millis(lease);
        let err = |e| map_err("claim", e);
        for _ in 0..CLAIM_ATTEMPTS {
            // The fence when the statement won the key (PostgreSQL, SQLite:
            // `RETURNING`); MySQL says only how many rows changed, so its
            // winner reads the row below like everybody else.
            let acquired: Option<i64> = retrying(|| async {
                Ok(match self.pool {
                    #[cfg(feature = "postgres")]
                    Pool::Postgres(ref p) => {
                        sqlx::query_scalar(postgres::CLAIM)
                            .bind(k)
                            .bind(&owner[..])
                            .bind(&fp[..])
                            .bind(lease_ms)
                            .fetch_optional(p)
                            .await?
                    }
                    #[cfg(feature = "sqlite")]
                    Pool::Sqlite(ref p) => {
                        sqlx::query_scalar(sqlite::CLAIM)
                            .bind(k)
                            .bind(&owner[..])
                            .bind(&fp[..])
                            .bind(lease_ms)
                            .fetch_optional(p)
                            .await?
                    }
                    // 2: taken over; 1: inserted, or left alone. Either way
                    // the read tells (its owner is the caller's when it won).
                    #[cfg(feature = "mysql")]
                    Pool::MySql(ref p) => {
                        sqlx::query(mysql::CLAIM)
                            .bind(k)
                            .bind(&owner[..])
                            .bind(lease_ms)
                            .bind(&fp[..])
                            .bind(lease_ms)
                            .execute(p)
                            .await?;
                        None
                    }
                })
            })
            .await
            .map_err(err)?;
            if let Some(fence) = acquired {
                return Ok(Claim::Acquired(Ownership::new(token, fence_of(fence))));
            }
            let Some(row) = self.read(k, false).await.map_err(err)? else {
                continue; // released or swept in between: claim again
            };
            if row.remaining <= 0 {
                continue; // expired in between: take it over
            }
            match row.state {
                // Released or forgotten (seen so only by a clock that went
                // back since): free, claim again.
                RELEASED => continue,
                IN_FLIGHT => {
                    let running = owner_of(&row)?;
                    if running == owner {
                        return Ok(Claim::Acquired(Ownership::new(token, fence_of(row.fence))));
                    }
                    let fp = row
                        .fingerprint
                        .as_deref()
                        .and_then(|f| <[u8; 16]>::try_from(f).ok())
                        .ok_or_else(|| corrupt("in-flight row without a fingerprint"))?;
                    return Ok(Claim::InFlight {
                        fingerprint: Fingerprint::from_bytes(fp),
                        watch: match watched {
                            true => self.watch(k.to_vec(), running),
                            false => Watch::poll(self.poll_interval),
                        },
                    });
                }
                COMPLETED => {
                    let bytes = row
                        .response
                        .ok_or_else(|| corrupt("completed row without a response"))?;
                    return Ok(Claim::Completed(Arc::new(decode(&Bytes::from(bytes))?)));
                }
                other => {
                    return Err(corrupt(format_args!(
                        "a row of state {other} under a claimed key (a client token?)"
                    )))
                }
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Backend,
            "sql claim: the row kept changing under the claim",
        ))
    }
}
