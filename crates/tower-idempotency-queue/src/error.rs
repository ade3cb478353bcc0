//! [`QueueError`]: why a queue call failed, as a [`QueueErrorKind`] a
//! caller can act on, a message, and the backend's own error as its
//! [`source`](std::error::Error::source).
//!
//! ```
//! use std::error::Error as _;
//! use tower_idempotency_queue::{QueueError, QueueErrorKind};
//!
//! let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
//! let e = QueueError::new(QueueErrorKind::Unavailable, "cannot reach the queue").with_source(io);
//! assert_eq!(e.kind(), QueueErrorKind::Unavailable);
//! assert!(e.is_retryable());
//! assert!(e.source().is_some());
//!
//! let e = QueueError::new(QueueErrorKind::Unsupported, "this queue cannot forget keys");
//! assert!(!e.is_retryable());
//! assert!(e.source().is_none());
//! ```

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// What kind of failure a [`QueueError`] is: what a caller can do about it
/// without reading its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QueueErrorKind {
    /// The queue's server (or its storage) cannot be reached or answer now:
    /// a connection refused, dropped or not yet made, a broker that closed
    /// the channel, a server still loading or failing over. Trying again
    /// later can succeed.
    Unavailable,
    /// The call did not end in time (a bound of the queue's own, or its
    /// client's). It may still have taken effect. Trying again later can
    /// succeed.
    Timeout,
    /// The queue cannot store anything now (its disk is full or failing,
    /// or it keeps its reserve of free space), and says so itself while it
    /// lasts: a warning a minute, `idempotency_queue_writable` at 0. Trying
    /// again later can succeed; a caller need not log each failure.
    Unwritable,
    /// This queue does not do what was asked (delete a dead letter, forget
    /// a key). Trying again gives the same answer.
    Unsupported,
    /// What was asked cannot be done as given: an id that is not one of this
    /// queue's, a key (secret) that is too short, an address that does not
    /// parse. Trying again gives the same answer.
    Invalid,
    /// The call conflicts with the state of what it names, and nothing was
    /// changed: a key to forget whose entry is still queued, being delivered
    /// or dead-lettered, a record another writer kept changing. It can
    /// succeed once that state changed (delivered, replayed), not by waiting
    /// alone.
    Conflict,
    /// What the queue stored cannot be read back (a record or marker that
    /// does not decode). Trying again gives the same answer.
    Corrupt,
    /// Any other failure (the backend's own error, in
    /// [`source`](std::error::Error::source), says more).
    Other,
}

impl QueueErrorKind {
    /// Whether trying again later can succeed: [`Unavailable`](Self::Unavailable),
    /// [`Timeout`](Self::Timeout) and [`Unwritable`](Self::Unwritable).
    pub const fn is_retryable(self) -> bool {
        matches!(self, Self::Unavailable | Self::Timeout | Self::Unwritable)
    }

    /// A short name of the kind (`"unavailable"`, `"timeout"`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Unwritable => "unwritable",
            Self::Unsupported => "unsupported",
            Self::Invalid => "invalid",
            Self::Conflict => "conflict",
            Self::Corrupt => "corrupt",
            Self::Other => "other",
        }
    }
}

impl fmt::Display for QueueErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a queue call failed: its [kind](Self::kind), a message, and the
/// backend's error it came from as its [`source`](Error::source) (a
/// `redis::RedisError`, a `lapin::Error`, an `async_nats` error, a `redb`
/// error, an `io::Error`). Cheap to clone.
///
/// Its `Display` is the message alone, which already says what the source
/// said where there is one.
#[derive(Clone)]
pub struct QueueError {
    kind: QueueErrorKind,
    message: Arc<str>,
    source: Option<Arc<dyn Error + Send + Sync + 'static>>,
}

