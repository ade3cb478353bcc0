//! Client APIs with the `Idempotency-Key` header (IETF
//! draft-ietf-httpapi-idempotency-key-header): the inner response is replayed;
//! 400 when the key is missing or malformed, 409 while the first request is in
//! flight and waiting is off or ran out, 422 when the key is reused with
//! another payload, each as `application/problem+json` like the draft's
//! examples.

use super::Preset;
use crate::key::{Extracted, Fingerprint, KeyError};
use crate::normalize::Reply;
use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;

const HEADER: HeaderName = HeaderName::from_static("idempotency-key");

/// The draft sends the key as a Structured Field string (`"abc"`, a space
/// allowed inside the quotes, `\"` and `\\` escapes, parameters after it
/// ignored); a bare value of visible ASCII (`abc`, a UUID, digits first) is
/// accepted too and is the same key. A bare value with a space or a control
/// character is malformed.
fn extract(parts: &Parts, body: &Bytes) -> Result<Option<Extracted>, KeyError> {
    let Some(value) = parts.headers.get(HEADER) else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| KeyError::invalid_key("the `Idempotency-Key` header must be visible ASCII"))?
        .trim();
    let key = match value.strip_prefix('"') {
        Some(rest) => sf_string(rest).map_err(KeyError::invalid_key)?,
        None if value.bytes().all(|b| b.is_ascii_graphic()) => value.to_owned(),
        None => {
            return Err(KeyError::invalid_key(
                "the `Idempotency-Key` header must be visible ASCII (a space only inside the \
                 quotes of its string form, `\"a b\"`)",
            ));
        }
    };
    if key.is_empty() {
        return Ok(None);
    }
    Ok(Some(Extracted {
        key,
        fingerprint: Fingerprint::of_request(parts, body),
    }))
}

/// The rest of an RFC 8941 string after its opening quote: its value, or
/// why not (not closed, a bad escape or character, anything but parameters
/// after it).
fn sf_string(rest: &str) -> Result<String, &'static str> {
    const INVALID: &str = "the `Idempotency-Key` header is not a valid Structured Field string";
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, e @ ('"' | '\\'))) => out.push(e),
                _ => return Err(INVALID),
            },
            '"' => {
                let after = &rest[at + 1..];
                let params = after.is_empty() || after.starts_with(';');
                return if params { Ok(out) } else { Err(INVALID) };
            }
            ' '..='~' => out.push(c),
            _ => return Err(INVALID),
        }
    }
    Err("the `Idempotency-Key` header has an unclosed quote")
}

/// Refusals are problem details, as the draft's examples.
pub(super) fn preset() -> Preset {
    let mut preset = Preset::client_api("idempotency-key", extract, "`Idempotency-Key` header");
    preset.reply = Reply::pass_through().with_problem_details("Idempotency-Key");
    preset
}

#[cfg(test)]
mod tests {
    use super::sf_string;

    #[test]
    fn structured_field_strings() {
        let ok = |s: &str| sf_string(s).ok();
        assert_eq!(ok("abc\"").as_deref(), Some("abc"));
        assert_eq!(ok(r#"a\"b\\c""#).as_deref(), Some(r#"a"b\c"#));
        assert_eq!(ok("abc\";p=1").as_deref(), Some("abc"));
        assert!(sf_string("").unwrap_err().contains("unclosed"));
        assert!(sf_string("abc").unwrap_err().contains("unclosed"));
        for bad in ["a\"b\"", r#"a\x""#, "a\tb\""] {
            assert!(
                sf_string(bad).unwrap_err().contains("Structured Field"),
                "{bad}"
            );
        }
    }
}
