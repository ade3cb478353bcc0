//! The PostgreSQL statements. Times are milliseconds since the Unix epoch,
//! read from the database's clock, so that every instance agrees on when a
//! lease or a window ends.

use super::{CompleteArgs, CompleteInError, Row};
use sqlx::postgres::PgConnection;
use sqlx::Row as _;

/// The migrations, applied in order by `migrate()` under an advisory lock
/// (concurrent `CREATE TABLE IF NOT EXISTS` can collide in PostgreSQL).
pub(super) const MIGRATIONS: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS idempotency_records (
        idem_key     BYTEA PRIMARY KEY,
        state        INTEGER NOT NULL,
        owner_token  BYTEA,
        fence        BIGINT NOT NULL,
        lease_until  BIGINT,
        fingerprint  BYTEA,
        response     BYTEA,
        created_at   BIGINT NOT NULL,
        expires_at   BIGINT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS idempotency_records_expires
        ON idempotency_records (expires_at)",
    "CREATE TABLE IF NOT EXISTS idempotency_positions (
        object_key   BYTEA PRIMARY KEY,
        version      BIGINT NOT NULL,
        state_rank   BIGINT NOT NULL,
        advanced_by  BYTEA,
        expires_at   BIGINT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS idempotency_positions_expires
        ON idempotency_positions (expires_at)",
];

/// Serialises `migrate()` across instances (an arbitrary constant: "idem").
pub(super) const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(1768179053)";

/// The database's clock, in milliseconds.
macro_rules! now_ms {
    () => {
        "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"
    };
}

/// The database's clock, in microseconds: the floor of the fencing tokens.
macro_rules! now_us {
    () => {
        "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"
    };
}

/// `$1` key, `$2` owner, `$3` fingerprint, `$4` lease ms. Inserts an
/// absent key, takes over an expired row, or (a resent claim) extends the
/// caller's own lease; returns the fence when the caller holds the claim.
pub(super) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_records AS r
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    VALUES ($1, 1, $2, ", now_us!(), ", ", now_ms!(), " + $4, $3, NULL, ", now_ms!(), ", ", now_ms!(), " + $4)
    ON CONFLICT (idem_key) DO UPDATE SET
        state = 1,
        owner_token = EXCLUDED.owner_token,
        fence = CASE WHEN r.state = 1 AND r.owner_token = EXCLUDED.owner_token THEN r.fence
            ELSE GREATEST(r.fence + 1, EXCLUDED.fence) END,
        lease_until = EXCLUDED.lease_until,
        fingerprint = EXCLUDED.fingerprint,
        response = NULL,
        created_at = EXCLUDED.created_at,
        expires_at = EXCLUDED.expires_at
    WHERE r.expires_at <= EXCLUDED.created_at
        OR (r.state = 1 AND r.owner_token = EXCLUDED.owner_token)
    RETURNING fence"
);

/// `$1` key: the row and the milliseconds it has left.
pub(super) const READ: &str = concat!(
    "SELECT state, owner_token, fingerprint, response, expires_at - ",
    now_ms!(),
    " AS remaining, fence
    FROM idempotency_records WHERE idem_key = $1"
);

/// `$1` key: what a waiter's poller compares (no response bytes).
pub(super) const PEEK: &str = concat!(
    "SELECT state, owner_token, NULL::BYTEA AS fingerprint, NULL::BYTEA AS response,
        expires_at - ",
    now_ms!(),
    " AS remaining, fence
    FROM idempotency_records WHERE idem_key = $1"
);

/// `$1` keys (an array): what the pollers of waiters compare, for every
/// watched key at once.
pub(super) const PEEK_MANY: &str = concat!(
    "SELECT idem_key, state, owner_token, expires_at - ",
    now_ms!(),
    " AS remaining
    FROM idempotency_records WHERE idem_key = ANY($1)"
);

/// `$1` key, `$2` owner, `$3` fingerprint, `$4` encoded record, `$5`
/// window ms. The owner's claim (or an absent key: the owner's expired
/// lease was swept and nobody claimed since) becomes the completed record;
/// one row back when it did, and a `NOTIFY` on [`CHANNEL`] (delivered when
/// the transaction commits) wakes the waiters of every instance.
pub(super) const COMPLETE: &str = concat!(
    "WITH done AS (
    INSERT INTO idempotency_records AS r
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    VALUES ($1, 2, $2, 1, NULL, $3, $4, ", now_ms!(), ", ", now_ms!(), " + $5)
    ON CONFLICT (idem_key) DO UPDATE SET
        state = 2,
        lease_until = NULL,
        fingerprint = EXCLUDED.fingerprint,
        response = EXCLUDED.response,
        expires_at = EXCLUDED.expires_at
    WHERE r.state = 1 AND r.owner_token = EXCLUDED.owner_token
    RETURNING idem_key
    )
    SELECT pg_notify('idempotency_records', encode(idem_key, 'hex'))::TEXT FROM done"
);

