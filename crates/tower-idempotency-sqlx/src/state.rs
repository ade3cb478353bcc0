//! Moving a business row's state forward inside the handler's transaction,
//! with a version check: the state only flows one way.

use super::complete_in::SqlConnection;
use std::fmt;

/// The id of a row: text or a whole number, as the table's id column is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowId<'a> {
    /// A text id (`order_id VARCHAR`).
    Text(&'a str),
    /// A numeric id (`id BIGINT`).
    Int(i64),
}

impl<'a> From<&'a str> for RowId<'a> {
    fn from(id: &'a str) -> Self {
        Self::Text(id)
    }
}

impl<'a> From<&'a String> for RowId<'a> {
    fn from(id: &'a String) -> Self {
        Self::Text(id)
    }
}

impl From<i64> for RowId<'_> {
    fn from(id: i64) -> Self {
        Self::Int(id)
    }
}

/// What [`StateMachine::advance`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StateMove {
    /// The row moved to the new state; its version is now `version`.
    Moved {
        /// The row's version after the move.
        version: i64,
    },
    /// The row is in the new state already ("already paid: answer
    /// success"); nothing changed.
    AlreadyThere {
        /// The row's version.
        version: i64,
    },
    /// The row is in a state the move does not start from (a refund's row
    /// asked to become paid): nothing changed.
    Refused {
        /// The row's state.
        status: String,
        /// The row's version.
        version: i64,
    },
    /// No row has this id.
    Missing,
}

/// Why a [`StateMachine`] was refused: a table or column name that is not
/// a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidIdentifier(String);

impl fmt::Display for InvalidIdentifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a plain SQL identifier (letters, digits and `_`, not starting with a digit; `schema.table` for a table)",
            self.0
        )
    }
}

impl std::error::Error for InvalidIdentifier {}

/// A table whose rows' state only moves forward, and the seed's statement
/// that moves it:
///
/// ```sql
/// UPDATE orders SET status = 'paid', version = version + 1
///   WHERE id = ? AND status IN ('pending', 'paying') AND version = ?
/// ```
///
/// [`advance`](Self::advance) reads the row's state and version (locking
/// the row on PostgreSQL and MySQL: `FOR UPDATE`), answers at once when it
/// is already there or cannot move, and otherwise runs the statement with
/// the version it read; a row changed in between is read again. Run it in
/// the handler's transaction, beside
/// [`CompleteIn::complete_in`](crate::CompleteIn::complete_in), so that the
/// move, the business writes and "this notification is done" commit
/// together.
///
/// The state column is text (`VARCHAR`, `TEXT`), the version a whole number
/// (`INT`, `BIGINT`).
///
/// ```no_run
/// use tower_idempotency_sqlx::{StateMachine, StateMove};
///
/// # async fn handler(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let orders = StateMachine::new("orders")?; // columns id, status, version
/// let mut tx = pool.begin().await?;
/// match orders.advance(&mut tx, "order-42", &["pending", "paying"], "paid").await? {
///     StateMove::Moved { .. } => { /* credit the order… */ }
///     StateMove::AlreadyThere { .. } => { /* already paid: answer success */ }
///     StateMove::Refused { status, .. } => { /* closed, refunded: log it */ }
///     StateMove::Missing => { /* not ours */ }
///     _ => {}
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateMachine {
    table: String,
    id: String,
    status: String,
    version: String,
}

/// How often a move reads the row again when it changed between the read
/// and the update.
const ATTEMPTS: usize = 4;

/// A plain identifier (`schema.table` when `dotted`).
fn check(name: &str, dotted: bool) -> Result<String, InvalidIdentifier> {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 64
            && !p.as_bytes()[0].is_ascii_digit()
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    };
    let ok = if dotted {
        let mut parts = name.split('.');
        let n = name.split('.').count();
        n <= 2 && parts.all(part_ok)
    } else {
        part_ok(name)
    };
    if ok {
        Ok(name.to_owned())
    } else {
        Err(InvalidIdentifier(name.to_owned()))
    }
}

