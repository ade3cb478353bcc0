//! Alipay: RSA2 (SHA256withRSA) over the sorted notification parameters.

use super::keys::{KeyError, RsaPublicKey};
use super::{base64_sig, Verified, Verifier, VerifyError};
use crate::key::decode_form;
use bytes::Bytes;
use http::request::Parts;
use std::fmt;
use std::time::SystemTime;

/// The Alipay public keys of an application.
///
/// The signed content is every non-empty parameter except `sign` and
/// `sign_type`, sorted by name, decoded, as `k=v&…` (the SDKs' "V1" check,
/// used for payment notifications). Some notifications (e.g. service market
/// orders) are signed with `sign_type` kept (the "V2" check); like the SDKs,
/// a signature that fails the first is tried against the second. Only `RSA2`
/// is accepted.
///
/// ```
/// use tower_idempotency::verify::AlipayKeys;
/// let pem = std::fs::read("tests/fixtures/alipay_public_key_trade_status_sync.pem").unwrap();
/// let keys = AlipayKeys::new().public_key(&pem).unwrap();
/// # let _ = keys;
/// ```
#[derive(Clone, Default)]
pub struct AlipayKeys {
    keys: Vec<RsaPublicKey>,
}

impl AlipayKeys {
    /// No keys yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an Alipay public key: PEM, DER, or the bare base64 string the
    /// console shows. Add the old and the new one while rotating.
    pub fn public_key(mut self, key: impl AsRef<[u8]>) -> Result<Self, KeyError> {
        self.keys.push(RsaPublicKey::from_pem_or_der(key)?);
        Ok(self)
    }
}

impl fmt::Debug for AlipayKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlipayKeys")
            .field("keys", &self.keys.len())
            .finish()
    }
}

fn content(params: &[(String, String)], keep_sign_type: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in params {
        if k == "sign" || (k == "sign_type" && !keep_sign_type) || v.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(b'&');
        }
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
    }
    out
}

impl Verifier for AlipayKeys {
    fn verify(&self, _parts: &mut Parts, body: &Bytes, _now: SystemTime) -> Result<Verified, VerifyError> {
        let mut params: Vec<(String, String)> = Vec::new();
        for pair in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
            let (name, value) = match pair.iter().position(|&b| b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &pair[..0]),
            };
            params.push((decode_form(name).into_owned(), decode_form(value).into_owned()));
        }
        params.sort();
        let find = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
        let sign = find("sign").ok_or(VerifyError::Missing("sign"))?;
        if find("sign_type").is_some_and(|t| t != "RSA2") {
            return Err(VerifyError::Malformed("sign_type (only RSA2 is accepted)".into()));
        }
        let sign = base64_sig(sign)?;
        let v1 = content(&params, false);
        let v2 = content(&params, true);
        let ok = self
            .keys
            .iter()
            .any(|key| key.verify_sha256(&v1, &sign) || key.verify_sha256(&v2, &sign));
        if !ok {
            return Err(VerifyError::BadSignature);
        }
        Ok(Verified::new(self.channel(), None))
    }

    fn channel(&self) -> &'static str {
        "alipay"
    }
}
