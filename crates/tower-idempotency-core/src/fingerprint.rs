//! [`Fingerprint`]: a short hash of what a request means, compared between a
//! stored record and a repeat of its key.
//!
//! ```
//! use tower_idempotency::Fingerprint;
//! let a = Fingerprint::of(b"order 42, 100 CNY");
//! assert_eq!(a, Fingerprint::from_bytes(a.to_bytes()));
//! assert_ne!(a, Fingerprint::of(b"order 42, 1 CNY"));
//! ```

use http::request::Parts;
use sha2::{Digest, Sha256};
use std::fmt;

/// A hash of the fields that define a request's meaning (16 bytes of SHA-256).
///
/// Two copies of one notification have the same fingerprint; a request that
/// reuses a key with another payload has another.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// The fingerprint of some bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_digest(Sha256::new_with_prefix(bytes))
    }

    /// The fingerprint of a client request: method, path, query and body.
    ///
    /// The path is taken in its normal form, so `/orders/1`, `/orders/%31`
    /// and `/orders/1/` are one request; the query is taken as sent (no query
    /// and an empty one are the same), so `?amount=1` and `?amount=1000` are
    /// two requests, and so are two orders of the same parameters.
    ///
    /// ```
    /// use tower_idempotency::Fingerprint;
    /// let fp = |uri: &str| {
    ///     let (parts, _) = http::Request::post(uri).body(()).unwrap().into_parts();
    ///     Fingerprint::of_request(&parts, b"{}")
    /// };
    /// assert_eq!(fp("/pay?amount=1"), fp("//pay/?amount=1"));
    /// assert_ne!(fp("/pay?amount=1"), fp("/pay?amount=1000"));
    /// assert_eq!(fp("/pay"), fp("/pay?"));
    /// ```
    pub fn of_request(parts: &Parts, body: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(parts.method.as_str().as_bytes());
        h.update([0]);
        h.update(crate::path::normalize(parts.uri.path()).as_bytes());
        h.update([0]);
        let query = parts.uri.query().unwrap_or("");
        // Length-prefixed: the query may hold any byte the body starts with.
        h.update((query.len() as u64).to_le_bytes());
        h.update(query.as_bytes());
        h.update(body);
        Self::from_digest(h)
    }

    /// This fingerprint with `extra` folded in.
    pub fn with_extra(self, extra: &[u8]) -> Self {
        let mut h = Sha256::new_with_prefix(self.0);
        h.update(extra);
        Self::from_digest(h)
    }

    /// The fingerprint of some fields, in order, each present with its
    /// value or absent: length-prefixed, so that `("ab", "c")` and
    /// `("a", "bc")` differ, and an absent field differs from an empty one.
    ///
    /// ```
    /// use tower_idempotency::Fingerprint;
    /// let fp = |fields: &[Option<&str>]| Fingerprint::of_fields(fields.iter().map(|f| f.map(str::as_bytes)));
    /// assert_ne!(fp(&[Some("ab"), Some("c")]), fp(&[Some("a"), Some("bc")]));
    /// assert_ne!(fp(&[None]), fp(&[Some("")]));
    /// ```
    pub fn of_fields<F: AsRef<[u8]>>(fields: impl IntoIterator<Item = Option<F>>) -> Self {
        let mut h = Sha256::new();
        for field in fields {
            match field {
                Some(v) => {
                    let v = v.as_ref();
                    h.update((v.len() as u64).to_le_bytes());
                    h.update(v);
                }
                None => h.update(u64::MAX.to_le_bytes()),
            }
        }
        Self::from_digest(h)
    }

    fn from_digest(h: Sha256) -> Self {
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Self(out)
    }

    /// The raw bytes, for stores that persist them.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// Rebuilds a fingerprint from [`to_bytes`](Self::to_bytes).
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}
