//! What every backend writes the same way: its errors, and the times it
//! stores (milliseconds since the Unix epoch).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Defines a backend's two errors (`, $vis`: visible that far), their
/// messages starting with `$name`:
/// `err(e)`, an error of what it runs on (its server, client or database),
/// kept as the source, its kind read from it; and `fail(kind, why)`, a
/// failure of the queue's own, of `kind`. Both fit `map_err` and
/// `ok_or_else` as they are.
macro_rules! backend_errors {
    ($name:literal $(, $vis:vis)?) => {
        /// An error of what this queue runs on, kept as the source.
        $($vis)? fn err(e: impl ::std::error::Error + Send + Sync + 'static) -> $crate::QueueError {
            $crate::QueueError::backend($name, e)
        }

        /// A failure of this queue's own, of `kind`.
        $($vis)? fn fail(
            kind: $crate::QueueErrorKind,
            why: impl ::std::fmt::Display,
        ) -> $crate::QueueError {
            $crate::QueueError::new(kind, format!(concat!($name, ": {}"), why))
        }
    };
}
pub(crate) use backend_errors;

/// Now, in milliseconds since the Unix epoch (the unit of every stored time).
pub(crate) fn now_ms() -> u64 {
    ms_of(SystemTime::now())
}

/// `t` in milliseconds since the Unix epoch (0 before it).
pub(crate) fn ms_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A stored time (milliseconds since the Unix epoch) as a `SystemTime`.
pub(crate) fn time_of(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QueueErrorKind;

    #[test]
    fn a_stored_time_reads_back_as_it_was_stored() {
        let now = now_ms();
        assert_eq!(ms_of(time_of(now)), now);
        assert_eq!(ms_of(UNIX_EPOCH - Duration::from_secs(1)), 0);
    }

    backend_errors!("test queue");

    #[test]
    fn a_backends_errors_name_it() {
        let e = fail(QueueErrorKind::Corrupt, "bad record");
        assert_eq!(e.kind(), QueueErrorKind::Corrupt);
        assert_eq!(e.message(), "test queue: bad record");
        let e = err(std::io::Error::other("gone"));
        assert_eq!(e.message(), "test queue: gone");
    }
}