impl QueueError {
    /// An error of `kind` saying `message`, with no source.
    pub fn new(kind: QueueErrorKind, message: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An [`Unwritable`](QueueErrorKind::Unwritable) error: the queue
    /// cannot store anything now, and says so itself while it lasts.
    pub fn unwritable(message: impl Into<Arc<str>>) -> Self {
        Self::new(QueueErrorKind::Unwritable, message)
    }

    /// This error with `source` as its [`source`](Error::source): the
    /// error it was made from.
    pub fn with_source(mut self, source: impl Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> QueueErrorKind {
        self.kind
    }

    /// Whether this is an [`Unwritable`](QueueErrorKind::Unwritable) error:
    /// the queue reports the condition, so a caller need not log each
    /// failure.
    pub fn is_unwritable(&self) -> bool {
        self.kind == QueueErrorKind::Unwritable
    }

    /// Whether trying again later can succeed (see
    /// [`QueueErrorKind::is_retryable`]).
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    /// The message, without the kind.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// A backend's error `e`, kept as the source, its kind read from `e`
    /// (and the errors under it); the message is `context: e`.
    pub(crate) fn backend(
        context: impl fmt::Display,
        e: impl Error + Send + Sync + 'static,
    ) -> Self {
        let kind = classify(&e);
        Self::new(kind, format!("{context}: {e}")).with_source(e)
    }

    /// [`backend`](Self::backend) for an error a client hands out boxed.
    pub(crate) fn backend_boxed(
        context: impl fmt::Display,
        e: Box<dyn Error + Send + Sync + 'static>,
    ) -> Self {
        let kind = classify(&*e);
        let mut made = Self::new(kind, format!("{context}: {e}"));
        made.source = Some(Arc::from(e));
        made
    }
}

impl fmt::Debug for QueueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("QueueError");
        d.field("kind", &self.kind).field("message", &self.message);
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for QueueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for QueueError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

/// The kind of a backend's error, by its type (never its message): the
/// clients' own judgement where they give one (redis' retry method,
/// lapin's error kind), an `io::Error`'s kind, redb's corruption; otherwise
/// the error under it, and [`Other`](QueueErrorKind::Other) at the bottom.
fn classify(e: &(dyn Error + 'static)) -> QueueErrorKind {
    if let Some(e) = e.downcast_ref::<QueueError>() {
        return e.kind;
    }
    if let Some(e) = e.downcast_ref::<std::io::Error>() {
        return io_kind(e);
    }
    if e.downcast_ref::<tokio::time::error::Elapsed>().is_some() {
        return QueueErrorKind::Timeout;
    }
    // A stored record of the wrong length.
    if e.downcast_ref::<std::array::TryFromSliceError>().is_some() {
        return QueueErrorKind::Corrupt;
    }
    #[cfg(feature = "redis")]
    if let Some(e) = e.downcast_ref::<redis::RedisError>() {
        return redis_kind(e);
    }
    #[cfg(feature = "amqp")]
    if let Some(e) = e.downcast_ref::<lapin::Error>() {
        return lapin_kind(e);
    }
    if let Some(kind) = redb_kind(e) {
        return kind;
    }
    match e.source() {
        Some(under) => classify(under),
        None => QueueErrorKind::Other,
    }
}

fn io_kind(e: &std::io::Error) -> QueueErrorKind {
    use std::io::ErrorKind as Io;
    match e.kind() {
        Io::TimedOut | Io::WouldBlock => QueueErrorKind::Timeout,
        Io::StorageFull | Io::QuotaExceeded | Io::ReadOnlyFilesystem => QueueErrorKind::Unwritable,
        Io::ConnectionRefused
        | Io::ConnectionReset
        | Io::ConnectionAborted
        | Io::NotConnected
        | Io::BrokenPipe
        | Io::UnexpectedEof
        | Io::HostUnreachable
        | Io::NetworkUnreachable
        | Io::NetworkDown
        | Io::AddrNotAvailable
        | Io::Interrupted => QueueErrorKind::Unavailable,
        Io::InvalidInput => QueueErrorKind::Invalid,
        Io::InvalidData => QueueErrorKind::Corrupt,
        Io::Unsupported => QueueErrorKind::Unsupported,
        _ => match e.get_ref() {
            Some(under) => classify(under),
            None => QueueErrorKind::Other,
        },
    }
}

#[cfg(feature = "redis")]
fn redis_kind(e: &redis::RedisError) -> QueueErrorKind {
    use redis::RetryMethod;
    if e.is_timeout() {
        return QueueErrorKind::Timeout;
    }
    if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        return QueueErrorKind::Unavailable;
    }
    match e.retry_method() {
        // Loading, TRYAGAIN, CLUSTERDOWN, MASTERDOWN, a connection to make
        // again: the server cannot answer now.
        RetryMethod::Reconnect
        | RetryMethod::ReconnectFromInitialConnections
        | RetryMethod::RetryImmediately
        | RetryMethod::WaitAndRetry => QueueErrorKind::Unavailable,
        _ => QueueErrorKind::Other,
    }
}

#[cfg(feature = "amqp")]
fn lapin_kind(e: &lapin::Error) -> QueueErrorKind {
    use lapin::ErrorKind as K;
    match e.kind() {
        K::IOError(io) => io_kind(io),
        K::RuntimeShutdownError(_)
        | K::InvalidChannelState(..)
        | K::InvalidConnectionState(_)
        | K::ChannelsLimitReached
        | K::MissingHeartbeatError => QueueErrorKind::Unavailable,
        // A connection-level error closes the connection; a channel-level
        // one (a queue not found, a precondition) says what was asked.
        K::ProtocolError(_) if e.is_amqp_hard_error() => QueueErrorKind::Unavailable,
        K::ParsingError(_) => QueueErrorKind::Corrupt,
        _ => QueueErrorKind::Other,
    }
}

/// redb's corruption and storage I/O, through each of its error types.
fn redb_kind(e: &(dyn Error + 'static)) -> Option<QueueErrorKind> {
    fn storage(e: &redb::StorageError) -> QueueErrorKind {
        match e {
            redb::StorageError::Corrupted(_) => QueueErrorKind::Corrupt,
            redb::StorageError::Io(io) => io_kind(io),
            // The file failed a write before: nothing is stored until it
            // is reopened.
            redb::StorageError::PreviousIo => QueueErrorKind::Unwritable,
            _ => QueueErrorKind::Other,
        }
    }
    if let Some(e) = e.downcast_ref::<redb::StorageError>() {
        return Some(storage(e));
    }
    if let Some(e) = e.downcast_ref::<redb::Error>() {
        return Some(match e {
            redb::Error::Corrupted(_) => QueueErrorKind::Corrupt,
            redb::Error::Io(io) => io_kind(io),
            redb::Error::PreviousIo => QueueErrorKind::Unwritable,
            _ => QueueErrorKind::Other,
        });
    }
    if let Some(redb::TransactionError::Storage(s)) = e.downcast_ref::<redb::TransactionError>() {
        return Some(storage(s));
    }
    if let Some(redb::TableError::Storage(s)) = e.downcast_ref::<redb::TableError>() {
        return Some(storage(s));
    }
    if let Some(redb::CommitError::Storage(s)) = e.downcast_ref::<redb::CommitError>() {
        return Some(storage(s));
    }
    if let Some(redb::DatabaseError::Storage(s)) = e.downcast_ref::<redb::DatabaseError>() {
        return Some(storage(s));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_error_keeps_its_source_and_gets_its_kind_from_its_type() {
        use std::io::{Error as Io, ErrorKind};
        let e = QueueError::backend("q", Io::new(ErrorKind::ConnectionRefused, "refused"));
        assert_eq!(e.kind(), QueueErrorKind::Unavailable);
        assert!(e.is_retryable());
        assert_eq!(e.to_string(), "q: refused");
        let io = e.source().and_then(|s| s.downcast_ref::<Io>());
        assert_eq!(io.map(Io::kind), Some(ErrorKind::ConnectionRefused));
        let e = QueueError::backend("q", Io::new(ErrorKind::TimedOut, "slow"));
        assert_eq!(e.kind(), QueueErrorKind::Timeout);
        let e = QueueError::backend("q", redb::StorageError::Corrupted("page".into()));
        assert_eq!(e.kind(), QueueErrorKind::Corrupt);
        assert!(!e.is_retryable());
        let e = QueueError::backend("q", redb::StorageError::PreviousIo);
        assert!(e.is_unwritable() && e.is_retryable());
        // Found under the error a client wraps it in.
        let wrapped = Io::other(Io::new(ErrorKind::BrokenPipe, "gone"));
        assert_eq!(
            QueueError::backend("q", wrapped).kind(),
            QueueErrorKind::Unavailable
        );
        let unknown = QueueError::backend("q", std::fmt::Error);
        assert_eq!(unknown.kind(), QueueErrorKind::Other);
        assert!(!unknown.is_retryable());
    }

    #[test]
    fn only_what_can_succeed_later_is_retryable() {
        use QueueErrorKind::*;
        for kind in [Unavailable, Timeout, Unwritable] {
            assert!(QueueError::new(kind, "x").is_retryable(), "{kind}");
        }
        for kind in [Unsupported, Invalid, Conflict, Corrupt, Other] {
            assert!(!QueueError::new(kind, "x").is_retryable(), "{kind}");
        }
        assert!(QueueError::unwritable("full").is_unwritable());
        assert!(!QueueError::new(Timeout, "slow").is_unwritable());
    }

    #[cfg(feature = "redis")]
    #[test]
    fn a_redis_error_is_judged_by_its_own_kind() {
        let refused: redis::RedisError =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused").into();
        assert_eq!(
            QueueError::backend("q", refused).kind(),
            QueueErrorKind::Unavailable
        );
        let script: redis::RedisError =
            (redis::ErrorKind::UnexpectedReturnType, "bad reply").into();
        assert_eq!(
            QueueError::backend("q", script).kind(),
            QueueErrorKind::Other
        );
    }
}
