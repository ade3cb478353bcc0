//! What a failed delivery means for its queued entry: retry it, dead-letter
//! it at once, keep it, or hold it back without counting the attempt.
//!
//! A queue's `Worker` asks the error of each failed delivery through
//! [`Failure::disposition`]. An error type that knows no more than "it
//! failed" implements [`Failure`] with the default (retry);
//! [`ConsumeError`](super::ConsumeError) dead-letters what no later delivery
//! can fix and passes its handler's own disposition on.

use std::convert::Infallible;
use std::fmt;

/// What a failed delivery means for its queued entry. (Not
/// `non_exhaustive`: a worker must settle every disposition, so a new one
/// is a breaking change.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Disposition {
    /// Tried again after its backoff; dead-lettered after the last attempt.
    /// A sign that the upstream is failing (the breaker counts it).
    #[default]
    Retry,
    /// Dead-lettered at once: no later delivery can succeed (the message's
    /// key was reused with another payload, it has none, the upstream
    /// refused it for good). The upstream answered: no sign it is failing.
    Permanent,
    /// Not now, and not the entry's fault (no route delivers it yet): kept
    /// and tried again later, never dead-lettered for it, and no sign of
    /// the upstream's health.
    Keep,
    /// Held back by the deliverer itself, not the upstream (shed by its own
    /// limit, the key in flight elsewhere, its reply deadline, its store
    /// failed): due again after the backoff, the attempt not counted, and
    /// no sign of the upstream's health.
    Hold,
    /// Held while its route is paused: handed out again only after a long
    /// wait (not the backoff), so that the entries of a paused route cost
    /// next to nothing while they wait; the attempt not counted, never
    /// dead-lettered for it, and no sign of the upstream's health.
    Pause,
}

/// The error of a failed delivery, as a queue's worker settles it: its text
/// is recorded with the entry, its [`disposition`](Self::disposition) says
/// what happens to the entry.
///
/// ```
/// use std::fmt;
/// use tower_idempotency::consumer::{Disposition, Failure};
///
/// #[derive(Debug)]
/// enum PayError {
///     Timeout,
///     UnknownOrder,
/// }
///
/// impl fmt::Display for PayError {
///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
///         f.write_str(match self {
///             Self::Timeout => "the ledger timed out",
///             Self::UnknownOrder => "no such order",
///         })
///     }
/// }
///
/// impl Failure for PayError {
///     fn disposition(&self) -> Disposition {
///         match self {
///             Self::Timeout => Disposition::Retry,
///             Self::UnknownOrder => Disposition::Permanent,
///         }
///     }
/// }
/// ```
pub trait Failure: fmt::Display {
    /// What the failure means for the entry; [`Disposition::Retry`] unless
    /// the error knows better.
    fn disposition(&self) -> Disposition {
        Disposition::Retry
    }
}

impl Failure for Box<dyn std::error::Error + Send + Sync> {}
impl Failure for std::io::Error {}
impl Failure for String {}
impl Failure for &'static str {}
impl Failure for Infallible {}
