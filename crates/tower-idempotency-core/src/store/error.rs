//! [`StoreError`]: why a store call failed, by kind, with the backend's
//! own error as its source.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a store call failed.
///
/// Keeps the backend's own error, if there was one, as its
/// [`source`](std::error::Error::source).
#[derive(Debug, Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The kind of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The call did not answer within the store timeout.
    Timeout,
    /// The backend answered with an error or could not be reached.
    Backend,
    /// The backend answered something this crate cannot read.
    Corrupt,
    /// The store does not implement this operation.
    Unsupported,
}

impl StoreError {
    /// A new error.
    pub fn new(kind: StoreErrorKind, message: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// The same error, caused by `source` (returned by
    /// [`Error::source`](std::error::Error::source)).
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// A [`Timeout`](StoreErrorKind::Timeout): `op` did not answer within
    /// `after`.
    pub fn timeout(op: &str, after: Duration) -> Self {
        Self::new(
            StoreErrorKind::Timeout,
            format!("store {op} timed out after {after:?}"),
        )
    }

    /// The kind of failure.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// Whether trying the call again later can succeed (see
    /// [`StoreErrorKind::is_retryable`]).
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}

impl StoreErrorKind {
    /// Whether trying the call again later can succeed:
    /// [`Timeout`](Self::Timeout) and [`Backend`](Self::Backend) (the store
    /// was slow, down or refused for now). [`Corrupt`](Self::Corrupt) and
    /// [`Unsupported`](Self::Unsupported) answer the same way every time.
    ///
    /// A payment handler that sees a retryable error answers the channel
    /// with a failure, so that the channel sends the notification again.
    pub const fn is_retryable(self) -> bool {
        matches!(self, Self::Timeout | Self::Backend)
    }

    /// A short name of the kind (`"timeout"`, `"backend"`, ...), as logs
    /// and metric labels write it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Backend => "backend",
            Self::Corrupt => "corrupt",
            Self::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_or_failing_backend_is_worth_another_try_a_corrupt_answer_is_not() {
        let retryable = [StoreErrorKind::Timeout, StoreErrorKind::Backend];
        let not = [StoreErrorKind::Corrupt, StoreErrorKind::Unsupported];
        for kind in retryable {
            assert!(kind.is_retryable(), "{kind}");
            assert!(StoreError::new(kind, "x").is_retryable(), "{kind}");
        }
        for kind in not {
            assert!(!kind.is_retryable(), "{kind}");
            assert!(!StoreError::new(kind, "x").is_retryable(), "{kind}");
        }
        assert!(StoreError::timeout("get", Duration::from_millis(5)).is_retryable());
        assert_eq!(StoreErrorKind::Backend.to_string(), "backend");
    }
}