/// `$1` key, `$2` owner, `$3` fingerprint, `$4` encoded record, `$5`
/// window ms: [`COMPLETE`] inside the handler's transaction, which changes
/// only the owner's claim (never inserts: a key without the owner's row is
/// not this layer's claim).
const COMPLETE_IN: &str = concat!(
    "WITH done AS (
    UPDATE idempotency_records SET state = 2, lease_until = NULL, fingerprint = $3,
        response = $4, expires_at = ",
    now_ms!(),
    " + $5
    WHERE idem_key = $1 AND state = 1 AND owner_token = $2
    RETURNING idem_key
    )
    SELECT pg_notify('idempotency_records', encode(idem_key, 'hex'))::TEXT FROM done"
);

/// `$1` key: whether the key has a row at all.
const EXISTS: &str = "SELECT count(*) FROM idempotency_records WHERE idem_key = $1";

/// The transaction's isolation level (`read committed`, `repeatable read`,
/// `serializable`).
const ISOLATION: &str = "SELECT current_setting('transaction_isolation')";

/// The channel of the `NOTIFY`s sent when a record completes or a claim is
/// released; the payload is the key in hex.
pub(super) const CHANNEL: &str = "idempotency_records";

/// `$1` key, `$2` owner, `$3` lease ms.
pub(super) const RENEW: &str = concat!(
    "UPDATE idempotency_records
    SET lease_until = ",
    now_ms!(),
    " + $3, expires_at = ",
    now_ms!(),
    " + $3
    WHERE idem_key = $1 AND state = 1 AND owner_token = $2"
);

/// `$1` key, `$2` fingerprint, `$3` encoded record, `$4` window ms: a
/// live completed row gets the new record (never a claim or a token).
pub(super) const REPLACE: &str = concat!(
    "UPDATE idempotency_records SET fingerprint = $2, response = $3, expires_at = ",
    now_ms!(),
    " + $4 WHERE idem_key = $1 AND state = 2 AND expires_at > ",
    now_ms!()
);

/// `$1` key: turns the completed record of the key, if its window has not
/// ended (an operator's `forget`), into a [released](super::RELEASED) row
/// that keeps the fence; never a claim or a client token.
pub(super) const FORGET: &str = concat!(
    "UPDATE idempotency_records SET ",
    released!(),
    now_ms!(),
    " WHERE idem_key = $1 AND state = 2 AND expires_at > ",
    now_ms!()
);

/// `$1` key, `$2` owner: the claim becomes a [released](super::RELEASED)
/// row that keeps the fence. One row back when it did, and a `NOTIFY` on
/// [`CHANNEL`].
pub(super) const RELEASE: &str = concat!(
    "WITH done AS (
        UPDATE idempotency_records SET ",
    released!(),
    now_ms!(),
    " WHERE idem_key = $1 AND state = 1 AND owner_token = $2
        RETURNING idem_key
    )
    SELECT pg_notify('idempotency_records', encode(idem_key, 'hex'))::TEXT FROM done"
);

/// `$1` key, `$2` ttl ms.
pub(super) const PUT_TOKEN: &str = concat!(
    "INSERT INTO idempotency_records
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    VALUES ($1, 3, NULL, 1, NULL, NULL, NULL, ", now_ms!(), ", ", now_ms!(), " + $2)
    ON CONFLICT (idem_key) DO UPDATE SET
        state = 3, owner_token = NULL, response = NULL, expires_at = EXCLUDED.expires_at"
);

/// `$1` key, `$2` the taking request's owner token.
pub(super) const TAKE_TOKEN: &str = concat!(
    "UPDATE idempotency_records SET state = 4, owner_token = $2
    WHERE idem_key = $1 AND expires_at > ",
    now_ms!(),
    "
        AND (state = 3 OR (state = 4 AND owner_token = $2))"
);

/// Whether the sweep may delete a row: its lease or window ended, and a
/// released row keeps its fence a minute longer.
macro_rules! sweepable {
    () => {
        concat!(
            "expires_at <= ",
            now_ms!(),
            " AND (state <> 0 OR expires_at <= ",
            now_ms!(),
            " - ",
            fence_keep_ms!(),
            ")"
        )
    };
}

