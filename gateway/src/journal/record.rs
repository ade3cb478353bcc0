//! A journal record: everything the journal knows of one stored key.

use super::{JournalEvent, JournalOutcome};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tower_idempotency::Outcome;

/// Everything the journal knows of one stored key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct JournalRecord {
    /// The stored key (`prefix:preset:route:principal:key`).
    pub key: String,
    /// The preset that guarded it.
    pub preset: String,
    /// The route it came in on (the route's prefix).
    pub route: String,
    /// Whether its copies' sender was verified (a verify layer checked the
    /// signature). A record on an unverified or `auto` route says only what
    /// somebody sent: [`reconcile`](crate::reconcile::reconcile) does not take it as
    /// proof that a payment ran.
    #[serde(default)]
    pub verified: bool,
    /// When the first copy came, in milliseconds since the Unix epoch.
    pub first_seen_ms: u64,
    /// When the last copy came.
    pub last_seen_ms: u64,
    /// How many copies came.
    pub copies: u64,
    /// How many copies got each outcome (`executed`, `replayed`, `waited`,
    /// `mismatch`, `shed`, ...), and on acknowledge-then-deliver routes how
    /// many delivery attempts ended `delivered` or `delivery_failed`.
    pub outcomes: BTreeMap<String, u64>,
    /// The status the last copy was answered.
    pub last_status: Option<u16>,
    /// What the upstream answered the last copy that reached it.
    pub upstream_status: Option<u16>,
    /// How long that upstream call took, in milliseconds.
    pub upstream_ms: Option<u64>,
    /// Delivery attempts from the queue (acknowledge-then-deliver routes).
    pub attempts: u64,
    /// Copies that ran and were answered 2xx (the answer was stored): more
    /// than one means the notification ran more than once (on two
    /// instances, or after its record was forgotten).
    #[serde(default)]
    pub completed: u64,
    /// Operators' actions on the key, oldest first (at most 16 kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// The channel's transaction id, when the notification carries it in
    /// the clear (see [`Business::read`](super::Business::read)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transaction_id: Option<String>,
    /// The merchant's order number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_trade_no: Option<String>,
    /// The order's amount in minor units (fen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount_minor: Option<i64>,
    /// The trade state the notification reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trade_state: Option<String>,
    /// The trace (its W3C trace id) of the last copy or delivery attempt
    /// that reached the upstream, else of the first copy that had one: the
    /// trace id in the `traceparent` the upstream got, to look the
    /// notification up in the tracing backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// The raw body of the first copy that had one, when bodies are kept
    /// (at most the configured size; see [`JournalEvent::body`](super::JournalEvent::body)),
    /// byte for byte; in JSON `body_base64`, standard base64.
    #[serde(
        default,
        rename = "body_base64",
        with = "base64_bytes",
        skip_serializing_if = "Option::is_none"
    )]
    pub body: Option<Vec<u8>>,
    /// The size of that body as received, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_bytes: Option<u64>,
    /// Whether `body` holds only the first part of it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_truncated: bool,
}

impl JournalRecord {
    pub(super) fn first(event: &JournalEvent) -> Self {
        Self {
            key: event.key.to_string(),
            preset: event.preset.to_string(),
            route: event.route.to_string(),
            verified: false,
            first_seen_ms: event.at_ms,
            last_seen_ms: event.at_ms,
            copies: 0,
            outcomes: BTreeMap::new(),
            last_status: None,
            upstream_status: None,
            upstream_ms: None,
            attempts: 0,
            completed: 0,
            notes: Vec::new(),
            transaction_id: None,
            out_trade_no: None,
            amount_minor: None,
            trade_state: None,
            trace_id: None,
            body: None,
            body_bytes: None,
            body_truncated: false,
        }
    }

