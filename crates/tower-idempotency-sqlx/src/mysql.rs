//! The MySQL / MariaDB statements. Times are milliseconds since the Unix
//! epoch, read from the database's clock.
//!
//! MySQL has neither `RETURNING` nor a `WHERE` on `ON DUPLICATE KEY
//! UPDATE`: the claim makes every assignment conditional (the condition's
//! own columns assigned last, so that it reads the old row throughout) and
//! reads the row back when the affected-row count leaves it open. Placeholders
//! are positional: each statement lists its bind order.

use super::{CompleteArgs, CompleteInError, Row};
use sqlx::mysql::MySqlConnection;
use sqlx::Row as _;

/// The migrations, applied in order by `migrate()`. Keys are binary (no
/// collation folds two keys into one); a stored key is at most 644 bytes.
pub(super) const MIGRATIONS: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS idempotency_records (
        idem_key     VARBINARY(1024) NOT NULL PRIMARY KEY,
        state        INT NOT NULL,
        owner_token  VARBINARY(16) NULL,
        fence        BIGINT NOT NULL,
        lease_until  BIGINT NULL,
        fingerprint  VARBINARY(16) NULL,
        response     LONGBLOB NULL,
        created_at   BIGINT NOT NULL,
        expires_at   BIGINT NOT NULL,
        INDEX idempotency_records_expires (expires_at)
    ) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS idempotency_positions (
        object_key   VARBINARY(1024) NOT NULL PRIMARY KEY,
        version      BIGINT NOT NULL,
        state_rank   BIGINT NOT NULL,
        advanced_by  VARBINARY(16) NULL,
        expires_at   BIGINT NOT NULL,
        INDEX idempotency_positions_expires (expires_at)
    ) ENGINE = InnoDB",
];

/// The database's clock, in milliseconds since the Unix epoch, whatever
/// the session's time zone: `UTC_TIMESTAMP` is the UTC wall clock, and the
/// difference of two zone-free datetimes never steps.
/// (`UNIX_TIMESTAMP(NOW())` reads `NOW()` in the session's zone: in a zone
/// with summer time, the hour that repeats in the autumn maps to the first
/// pass, so the clock jumps back an hour.)
macro_rules! now_ms {
    () => {
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)"
    };
}

/// The database's clock, in microseconds: the floor of the fencing tokens.
macro_rules! now_us {
    () => {
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED)"
    };
}

/// Whether the claim may take the existing row: it expired, or it is the
/// caller's own claim (a resent call).
macro_rules! takes {
    () => {
        "(expires_at <= VALUES(created_at) OR (state = 1 AND owner_token = VALUES(owner_token)))"
    };
}

/// Binds: key, owner, lease ms, fingerprint, lease ms. Affected rows: 1
/// inserted (or, with `CLIENT_FOUND_ROWS`, left as it was), 2 taken over.
pub(super) const CLAIM: &str = concat!(
    "INSERT INTO idempotency_records
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    VALUES (?, 1, ?, ", now_us!(), ", ", now_ms!(), " + ?, ?, NULL, ", now_ms!(), ", ", now_ms!(), " + ?)
    ON DUPLICATE KEY UPDATE
        fence = IF(", takes!(), ", IF(state = 1 AND owner_token = VALUES(owner_token), fence,
            GREATEST(fence + 1, VALUES(fence))), fence),
        fingerprint = IF(", takes!(), ", VALUES(fingerprint), fingerprint),
        response = IF(", takes!(), ", NULL, response),
        created_at = IF(", takes!(), ", VALUES(created_at), created_at),
        lease_until = IF(", takes!(), ", VALUES(lease_until), lease_until),
        state = IF(", takes!(), ", 1, state),
        owner_token = IF(", takes!(), ", VALUES(owner_token), owner_token),
        expires_at = IF(", takes!(), ", VALUES(expires_at), expires_at)"
);

/// Binds: key.
pub(super) const READ: &str = concat!(
    "SELECT state, owner_token, fingerprint, response, expires_at - ",
    now_ms!(),
    " AS remaining, fence
    FROM idempotency_records WHERE idem_key = ?"
);

/// Binds: key. What a waiter's poller compares (no response bytes).
pub(super) const PEEK: &str = concat!(
    "SELECT state, owner_token, NULL AS fingerprint, NULL AS response,
        expires_at - ",
    now_ms!(),
    " AS remaining, fence
    FROM idempotency_records WHERE idem_key = ?"
);

