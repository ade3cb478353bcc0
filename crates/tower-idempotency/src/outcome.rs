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
    /// On an acknowledge-then-deliver route with several destinations, each
    /// filtered by what the notification says: it matched none of them. It
    /// was acknowledged and is delivered nowhere.
    Filtered,
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
            Self::Filtered => "filtered",
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

impl Outcome {
    /// Counts this outcome of a request of `preset` in
    /// `idempotency_requests_total{preset,outcome}` (feature `metrics`;
    /// nothing without it), as the layers count theirs: for a program that
    /// answers some requests before they reach the layers (a gateway's own
    /// refusals) and wants them in the same series.
    pub fn count(self, preset: &std::sync::Arc<str>) {
        record(preset, self);
    }
}

/// Counts one outcome.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn record(preset: &std::sync::Arc<str>, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    match series::requests(preset, outcome) {
        // A built-in preset: its key built once (no label vector, no
        // reference count per request); the recorder of this moment is
        // asked for the counter, so a recorder installed later, or a
        // thread's local one, still counts it.
        Some(key) => {
            metrics::with_recorder(|r| r.register_counter(key, series::metadata())).increment(1)
        }
        None => metrics::counter!(
            "idempotency_requests_total",
            "preset" => metrics::SharedString::from(preset.clone()),
            "outcome" => outcome.as_str()
        )
        .increment(1),
    }
}

/// Records the latency of one store call.
#[cfg(feature = "metrics")]
pub(crate) fn store_latency(op: &'static str, seconds: f64) {
    match series::store_op(op) {
        Some(key) => metrics::with_recorder(|r| r.register_histogram(key, series::metadata()))
            .record(seconds),
        None => metrics::histogram!("idempotency_store_seconds", "op" => op).record(seconds),
    }
}

/// The keys of the series counted on every request, built once: the
/// `metrics` macros build a key (and allocate its labels) per call when a
/// label's value is not a literal.
#[cfg(feature = "metrics")]
mod series {
    use super::Outcome;
    use crate::channel::PRESET_NAMES;
    use metrics::{Key, Label, Level, Metadata};
    use std::sync::OnceLock;

    /// Every outcome, in declaration order (`ALL[o as usize] == o`).
    const ALL: [Outcome; 19] = [
        Outcome::Executed,
        Outcome::Failed,
        Outcome::Replayed,
        Outcome::Waited,
        Outcome::InFlightRejected,
        Outcome::Mismatch,
        Outcome::KeyMissing,
        Outcome::RejectedBadInput,
        Outcome::StoreError,
        Outcome::LeaseLost,
        Outcome::PassedThrough,
        Outcome::RunLimitExceeded,
        Outcome::ReplyDeadline,
        Outcome::CompletionAbandoned,
        Outcome::Unverified,
        Outcome::Panicked,
        Outcome::Shed,
        Outcome::TooManyCopies,
        Outcome::Filtered,
    ];

    /// The store calls that are timed.
    const OPS: [&str; 6] = [
        "claim",
        "complete",
        "renew",
        "release",
        "take_token",
        "put_token",
    ];

    /// What the macros would give these series (the target is this module's
    /// parent, as where they were called).
    pub(super) fn metadata() -> &'static Metadata<'static> {
        static METADATA: Metadata<'static> = Metadata::new(
            "tower_idempotency::outcome",
            Level::INFO,
            Some("tower_idempotency::outcome"),
        );
        &METADATA
    }

    /// `idempotency_requests_total{preset, outcome}` of a built-in preset.
    pub(super) fn requests(preset: &str, outcome: Outcome) -> Option<&'static Key> {
        static KEYS: OnceLock<Box<[Key]>> = OnceLock::new();
        let at = PRESET_NAMES.iter().position(|n| *n == preset)?;
        // An outcome added without its place in `ALL` takes the slow path.
        if ALL.get(outcome as usize) != Some(&outcome) {
            return None;
        }
        let keys = KEYS.get_or_init(|| {
            PRESET_NAMES
                .iter()
                .flat_map(|name| {
                    ALL.iter().map(move |o| {
                        let labels = vec![
                            Label::from_static_parts("preset", name),
                            Label::from_static_parts("outcome", o.as_str()),
                        ];
                        Key::from_parts("idempotency_requests_total", labels)
                    })
                })
                .collect()
        });
        keys.get(at * ALL.len() + outcome as usize)
    }

    /// `idempotency_store_seconds{op}` of the store calls in `OPS`.
    pub(super) fn store_op(op: &str) -> Option<&'static Key> {
        static KEYS: OnceLock<Box<[Key]>> = OnceLock::new();
        let at = OPS.iter().position(|o| *o == op)?;
        let keys = KEYS.get_or_init(|| {
            OPS.iter()
                .map(|op| {
                    let labels = vec![Label::from_static_parts("op", op)];
                    Key::from_parts("idempotency_store_seconds", labels)
                })
                .collect()
        });
        keys.get(at)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_outcome_in_its_place() {
            for (i, o) in ALL.iter().enumerate() {
                assert_eq!(*o as usize, i, "{o}");
            }
            let key = requests("stripe", Outcome::Replayed).unwrap();
            let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
            assert_eq!(labels, [("preset", "stripe"), ("outcome", "replayed")]);
            assert!(requests("custom", Outcome::Replayed).is_none());
            let key = store_op("complete").unwrap();
            let labels: Vec<_> = key.labels().map(|l| l.value()).collect();
            assert_eq!(labels, ["complete"]);
            assert!(store_op("scan").is_none());
        }
    }
}

/// Logs at warn level when the `tracing` feature is on.
macro_rules! log_warn {
    ($($t:tt)*) => {
        #[cfg(feature = "tracing")]
        tracing::warn!($($t)*);
    };
}
pub(crate) use log_warn;
