//! The parts of a stored key: which route a request belongs to, and how each
//! part is written so that parts never run together and the whole key has a
//! fixed maximum length.

use crate::Fingerprint;
use http::request::Parts;
use std::borrow::Cow;

/// The longest a part of a stored key is written out; a longer part is
/// replaced by `#` and 32 hex digits of its SHA-256.
pub const MAX_PART_LEN: usize = 128;

/// The longest stored key: five parts (prefix, preset, route, principal, key)
/// of at most [`MAX_PART_LEN`] bytes and their four separators.
///
/// ```
/// use tower_idempotency::key::MAX_STORED_KEY_LEN;
/// use tower_idempotency::{Fingerprint, IdempotencyKey};
/// let long = "x".repeat(10_000);
/// let key = IdempotencyKey::new("idem", "custom".into(), &long, Some(&long), &long, Fingerprint::of(b""));
/// assert!(key.as_str().len() <= MAX_STORED_KEY_LEN);
/// ```
pub const MAX_STORED_KEY_LEN: usize = 5 * MAX_PART_LEN + 4;

/// The route part of a request's stored key: with the `axum` feature the
/// route pattern axum matched (`/orders/{id}`), otherwise the request path;
/// either in normal form (no trailing or duplicate slashes, no dot segments,
/// unreserved characters unescaped).
pub(crate) fn route_of(parts: &Parts) -> Cow<'_, str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return crate::path::normalize(matched.as_str());
    }
    crate::path::normalize(parts.uri.path())
}

/// Writes a scope part (prefix, preset, route, principal): `:`, `%` and `#`
/// percent-escaped, or the hash of the part when that is longer than
/// [`MAX_PART_LEN`].
pub(super) fn push_part(out: &mut String, part: &str) {
    let escapes = part.bytes().filter(|b| needs_escape(*b)).count();
    if part.len() + 2 * escapes > MAX_PART_LEN {
        push_hash(out, part);
    } else if escapes == 0 {
        out.push_str(part);
    } else {
        escape_into(out, part);
    }
}

/// Writes the key itself, the last part: as given, unless it is longer than
/// [`MAX_PART_LEN`] or starts with `#`, when it is hashed (so a given key can
/// never look like the hash of another).
pub(super) fn push_key(out: &mut String, key: &str) {
    if key.len() > MAX_PART_LEN || key.starts_with('#') {
        push_hash(out, key);
    } else {
        out.push_str(key);
    }
}

fn needs_escape(b: u8) -> bool {
    matches!(b, b':' | b'%' | b'#')
}

/// `:`, `%` and `#` percent-escaped, so that parts joined with `:` cannot run
/// together and no part looks like a hash.
pub(super) fn escape_into(out: &mut String, part: &str) {
    for c in part.chars() {
        match c {
            ':' => out.push_str("%3A"),
            '%' => out.push_str("%25"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
}

fn push_hash(out: &mut String, part: &str) {
    use std::fmt::Write;
    out.push('#');
    for b in Fingerprint::of(part.as_bytes()).to_bytes() {
        let _ = write!(out, "{b:02x}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(s: &str) -> String {
        let mut out = String::new();
        push_part(&mut out, s);
        out
    }

    #[test]
    fn parts_are_escaped_or_hashed() {
        assert_eq!(part("a:b%c#d"), "a%3Ab%25c%23d");
        let long = part(&"y".repeat(MAX_PART_LEN + 1));
        assert_eq!(long.len(), 33);
        assert!(long.starts_with('#'));
        // Escaping counts towards the limit.
        assert!(part(&":".repeat(MAX_PART_LEN / 2)).starts_with('#'));
        assert_eq!(part(&"z".repeat(MAX_PART_LEN)).len(), MAX_PART_LEN);
    }

    #[test]
    fn keys_that_look_like_hashes_are_hashed() {
        let mut hashed = String::new();
        push_key(&mut hashed, &"k".repeat(MAX_PART_LEN + 1));
        let mut given = String::new();
        push_key(&mut given, &hashed);
        assert_ne!(hashed, given);
        let mut plain = String::new();
        push_key(&mut plain, "evt_1:x");
        assert_eq!(plain, "evt_1:x");
    }
}