    /// Adds one event; an operator's note is not a copy.
    pub(super) fn add(&mut self, event: &JournalEvent) {
        self.first_seen_ms = self.first_seen_ms.min(event.at_ms);
        self.last_seen_ms = self.last_seen_ms.max(event.at_ms);
        if let Some(note) = &event.note {
            if self.notes.len() == MAX_NOTES {
                self.notes.remove(0);
            }
            self.notes.push(note.clone());
            return;
        }
        // A delivery attempt from the queue is not a copy the channel sent.
        self.copies += u64::from(!event.attempt);
        self.verified |= event.verified && !event.attempt;
        *self
            .outcomes
            .entry(event.outcome.as_str().to_owned())
            .or_default() += 1;
        if event.status.is_some() {
            self.last_status = event.status;
        }
        if let Some((status, ms)) = event.upstream {
            self.upstream_status = Some(status);
            self.upstream_ms = Some(ms);
        }
        self.attempts += u64::from(event.attempt);
        if let Some(trace) = &event.trace_id
            && (event.upstream.is_some() || self.trace_id.is_none())
        {
            self.trace_id = Some(trace.to_string());
        }
        let stored = event.status.is_some_and(|s| (200..300).contains(&s));
        let executed = event.outcome == JournalOutcome::Layer(Outcome::Executed);
        self.completed += u64::from(!event.attempt && executed && stored);
        // The copy that ran says what the notification is about; another
        // only fills in what is not known yet.
        if let Some(b) = &event.business {
            let ran = executed;
            let set = |field: &mut Option<String>, value: &Option<String>| {
                if ran || field.is_none() {
                    *field = value.clone().or(field.take());
                }
            };
            set(&mut self.transaction_id, &b.transaction_id);
            set(&mut self.out_trade_no, &b.out_trade_no);
            set(&mut self.trade_state, &b.trade_state);
            if ran || self.amount_minor.is_none() {
                self.amount_minor = b.amount_minor.or(self.amount_minor);
            }
        }
        if let (None, Some(body)) = (&self.body, &event.body) {
            let (text, len, truncated) = &**body;
            self.body = Some(text.clone());
            self.body_bytes = Some(*len);
            self.body_truncated = *truncated;
        }
    }
}

const MAX_NOTES: usize = 16;

/// `Option<Vec<u8>>` as standard base64 text.
mod base64_bytes {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

    pub(super) fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(bytes) => s.serialize_str(&B64.encode(bytes)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(text) => B64.decode(text).map(Some).map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const FIRST: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const RAN: &str = "0af7651916cd43dd8448eb211c80319c";

    fn event(outcome: Outcome) -> JournalEvent {
        JournalEvent::new("idem:stripe:/n:evt_1", "stripe", "/n", outcome)
    }

    #[test]
    fn the_record_points_to_the_trace_of_the_copy_that_reached_the_upstream() {
        let first = event(Outcome::InFlightRejected).trace_id(FIRST);
        let mut record = JournalRecord::first(&first);
        record.add(&first);
        assert_eq!(record.trace_id.as_deref(), Some(FIRST), "the first copy's");
        let ran = event(Outcome::Executed)
            .upstream(200, Duration::from_millis(3))
            .trace_id(RAN);
        record.add(&ran);
        assert_eq!(record.trace_id.as_deref(), Some(RAN), "the copy that ran");
        // A replay did not reach the upstream: the record keeps the trace
        // of the copy that did.
        record.add(&event(Outcome::Replayed).trace_id(FIRST));
        assert_eq!(record.trace_id.as_deref(), Some(RAN));
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["trace_id"], RAN);
    }

    #[test]
    fn what_is_not_a_trace_id_is_not_kept() {
        for bad in [
            "",
            "00000000000000000000000000000000",
            "4BF92F3577B34DA6A3CE929D0E0E4736",
            "4bf92f3577b34da6a3ce929d0e0e473",
            "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "zz f92f3577b34da6a3ce929d0e0e4736",
        ] {
            let e = event(Outcome::Executed).trace_id(bad);
            let mut record = JournalRecord::first(&e);
            record.add(&e);
            assert_eq!(record.trace_id, None, "{bad:?}");
        }
        // A record written before trace ids were kept reads back without one.
        let old = serde_json::to_value(JournalRecord::first(&event(Outcome::Executed))).unwrap();
        assert!(old.get("trace_id").is_none());
        let back: JournalRecord = serde_json::from_value(old).unwrap();
        assert_eq!(back.trace_id, None);
    }
}
