//! Objects' positions: one compare-and-set statement per advance, in the
//! table `idempotency_positions`, beside the records.

#[cfg(feature = "mysql")]
use super::mysql;
#[cfg(feature = "postgres")]
use super::postgres;
#[cfg(feature = "sqlite")]
use super::sqlite;
use super::{millis, Pool};
use sqlx::Row as _;
use std::time::Duration;
#[cfg(feature = "mysql")]
use tower_idempotency_core::store::OwnerToken;
use tower_idempotency_core::store::{Advance, Position};

/// How often an advance looks again when it was refused and the position
/// that refused it expired before it could be read.
const ATTEMPTS: usize = 3;

/// A position as the table keeps it.
fn position_of(version: i64, rank: i64) -> Position {
    Position::new(version, u32::try_from(rank).unwrap_or(u32::MAX))
}

/// The statement for `position`: moved, or refused (`None`, then read).
async fn try_advance(
    pool: &Pool,
    object: &[u8],
    position: Position,
    ttl: Duration,
) -> sqlx::Result<Result<(), Option<Position>>> {
    let (version, rank, ttl) = (position.version(), i64::from(position.rank()), millis(ttl));
    let moved = match *pool {
        #[cfg(feature = "postgres")]
        Pool::Postgres(ref p) => sqlx::query(postgres::ADVANCE)
            .bind(object)
            .bind(version)
            .bind(rank)
            .bind(ttl)
            .fetch_optional(p)
            .await?
            .is_some(),
        #[cfg(feature = "sqlite")]
        Pool::Sqlite(ref p) => sqlx::query(sqlite::ADVANCE)
            .bind(object)
            .bind(version)
            .bind(rank)
            .bind(ttl)
            .fetch_optional(p)
            .await?
            .is_some(),
        #[cfg(feature = "mysql")]
        Pool::MySql(ref p) => {
            let token = OwnerToken::new().as_u128().to_be_bytes();
            let mut tx = p.begin().await?;
            sqlx::query(mysql::ADVANCE)
                .bind(object)
                .bind(version)
                .bind(rank)
                .bind(&token[..])
                .bind(ttl)
                .execute(&mut *tx)
                .await?;
            // The upsert holds the row's lock until the commit: this reads
            // what it left.
            let row = sqlx::query(mysql::ADVANCED)
                .bind(object)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            let by: Option<Vec<u8>> = row.try_get(0)?;
            if by.as_deref() == Some(&token[..]) {
                return Ok(Ok(()));
            }
            return Ok(Err(Some(position_of(row.try_get(1)?, row.try_get(2)?))));
        }
    };
    if moved {
        return Ok(Ok(()));
    }
    Ok(Err(read(pool, object).await?))
}

/// See [`Store::advance`](tower_idempotency_core::store::Store::advance).
pub(super) async fn advance(
    pool: &Pool,
    object: &[u8],
    position: Position,
    ttl: Duration,
) -> sqlx::Result<Advance> {
    for _ in 0..ATTEMPTS {
        match super::ops::retrying(|| try_advance(pool, object, position, ttl)).await? {
            Ok(()) => return Ok(Advance::Moved),
            Err(Some(at)) => return Ok(Advance::Behind(at)),
            // Refused by a position that expired before the read: again.
            Err(None) => {}
        }
    }
    // A position that keeps expiring as it is read: at least the one given.
    Ok(Advance::Behind(position))
}

/// The live position of `object`.
pub(super) async fn read(pool: &Pool, object: &[u8]) -> sqlx::Result<Option<Position>> {
    let row = match *pool {
        #[cfg(feature = "postgres")]
        Pool::Postgres(ref p) => sqlx::query(postgres::POSITION)
            .bind(object)
            .fetch_optional(p)
            .await?
            .map(|r| Ok::<_, sqlx::Error>((r.try_get(0)?, r.try_get(1)?)))
            .transpose()?,
        #[cfg(feature = "mysql")]
        Pool::MySql(ref p) => sqlx::query(mysql::POSITION)
            .bind(object)
            .fetch_optional(p)
            .await?
            .map(|r| Ok::<_, sqlx::Error>((r.try_get(0)?, r.try_get(1)?)))
            .transpose()?,
        #[cfg(feature = "sqlite")]
        Pool::Sqlite(ref p) => sqlx::query(sqlite::POSITION)
            .bind(object)
            .fetch_optional(p)
            .await?
            .map(|r| Ok::<_, sqlx::Error>((r.try_get(0)?, r.try_get(1)?)))
            .transpose()?,
    };
    Ok(row.map(|(version, rank)| position_of(version, rank)))
}

/// Deletes up to `batch` expired positions; how many.
pub(super) async fn sweep(pool: &Pool, batch: u32) -> sqlx::Result<u64> {
    let batch = i64::from(batch);
    Ok(match *pool {
        #[cfg(feature = "postgres")]
        Pool::Postgres(ref p) => sqlx::query(postgres::SWEEP_POSITIONS)
            .bind(batch)
            .execute(p)
            .await?
            .rows_affected(),
        #[cfg(feature = "mysql")]
        Pool::MySql(ref p) => sqlx::query(mysql::SWEEP_POSITIONS)
            .bind(batch)
            .execute(p)
            .await?
            .rows_affected(),
        #[cfg(feature = "sqlite")]
        Pool::Sqlite(ref p) => sqlx::query(sqlite::SWEEP_POSITIONS)
            .bind(batch)
            .execute(p)
            .await?
            .rows_affected(),
    })
}