/// `$1` batch size: deletes up to that many expired rows. The condition is
/// checked again on the row the `DELETE` deletes: under READ COMMITTED,
/// a row that a concurrent claim or completion made live after the
/// subquery chose it is re-checked against its new version by the outer
/// `WHERE` only (the subquery's result is not evaluated again). Rows
/// locked by a claim or a handler's transaction are skipped, not waited
/// for: the next sweep takes them if they are still expired.
pub(super) const SWEEP: &str = concat!(
    "DELETE FROM idempotency_records WHERE idem_key IN (
        SELECT idem_key FROM idempotency_records WHERE ",
    sweepable!(),
    " LIMIT $1 FOR UPDATE SKIP LOCKED
    ) AND ",
    sweepable!()
);

/// `$1` object, `$2` version, `$3` rank, `$4` ttl ms: the object's
/// position, if it is ahead of the one kept (or that one expired); a row
/// back when it moved. The `WHERE` is checked on the row as it is when the
/// upsert holds its lock.
pub(super) const ADVANCE: &str = concat!(
    "INSERT INTO idempotency_positions AS p (object_key, version, state_rank, expires_at)
    VALUES ($1, $2, $3, ",
    now_ms!(),
    " + $4)
    ON CONFLICT (object_key) DO UPDATE SET
        version = EXCLUDED.version,
        state_rank = EXCLUDED.state_rank,
        expires_at = EXCLUDED.expires_at
    WHERE p.expires_at <= ",
    now_ms!(),
    "
        OR (p.version, p.state_rank) < (EXCLUDED.version, EXCLUDED.state_rank)
    RETURNING 1"
);

/// `$1` object: its live position.
pub(super) const POSITION: &str = concat!(
    "SELECT version, state_rank FROM idempotency_positions
    WHERE object_key = $1 AND expires_at > ",
    now_ms!()
);

/// `$1` batch size: deletes up to that many expired positions.
pub(super) const SWEEP_POSITIONS: &str = concat!(
    "DELETE FROM idempotency_positions WHERE object_key IN (
        SELECT object_key FROM idempotency_positions WHERE expires_at <= ",
    now_ms!(),
    " LIMIT $1 FOR UPDATE SKIP LOCKED
    ) AND expires_at <= ",
    now_ms!()
);

/// Completes `op`'s record on `conn` (the store's pool, or the caller's
/// transaction).
pub(super) async fn complete(conn: &mut PgConnection, a: &CompleteArgs<'_>) -> sqlx::Result<bool> {
    let done = sqlx::query(COMPLETE)
        .bind(a.key)
        .bind(&a.owner[..])
        .bind(&a.fingerprint[..])
        .bind(a.bytes)
        .bind(a.window_ms)
        .fetch_all(conn)
        .await?;
    Ok(done.len() == 1)
}

/// Completes the record in the handler's transaction on `conn`: `Some(true)`
/// done, `Some(false)` the key is no longer the owner's, `None` the key has
/// no row here. Refuses a transaction at REPEATABLE READ or SERIALIZABLE.
pub(super) async fn complete_in(
    conn: &mut PgConnection,
    a: &CompleteArgs<'_>,
) -> Result<Option<bool>, CompleteInError> {
    let level: String = sqlx::query_scalar(ISOLATION).fetch_one(&mut *conn).await?;
    if level != "read committed" {
        return Err(CompleteInError::Isolation(level));
    }
    let done = sqlx::query(COMPLETE_IN)
        .bind(a.key)
        .bind(&a.owner[..])
        .bind(&a.fingerprint[..])
        .bind(a.bytes)
        .bind(a.window_ms)
        .fetch_all(&mut *conn)
        .await?;
    if done.len() == 1 {
        return Ok(Some(true));
    }
    let rows: i64 = sqlx::query_scalar(EXISTS)
        .bind(a.key)
        .fetch_one(&mut *conn)
        .await?;
    Ok((rows > 0).then_some(false))
}

/// Reads a row of [`READ`] or [`PEEK`].
pub(super) fn row(r: &sqlx::postgres::PgRow) -> sqlx::Result<Row> {
    Ok(Row {
        state: r.try_get(0)?,
        owner: r.try_get(1)?,
        fingerprint: r.try_get(2)?,
        response: r.try_get(3)?,
        remaining: r.try_get(4)?,
        fence: r.try_get(5)?,
    })
}
