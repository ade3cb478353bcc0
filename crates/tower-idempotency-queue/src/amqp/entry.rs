//! What an entry carries on the broker besides its message: its
//! [`Envelope`] (id, attempts, last error, history, when it was queued and
//! dead-lettered) written as the publish's properties and headers, and the
//! headers read back where an entry is fetched, delayed or dead.

use super::super::Message;
use super::connection::string;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;

/// The attempts an entry had, in the header of that name.
pub(super) const ATTEMPTS_HEADER: &str = "x-attempts";
/// When the entry was first queued, in milliseconds since the epoch.
pub(super) const ENQUEUED_HEADER: &str = "x-enqueued-ms";
/// The record key the entry was queued under.
const KEY_HEADER: &str = "x-idempotency-key";
/// The error of its last failed attempt.
pub(super) const LAST_ERROR_HEADER: &str = "x-last-error";
/// When it was dead-lettered, in milliseconds since the epoch.
pub(super) const DEAD_AT_HEADER: &str = "x-dead-at-ms";

/// What a publish carries besides the message.
pub(super) struct Envelope<'a> {
    pub(super) id: String,
    pub(super) attempts: u32,
    pub(super) error: Option<&'a str>,
    pub(super) enqueued_ms: u64,
    pub(super) dead_at: Option<u64>,
    /// The failed attempts (see `attempts::History`), in
    /// [`HISTORY_HEADER`].
    pub(super) history: Option<&'a str>,
}

/// The header carrying an entry's failed attempts: one line of printable
/// ASCII, at most about 50 KiB (16 attempts of at most 1 KiB, escaped),
/// within a content header frame of the broker's default `frame_max`.
pub(super) const HISTORY_HEADER: &str = "x-attempt-history";

/// The properties of `message`'s publish: persistent, its envelope, and
/// `headers` of the caller's besides.
pub(super) fn properties(
    message: &Message,
    env: Envelope<'_>,
    mut headers: FieldTable,
) -> BasicProperties {
    headers.insert(
        ATTEMPTS_HEADER.into(),
        AMQPValue::LongLongInt(i64::from(env.attempts)),
    );
    headers.insert(
        ENQUEUED_HEADER.into(),
        AMQPValue::LongLongInt(env.enqueued_ms as i64),
    );
    headers.insert(
        KEY_HEADER.into(),
        AMQPValue::LongString(LongString::from(message.key.as_str())),
    );
    if let Some(e) = env.error {
        headers.insert(
            LAST_ERROR_HEADER.into(),
            AMQPValue::LongString(LongString::from(e)),
        );
    }
    if let Some(h) = env.history.filter(|h| !h.is_empty()) {
        headers.insert(
            HISTORY_HEADER.into(),
            AMQPValue::LongString(LongString::from(h)),
        );
    }
    if let Some(at) = env.dead_at {
        headers.insert(DEAD_AT_HEADER.into(), AMQPValue::LongLongInt(at as i64));
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(string(env.id))
        .with_timestamp(env.enqueued_ms / 1000)
        .with_headers(headers)
}

pub(super) fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    p.headers().as_ref()?.inner().get(name)
}

pub(super) fn header_u64(p: &BasicProperties, name: &str) -> Option<u64> {
    match header(p, name)? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}

pub(super) fn header_text(p: &BasicProperties, name: &str) -> String {
    match header(p, name) {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => String::new(),
    }
}
