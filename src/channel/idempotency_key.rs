//! Client APIs with the `Idempotency-Key` header (IETF
//! draft-ietf-httpapi-idempotency-key-header): the inner response is replayed;
//! 400 when the key is missing, 409 while the first request is in flight and
//! waiting is off or ran out, 422 when the key is reused with another payload.

use super::Preset;
use crate::key::{Extracted, Fingerprint, KeyError};
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;

const HEADER: HeaderName = HeaderName::from_static("idempotency-key");

/// The draft sends the key as a Structured Field string (`"abc"`); bare
/// tokens are accepted too.
fn extract(parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
    let Some(value) = parts.headers.get(HEADER) else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| KeyError::invalid_key("the `Idempotency-Key` header must be visible ASCII"))?
        .trim();
    let key = match value.strip_prefix('"') {
        Some(rest) => rest.strip_suffix('"').ok_or_else(|| {
            KeyError::invalid_key("the `Idempotency-Key` header has an unclosed quote")
        })?,
        None => value,
    };
    if key.is_empty() {
        return Ok(None);
    }
    Ok(Some(Extracted {
        key: key.to_owned(),
        fingerprint: Fingerprint::of_request(parts, body),
    }))
}

pub(super) fn preset() -> Preset {
    Preset::client_api("idempotency-key", extract, "`Idempotency-Key` header")
}