impl StateMachine {
    /// The rows of `table`, with the columns `id`, `status` and `version`.
    pub fn new(table: &str) -> Result<Self, InvalidIdentifier> {
        Ok(Self {
            table: check(table, true)?,
            id: "id".to_owned(),
            status: "status".to_owned(),
            version: "version".to_owned(),
        })
    }

    /// The same table with other column names: the row's id, its state and
    /// its version.
    pub fn with_columns(
        mut self,
        id: &str,
        status: &str,
        version: &str,
    ) -> Result<Self, InvalidIdentifier> {
        self.id = check(id, false)?;
        self.status = check(status, false)?;
        self.version = check(version, false)?;
        Ok(self)
    }

    /// Moves the row `id` to `to` if it is in one of the states `from`, with
    /// the seed's statement, on `conn` (the handler's transaction).
    pub async fn advance<'a, C: SqlConnection>(
        &self,
        conn: &mut C,
        id: impl Into<RowId<'a>>,
        from: &[&str],
        to: &str,
    ) -> Result<StateMove, sqlx::Error> {
        let id = id.into();
        for _ in 0..ATTEMPTS {
            let Some((status, version)) = conn.read_state(self, id).await? else {
                return Ok(StateMove::Missing);
            };
            if status == to {
                return Ok(StateMove::AlreadyThere { version });
            }
            if !from.contains(&status.as_str()) {
                return Ok(StateMove::Refused { status, version });
            }
            if conn.move_state(self, id, from, to, version).await? {
                return Ok(StateMove::Moved {
                    version: version + 1,
                });
            }
        }
        // Changed under every attempt: what it is now.
        Ok(match conn.read_state(self, id).await? {
            None => StateMove::Missing,
            Some((status, version)) if status == to => StateMove::AlreadyThere { version },
            Some((status, version)) => StateMove::Refused { status, version },
        })
    }

    /// `SELECT status, version … WHERE id = ?` in a dialect: `cast_text`
    /// and `cast_int` name the casts, `p1` the placeholder, `lock` the
    /// locking clause.
    pub(crate) fn select(&self, cast_text: &str, cast_int: &str, p1: &str, lock: &str) -> String {
        format!(
            "SELECT CAST({s} AS {cast_text}), CAST({v} AS {cast_int}) FROM {t} WHERE {id} = {p1}{lock}",
            s = self.status,
            v = self.version,
            t = self.table,
            id = self.id,
        )
    }

    /// The seed's `UPDATE` for `n` states to move from; `p(i)` is the
    /// dialect's `i`-th placeholder (from 1). Binds: to, id, from…, version.
    pub(crate) fn update(&self, n: usize, p: impl Fn(usize) -> String) -> String {
        let from: Vec<String> = (0..n).map(|i| p(3 + i)).collect();
        format!(
            "UPDATE {t} SET {s} = {to}, {v} = {v} + 1 WHERE {id} = {idp} AND {s} IN ({from}) AND {v} = {vp}",
            t = self.table,
            s = self.status,
            v = self.version,
            id = self.id,
            to = p(1),
            idp = p(2),
            from = from.join(", "),
            vp = p(3 + n),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_plain() {
        assert!(StateMachine::new("orders").is_ok());
        assert!(StateMachine::new("shop.orders").is_ok());
        for bad in [
            "",
            "1orders",
            "orders; DROP TABLE x",
            "a.b.c",
            "o\"rders",
            "a-b",
        ] {
            assert!(StateMachine::new(bad).is_err(), "{bad}");
        }
        let m = StateMachine::new("orders").unwrap();
        assert!(m.clone().with_columns("order_id", "state", "v").is_ok());
        assert!(m.with_columns("order_id", "state", "v 1").is_err());
    }

    #[test]
    fn the_seeds_statement() {
        let m = StateMachine::new("orders").unwrap();
        assert_eq!(
            m.update(2, |i| format!("${i}")),
            "UPDATE orders SET status = $1, version = version + 1 WHERE id = $2 AND status IN ($3, $4) AND version = $5"
        );
        assert_eq!(
            m.select("TEXT", "BIGINT", "$1", " FOR UPDATE"),
            "SELECT CAST(status AS TEXT), CAST(version AS BIGINT) FROM orders WHERE id = $1 FOR UPDATE"
        );
    }
}