/// What the pollers of waiters compare, for many keys at once: followed by
/// `(…)`, a placeholder per key.
pub(super) const PEEK_MANY: &str = concat!(
    "SELECT idem_key, state, owner_token, expires_at - ",
    now_ms!(),
    " AS remaining
    FROM idempotency_records WHERE idem_key IN"
);

/// Binds: fingerprint, record, window ms, key, owner.
const COMPLETE: &str = concat!(
    "UPDATE idempotency_records
    SET state = 2, lease_until = NULL, fingerprint = ?, response = ?, expires_at = ",
    now_ms!(),
    " + ?
    WHERE idem_key = ? AND state = 1 AND owner_token = ?"
);

/// Binds: key, owner, fingerprint, record, window ms, key. The owner's
/// expired claim was swept and nobody claimed since: the record is written
/// anyway (a concurrent claim wins: duplicate key).
const COMPLETE_ABSENT: &str = concat!(
    "INSERT INTO idempotency_records
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    SELECT ?, 2, ?, 1, NULL, ?, ?, ", now_ms!(), ", ", now_ms!(), " + ? FROM DUAL
    WHERE NOT EXISTS (SELECT 1 FROM idempotency_records WHERE idem_key = ?)"
);

/// Binds: key. Whether the key has a row at all.
const EXISTS: &str = "SELECT count(*) FROM idempotency_records WHERE idem_key = ?";

/// Binds: lease ms, lease ms, key, owner.
pub(super) const RENEW: &str = concat!(
    "UPDATE idempotency_records
    SET lease_until = ",
    now_ms!(),
    " + ?, expires_at = ",
    now_ms!(),
    " + ?
    WHERE idem_key = ? AND state = 1 AND owner_token = ?"
);

/// Binds: fingerprint, encoded record, window ms, key: a live completed
/// row gets the new record (never a claim or a token).
pub(super) const REPLACE: &str = concat!(
    "UPDATE idempotency_records SET fingerprint = ?, response = ?, expires_at = ",
    now_ms!(),
    " + ? WHERE idem_key = ? AND state = 2 AND expires_at > ",
    now_ms!()
);

/// Binds: key. Turns the completed record of the key, if its window has
/// not ended (an operator's `forget`), into a [released](super::RELEASED)
/// row that keeps the fence; never a claim or a client token.
pub(super) const FORGET: &str = concat!(
    "UPDATE idempotency_records SET ",
    released!(),
    now_ms!(),
    " WHERE idem_key = ? AND state = 2 AND expires_at > ",
    now_ms!()
);

/// Binds: key, owner. The claim becomes a [released](super::RELEASED) row
/// that keeps the fence.
pub(super) const RELEASE: &str = concat!(
    "UPDATE idempotency_records SET ",
    released!(),
    now_ms!(),
    " WHERE idem_key = ? AND state = 1 AND owner_token = ?"
);

/// Binds: key, ttl ms.
pub(super) const PUT_TOKEN: &str = concat!(
    "INSERT INTO idempotency_records
        (idem_key, state, owner_token, fence, lease_until, fingerprint, response, created_at, expires_at)
    VALUES (?, 3, NULL, 1, NULL, NULL, NULL, ", now_ms!(), ", ", now_ms!(), " + ?)
    ON DUPLICATE KEY UPDATE
        state = 3, owner_token = NULL, response = NULL, expires_at = VALUES(expires_at)"
);

/// Binds: owner, key, owner. Affected rows count matched rows
/// (`CLIENT_FOUND_ROWS`), so a resent take answers 1 again.
pub(super) const TAKE_TOKEN: &str = concat!(
    "UPDATE idempotency_records SET state = 4, owner_token = ?
    WHERE idem_key = ? AND expires_at > ",
    now_ms!(),
    "
        AND (state = 3 OR (state = 4 AND owner_token = ?))"
);

/// Binds: batch size.
pub(super) const SWEEP: &str = concat!(
    "DELETE FROM idempotency_records WHERE expires_at <= ",
    now_ms!(),
    " AND (state <> 0 OR expires_at <= ",
    now_ms!(),
    " - ",
    fence_keep_ms!(),
    ") LIMIT ?"
);

