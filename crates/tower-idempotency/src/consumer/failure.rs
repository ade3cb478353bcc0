//! What a failed delivery means for its entry: retry it, dead-letter it at
//! once, or keep it without counting the attempt.
//!
//! A queue's `Worker` takes any service whose error is
//! `Display`. The errors of this crate that know more
//! ([`ConsumeError`](super::ConsumeError),
//! the gateway's `DeliveryError`) say so when they are
//! formatted with the `-` flag (`{:-}`, unused by the standard library's
//! types): their text then starts with one of the markers below. Every
//! other error is retried.

use std::fmt;

/// Starts the `{:-}` form of an error no later delivery can fix.
pub(crate) const PERMANENT: &str = "\u{0}permanent\u{0}";

/// Starts the `{:-}` form of an error that says "not now, and not the
/// entry's fault" (no route for it): kept, never dead-lettered for it.
#[cfg_attr(not(feature = "proxy"), allow(dead_code))]
pub(crate) const KEPT: &str = "\u{0}kept\u{0}";

/// Starts the `{:-}` form of an error the deliverer answered itself, not
/// the upstream (shed by its own limit, the key in flight, the reply
/// deadline, its store failed): postponed without counting the attempt,
/// and no sign of the upstream's health.
#[cfg_attr(not(feature = "proxy"), allow(dead_code))]
pub(crate) const HELD: &str = "\u{0}held\u{0}";

/// How the worker settles a failed delivery.
#[cfg_attr(not(feature = "queue"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Retried after its backoff; dead-lettered after `max_attempts`.
    Retry,
    /// Dead-lettered at once.
    Permanent,
    /// Kept and tried again later, never dead-lettered for it.
    Kept,
    /// Held back by the deliverer itself: due again after the backoff, the
    /// attempt not counted.
    Held,
}

#[cfg_attr(not(feature = "queue"), allow(dead_code))]
impl Failure {
    pub(crate) fn of(error: &impl fmt::Display) -> Self {
        let marked = format!("{error:-}");
        if marked.starts_with(PERMANENT) {
            Self::Permanent
        } else if marked.starts_with(KEPT) {
            Self::Kept
        } else if marked.starts_with(HELD) {
            Self::Held
        } else {
            Self::Retry
        }
    }
}

/// Writes `marker` first when `f` asks for the marked form.
pub(crate) fn mark(f: &mut fmt::Formatter<'_>, marker: &str) -> fmt::Result {
    if f.sign_minus() {
        f.write_str(marker)?;
    }
    Ok(())
}
