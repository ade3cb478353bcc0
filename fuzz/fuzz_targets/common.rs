//! What every key-extraction target checks: no panic, the same answer twice,
//! a non-empty key, and a stored key within its bound.

use bytes::Bytes;
use http::request::Parts;
use tower_idempotency::key::{ExtractKey, MAX_STORED_KEY_LEN};
use tower_idempotency::{Fingerprint, IdempotencyKey};

/// Splits `data` at the first `sep`: (head, rest); no `sep` means no head.
pub fn split<'a>(data: &'a [u8], sep: &[u8]) -> (&'a [u8], &'a [u8]) {
    match data.windows(sep.len()).position(|w| w == sep) {
        Some(i) => (&data[..i], &data[i + sep.len()..]),
        None => (&[], data),
    }
}

/// A POST with the header lines `name: value` of `head`; lines that are not
/// a valid header are skipped.
pub fn parts_with_headers(head: &[u8]) -> Parts {
    let mut req = http::Request::post("/orders/%31/").body(()).unwrap();
    for line in head.split(|&b| b == b'\n') {
        let (name, value) = split(line, b":");
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name),
            http::HeaderValue::from_bytes(value.trim_ascii()),
        ) else {
            continue;
        };
        req.headers_mut().append(name, value);
    }
    req.into_parts().0
}

/// Runs `extractor` and checks what it answers.
pub fn check(extractor: &dyn ExtractKey, parts: &Parts, body: &Bytes) {
    let first = extractor.extract(parts, body);
    assert_eq!(first, extractor.extract(parts, body), "not deterministic");
    if let Ok(Some(found)) = first {
        assert!(!found.key.is_empty(), "empty key accepted");
        let stored = IdempotencyKey::new(
            "idem",
            "fuzz".into(),
            parts.uri.path(),
            Some(&found.key),
            &found.key,
            Fingerprint::of(b""),
        );
        assert!(stored.as_str().len() <= MAX_STORED_KEY_LEN);
    }
}
