//! What happened to a request, counted through the `metrics` facade.

use std::fmt;

/// The outcome of one request at the idempotency layers.
///
/// Guarded responses carry their outcome in the response extensions, and with
/// the `metrics` feature every outcome is counted as
/// `idempotency_requests_total{preset, outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The inner service ran for this request and succeeded (the record completed).
    Executed,
    /// The inner service ran and failed; the claim was released.
    Failed,
    /// A stored response was replayed at once.
    Replayed,
    /// A duplicate waited for the first request and then replayed its response.
    Waited,
    /// A duplicate found the key in flight and waiting was off or ran out.
    InFlightRejected,
    /// The key was reused with another payload.
    Mismatch,
    /// A guarded request carried no key.
    KeyMissing,
    /// The request was refused: body too large, key too long, malformed body.
    RejectedBadInput,
    /// The store failed or timed out.
    StoreError,
    /// The owner's lease ran out before it completed (the handler ran longer
    /// than the lease and renewals failed).
    LeaseLost,
    /// The request passed through unguarded because the store failed and the
    /// policy is fail-open.
    PassedThrough,
    /// The inner call ran past the run limit: it was cancelled, its claim
    /// released, and the caller got the retryable failure.
    RunLimitExceeded,
    /// The inner call outlived the reply deadline: the caller got the
    /// retryable failure while the call goes on in the background, its
    /// success recorded for the next retry.
    ReplyDeadline,
    /// A completed record could not be stored, even after retrying in the
    /// background for one lease: the next retry runs the inner service again.
    CompletionAbandoned,
    /// The sender's signature did not verify (bad or missing signature, stale
    /// timestamp, unknown key); the store was not touched.
    Unverified,
    /// Something panicked while serving the request: the panic was caught at
    /// the service boundary and the caller got a 500 (the connection stays
    /// open). Always a bug: the log has the panic message.
    Panicked,
    /// The request was refused at once with the retryable failure (503 with
    /// `Retry-After`, or the channel's failure reply) because a bound was
    /// full: the budget of buffered request bodies or the cap on upstream
    /// calls. Nothing was claimed or run; the sender's retry gets through
    /// once the load is gone.
    Shed,
    /// On an acknowledge-then-deliver route that does not verify its sender,
    /// the copies of the key with other payloads already fill the entries
    /// queued beside it (forged copies, perhaps): this one was not queued and
    /// the sender got the retryable failure, so that a genuine copy is
    /// retried once they are delivered.
    TooManyCopies,
}

impl Outcome {
    /// The label used in metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Failed => "failed",
            Self::Replayed => "replayed",
            Self::Waited => "waited",
            Self::InFlightRejected => "in_flight_rejected",
            Self::Mismatch => "mismatch",
            Self::KeyMissing => "key_missing",
            Self::RejectedBadInput => "rejected_bad_input",
            Self::StoreError => "store_error",
            Self::LeaseLost => "lease_lost",
            Self::PassedThrough => "passed_through",
            Self::RunLimitExceeded => "run_limit_exceeded",
            Self::ReplyDeadline => "reply_deadline",
            Self::CompletionAbandoned => "completion_abandoned",
            Self::Unverified => "unverified",
            Self::Panicked => "panicked",
            Self::Shed => "shed",
            Self::TooManyCopies => "too_many_copies",
        }
    }

    /// Whether this request was a copy of an earlier one.
    pub const fn is_duplicate(self) -> bool {
        matches!(
            self,
            Self::Replayed
                | Self::Waited
                | Self::InFlightRejected
                | Self::Mismatch
                | Self::TooManyCopies
        )
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts one outcome.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn record(preset: &std::sync::Arc<str>, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_requests_total",
        "preset" => metrics::SharedString::from(preset.clone()),
        "outcome" => outcome.as_str()
    )
    .increment(1);
}

/// Records the latency of one store call.
#[cfg(feature = "metrics")]
pub(crate) fn store_latency(op: &'static str, seconds: f64) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_store_seconds", "op" => op).record(seconds);
}

/// Logs at warn level when the `tracing` feature is on.
macro_rules! log_warn {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::warn!($($t)*);
    };
}
pub(crate) use log_warn;

/// Logs at info level when the `tracing` feature is on.
#[cfg(feature = "queue")]
macro_rules! log_info {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::info!($($t)*);
    };
}
#[cfg(feature = "queue")]
pub(crate) use log_info;