/// Binds: object, version, rank, advance token, ttl ms. The object's
/// position, if it is ahead of the one kept (or that one expired). MySQL
/// has no `WHERE` here and reads assigned columns anew: the condition is
/// judged once, on the old row, by the first assignment (the call's own
/// token into `advanced_by`), and the others follow the token. Read the
/// row back ([`ADVANCED`]) in the same transaction, which holds its lock.
pub(super) const ADVANCE: &str =
    concat!(
    "INSERT INTO idempotency_positions (object_key, version, state_rank, advanced_by, expires_at)
    VALUES (?, ?, ?, ?, ", now_ms!(), " + ?)
    ON DUPLICATE KEY UPDATE
        advanced_by = IF(expires_at <= ", now_ms!(), "
            OR (version, state_rank) < (VALUES(version), VALUES(state_rank)),
            VALUES(advanced_by), advanced_by),
        version = IF(advanced_by <=> VALUES(advanced_by), VALUES(version), version),
        state_rank = IF(advanced_by <=> VALUES(advanced_by), VALUES(state_rank), state_rank),
        expires_at = IF(advanced_by <=> VALUES(advanced_by), VALUES(expires_at), expires_at)"
);

/// Binds: object. The row [`ADVANCE`] left, in its transaction.
pub(super) const ADVANCED: &str =
    "SELECT advanced_by, version, state_rank FROM idempotency_positions WHERE object_key = ?";

/// Binds: object. Its live position.
pub(super) const POSITION: &str = concat!(
    "SELECT version, state_rank FROM idempotency_positions
    WHERE object_key = ? AND expires_at > ",
    now_ms!()
);

/// Binds: batch size. Deletes up to that many expired positions.
pub(super) const SWEEP_POSITIONS: &str = concat!(
    "DELETE FROM idempotency_positions WHERE expires_at <= ",
    now_ms!(),
    " LIMIT ?"
);

/// Completes the record on `conn` (the store's pool, or the caller's
/// transaction): an update of the owner's claim, or, when the row is gone,
/// an insert.
pub(super) async fn complete(
    conn: &mut MySqlConnection,
    a: &CompleteArgs<'_>,
) -> sqlx::Result<bool> {
    let done = sqlx::query(COMPLETE)
        .bind(&a.fingerprint[..])
        .bind(a.bytes)
        .bind(a.window_ms)
        .bind(a.key)
        .bind(&a.owner[..])
        .execute(&mut *conn)
        .await?
        .rows_affected();
    if done == 1 {
        return Ok(true);
    }
    let inserted = sqlx::query(COMPLETE_ABSENT)
        .bind(a.key)
        .bind(&a.owner[..])
        .bind(&a.fingerprint[..])
        .bind(a.bytes)
        .bind(a.window_ms)
        .bind(a.key)
        .execute(&mut *conn)
        .await;
    match inserted {
        Ok(r) => Ok(r.rows_affected() == 1),
        // Claimed meanwhile by someone else.
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Completes the record in the handler's transaction on `conn`: the
/// owner's claim only (never an insert). `Some(true)` done, `Some(false)`
/// the key is no longer the owner's, `None` the key has no row here.
pub(super) async fn complete_in(
    conn: &mut MySqlConnection,
    a: &CompleteArgs<'_>,
) -> Result<Option<bool>, CompleteInError> {
    let done = sqlx::query(COMPLETE)
        .bind(&a.fingerprint[..])
        .bind(a.bytes)
        .bind(a.window_ms)
        .bind(a.key)
        .bind(&a.owner[..])
        .execute(&mut *conn)
        .await?
        .rows_affected();
    if done == 1 {
        return Ok(Some(true));
    }
    let rows: i64 = sqlx::query_scalar(EXISTS)
        .bind(a.key)
        .fetch_one(&mut *conn)
        .await?;
    Ok((rows > 0).then_some(false))
}

/// Reads a row of [`READ`] or [`PEEK`].
pub(super) fn row(r: &sqlx::mysql::MySqlRow) -> sqlx::Result<Row> {
    Ok(Row {
        state: r.try_get(0)?,
        owner: r.try_get(1)?,
        fingerprint: r.try_get(2)?,
        response: r.try_get(3)?,
        remaining: r.try_get(4)?,
        fence: r.try_get(5)?,
    })
}
