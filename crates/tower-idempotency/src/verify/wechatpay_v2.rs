//! WeChat Pay API v2: the `sign` field, MD5 or HMAC-SHA256 with the API key.

use super::keys::SigningKeyError;
use super::pairs::check_pair;
use super::{Verified, Verifier, VerifyError};
use crate::key::flat_fields;
use bytes::Bytes;
use http::request::Parts;
use md5::{Digest, Md5};
use ring::hmac;
use std::borrow::Cow;
use std::fmt;
use std::time::SystemTime;
use subtle::ConstantTimeEq;

/// The API keys of a WeChat Pay v2 merchant.
///
/// The string signed is every non-empty field except `sign` (WeChat Pay's
/// rule: empty values are not signed), sorted by name,
/// as `k=v&…&key=API_KEY`; `sign_type` `HMAC-SHA256` selects HMAC-SHA256 with
/// the API key, anything else (or none) MD5 (a 64-digit `sign` without
/// `sign_type` is taken as HMAC-SHA256). MD5 is only here because the channel
/// still signs with it; prefer HMAC-SHA256 where the merchant can choose.
///
/// A signed value holding `&` and after it `=` (`SUCCESS&total_fee=1`) is
/// refused: the signed string would read a field boundary there, and one
/// `sign` would stand for two sets of fields. So is a body of more than
/// [`MAX_FIELDS`](crate::key::MAX_FIELDS) fields.
///
/// ```
/// use tower_idempotency::verify::WechatPayV2Keys;
/// let keys = WechatPayV2Keys::new().api_key("192006250b4c09247ec02edce69f6a2d")?;
/// assert!(WechatPayV2Keys::new().api_key("").is_err());
/// # let _ = keys;
/// # Ok::<(), tower_idempotency::verify::SigningKeyError>(())
/// ```
#[derive(Clone, Default)]
pub struct WechatPayV2Keys {
    keys: Vec<Vec<u8>>,
}

impl WechatPayV2Keys {
    /// No keys yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an API key (32 characters). Add the old and the new one while
    /// changing it. An empty key is an error (anyone could sign with it).
    pub fn api_key(mut self, key: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
        let key = key.as_ref();
        if key.is_empty() {
            return Err(SigningKeyError::new("the WeChat Pay v2 API key is empty"));
        }
        self.keys.push(key.to_vec());
        Ok(self)
    }
}

impl fmt::Debug for WechatPayV2Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WechatPayV2Keys")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Verifier for WechatPayV2Keys {
    fn verify(&self, _parts: &mut Parts, body: &Bytes, _now: SystemTime) -> Result<Verified, VerifyError> {
        // The same strict parse the key reads: a body with a nested element,
        // a repeated field, stray text or a second root is refused.
        let mut fields = flat_fields(body).map_err(VerifyError::Malformed)?;
        let sign = fields
            .iter()
            .find(|(k, _)| k == "sign")
            .map(|(_, v)| v.clone())
            .ok_or(VerifyError::Missing("sign"))?;
        let sign = hex::decode(&sign).map_err(|_| VerifyError::Malformed(Cow::Borrowed("sign")))?;
        let hmac_sha256 = match fields.iter().find(|(k, _)| k == "sign_type") {
            Some((_, t)) => t.eq_ignore_ascii_case("HMAC-SHA256"),
            None => sign.len() == 32,
        };
        fields.retain(|(k, v)| k != "sign" && !v.is_empty());
        for (k, v) in &fields {
            check_pair(k, v.as_bytes())?;
        }
        fields.sort();
        let mut content = Vec::with_capacity(body.len());
        for (k, v) in &fields {
            content.extend_from_slice(k.as_bytes());
            content.push(b'=');
            content.extend_from_slice(v.as_bytes());
            content.push(b'&');
        }
        content.extend_from_slice(b"key=");
        let ok = self.keys.iter().any(|key| {
            let mut signed = content.clone();
            signed.extend_from_slice(key);
            if hmac_sha256 {
                let key = hmac::Key::new(hmac::HMAC_SHA256, key);
                hmac::verify(&key, &signed, &sign).is_ok()
            } else {
                let digest = Md5::digest(&signed);
                digest.as_slice().ct_eq(&sign).into()
            }
        });
        if !ok {
            return Err(VerifyError::BadSignature);
        }
        Ok(Verified::new("wechatpay-v2", None))
    }

    fn channel(&self) -> &str {
        "wechatpay-v2"
    }
}
