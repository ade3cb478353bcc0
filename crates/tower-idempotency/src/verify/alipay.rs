//! Alipay: RSA2 (SHA256withRSA) over the sorted notification parameters.

use super::keys::{SigningKeyError, RsaPublicKey};
use super::pairs::check_pair;
use super::{base64_sig, Verified, Verifier, VerifyError};
use crate::key::{parse_form_strict, FormField};
use bytes::Bytes;
use http::request::Parts;
use std::fmt;
use std::time::SystemTime;

/// The Alipay public keys of an application.
///
/// The signed content is built as the official SDKs build it
/// (`AlipaySignature.getSignCheckContentV1` in alipay-sdk-java,
/// `checkNotifySign` in alipay-sdk-nodejs-all): every parameter except
/// `sign` and `sign_type`, **empty values included** (`k=`), sorted by name,
/// decoded, as `k=v&…`, in the bytes of the body's `charset` (UTF-8, GBK,
/// GB2312 or GB18030; UTF-8 when absent) — the "V1" check, used for payment
/// notifications. Some notifications (e.g. service market orders) are signed
/// with `sign_type` kept (the "V2" check); like the SDKs, a signature that
/// fails the first is tried against the second. Only `RSA2` is accepted.
///
/// A body two readers could read differently is refused before the
/// signature is checked: a repeated parameter, a segment that is no
/// `name=value` pair, a value that does not decode in the declared charset,
/// an unknown charset, more than [`MAX_FIELDS`](crate::key::MAX_FIELDS)
/// parameters. So is a decoded name holding `&` or `=`, or a decoded value
/// holding `&` and after it `=` (`notify_id=N%26notify_time%3DT`): the signed
/// string would read a field boundary there, and one signature would stand
/// for two sets of parameters (another `notify_id`, another key).
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
    pub fn public_key(mut self, key: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
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

fn content(params: &[FormField], keep_sign_type: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for field in params {
        if field.name == "sign" || (field.name == "sign_type" && !keep_sign_type) {
            continue;
        }
        if !out.is_empty() {
            out.push(b'&');
        }
        out.extend_from_slice(field.name.as_bytes());
        out.push(b'=');
        out.extend_from_slice(&field.raw);
    }
    out
}

impl Verifier for AlipayKeys {
    fn verify(&self, _parts: &mut Parts, body: &Bytes, _now: SystemTime) -> Result<Verified, VerifyError> {
        let mut params = parse_form_strict(body).map_err(VerifyError::Malformed)?;
        // Every field but `sign` is signed (`sign_type` by the second check).
        for field in params.iter().filter(|f| f.name != "sign") {
            check_pair(&field.name, &field.raw)?;
        }
        params.sort_by(|a, b| a.name.cmp(&b.name));
        let find = |name: &str| {
            params
                .iter()
                .find(|f| f.name == name)
                .map(|f| f.value.as_str())
        };
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
        Ok(Verified::new("alipay", None))
    }

    fn channel(&self) -> &str {
        "alipay"
    }
}
