//! Adyen: HMAC-SHA256 of every notification item (`additionalData.hmacSignature`).

use super::keys::SigningKeyError;
use super::{base64_sig, Verified, Verifier, VerifyError};
use crate::key::unique_members;
use bytes::Bytes;
use http::request::Parts;
use ring::hmac;
use serde_json::Value;
use std::borrow::Cow;
use std::fmt;
use std::time::SystemTime;

/// The HMAC keys of an Adyen webhook.
///
/// Standard notifications (`notificationItems`) are verified item by item:
/// `base64(HMAC-SHA256(key, pspReference:originalReference:merchantAccountCode:merchantReference:value:currency:eventCode:success))`
/// must equal the item's `additionalData.hmacSignature`, for every item.
/// Platform webhooks (no `notificationItems`) are verified over the raw body
/// with the `HmacSignature` header.
///
/// A body that readers could read differently is refused before any of it
/// is trusted: a repeated member name in any object (JSON readers keep the
/// first or the last), an object or array where a signed field is expected.
///
/// ```
/// use tower_idempotency::verify::AdyenKeys;
/// let keys = AdyenKeys::new()
///     .hmac_key("74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174").unwrap();
/// assert!(AdyenKeys::new().hmac_key("not hex").is_err());
/// # let _ = keys;
/// ```
#[derive(Clone, Default)]
pub struct AdyenKeys {
    keys: Vec<hmac::Key>,
}

impl AdyenKeys {
    /// No keys yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an HMAC key as shown in the Customer Area (hex). Add the old and
    /// the new one while rotating.
    pub fn hmac_key(mut self, hex_key: &str) -> Result<Self, SigningKeyError> {
        let key = hex::decode(hex_key.trim())
            .map_err(|_| SigningKeyError::new("Adyen HMAC key: expected hex digits"))?;
        self.keys.push(hmac::Key::new(hmac::HMAC_SHA256, &key));
        Ok(self)
    }

    fn any_key(&self, message: &[u8], tag: &[u8]) -> bool {
        self.keys.iter().any(|k| hmac::verify(k, message, tag).is_ok())
    }
}

impl fmt::Debug for AdyenKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdyenKeys")
            .field("keys", &self.keys.len())
            .finish()
    }
}

/// A field of an item as text; absent fields sign as empty; an object or
/// array where a field is expected is refused.
fn text(item: &Value, pointer: &str) -> Result<String, VerifyError> {
    Ok(match item.pointer(pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(Value::Object(_) | Value::Array(_)) => {
            return Err(VerifyError::Malformed(Cow::Owned(format!(
                "an object where the field {pointer} is expected"
            ))))
        }
        Some(other) => other.to_string(),
    })
}

fn signing_string(item: &Value) -> Result<String, VerifyError> {
    Ok([
        "/pspReference",
        "/originalReference",
        "/merchantAccountCode",
        "/merchantReference",
        "/amount/value",
        "/amount/currency",
        "/eventCode",
        "/success",
    ]
    .iter()
    .map(|p| text(item, p))
    .collect::<Result<Vec<_>, _>>()?
    .join(":"))
}

impl Verifier for AdyenKeys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, _now: SystemTime) -> Result<Verified, VerifyError> {
        // One reading for every reader: a repeated member (two
        // `notificationItems`, two `pspReference`) is refused before anything
        // is read from the body.
        unique_members(body).map_err(|e| VerifyError::Malformed(Cow::Owned(format!("JSON body: {e}"))))?;
        let json: Value = serde_json::from_slice(body)
            .map_err(|_| VerifyError::Malformed(Cow::Borrowed("JSON body")))?;
        let Some(items) = json.get("notificationItems") else {
            let sig = super::header(parts, "hmacsignature")?;
            let sig = base64_sig(sig)?;
            if !self.any_key(body, &sig) {
                return Err(VerifyError::BadSignature);
            }
            return Ok(Verified::new("adyen", None));
        };
        let items = items
            .as_array()
            .filter(|items| !items.is_empty())
            .ok_or(VerifyError::Missing("notificationItems"))?;
        for wrapper in items {
            let item = wrapper
                .get("NotificationRequestItem")
                .ok_or(VerifyError::Missing("NotificationRequestItem"))?;
            let sig = item
                .pointer("/additionalData/hmacSignature")
                .and_then(Value::as_str)
                .ok_or(VerifyError::Missing("additionalData.hmacSignature"))?;
            let sig = base64_sig(sig)?;
            if !self.any_key(signing_string(item)?.as_bytes(), &sig) {
                return Err(VerifyError::BadSignature);
            }
        }
        Ok(Verified::new("adyen", None))
    }

    fn channel(&self) -> &str {
        "adyen"
    }
}
