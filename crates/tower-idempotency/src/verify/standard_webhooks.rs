//! Standard Webhooks: `webhook-id.webhook-timestamp.body`, `v1,` HMAC-SHA256
//! or `v1a,` Ed25519.

use super::keys::{base64_key, SigningKeyError};
use super::{
    any_mac_matches, base64_sig, check_timestamp, header, too_many_signatures, Verified, Verifier,
    VerifyError, MAX_SIGNATURES,
};
use bytes::Bytes;
use http::request::Parts;
use ring::hmac;
use ring::signature::{UnparsedPublicKey, ED25519};
use std::fmt;
use std::time::{Duration, SystemTime};

/// The secrets and public keys of a Standard Webhooks endpoint.
///
/// ```
/// use tower_idempotency::verify::StandardWebhooksKeys;
/// let keys = StandardWebhooksKeys::new()
///     .secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
/// assert!(StandardWebhooksKeys::new().secret("whsec_%%%").is_err());
/// # let _ = keys;
/// ```
#[derive(Clone)]
pub struct StandardWebhooksKeys {
    secrets: Vec<hmac::Key>,
    public_keys: Vec<Vec<u8>>,
    tolerance: Duration,
}

impl StandardWebhooksKeys {
    /// No keys yet; a tolerance of 5 minutes.
    pub fn new() -> Self {
        Self {
            secrets: Vec::new(),
            public_keys: Vec::new(),
            tolerance: Duration::from_secs(300),
        }
    }

    /// Adds a symmetric secret, `whsec_` followed by base64 (`v1,` signatures).
    pub fn secret(mut self, secret: &str) -> Result<Self, SigningKeyError> {
        let raw = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = base64_key("webhook secret", raw)?;
        self.secrets.push(hmac::Key::new(hmac::HMAC_SHA256, &key));
        Ok(self)
    }

    /// Adds an Ed25519 public key, `whpk_` followed by base64 of the 32 bytes
    /// (`v1a,` signatures).
    pub fn public_key(mut self, key: &str) -> Result<Self, SigningKeyError> {
        let raw = key.strip_prefix("whpk_").unwrap_or(key);
        let key = base64_key("webhook public key", raw)?;
        if key.len() != 32 {
            return Err(SigningKeyError::new("webhook public key: expected 32 bytes"));
        }
        self.public_keys.push(key);
        Ok(self)
    }

    /// How far `webhook-timestamp` may lie from now. Defaults to 5 minutes.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }
}

impl Default for StandardWebhooksKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for StandardWebhooksKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StandardWebhooksKeys")
            .field("secrets", &self.secrets.len())
            .field("public_keys", &self.public_keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Verifier for StandardWebhooksKeys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, now: SystemTime) -> Result<Verified, VerifyError> {
        let id = header(parts, "webhook-id")?;
        let timestamp = header(parts, "webhook-timestamp")?;
        let signatures = header(parts, "webhook-signature")?;
        // At most MAX_SIGNATURES entries, decoded before any MAC or
        // signature check; then one MAC per secret, compared with each `v1,`
        // candidate, as the Standard Webhooks libraries do.
        let mut symmetric = Vec::new();
        let mut asymmetric = Vec::new();
        let mut entries = 0usize;
        for entry in signatures.split(' ').filter(|e| !e.is_empty()) {
            entries += 1;
            if entries > MAX_SIGNATURES {
                return Err(too_many_signatures());
            }
            match entry.split_once(',') {
                Some(("v1", sig)) => symmetric.push(base64_sig(sig)?),
                Some(("v1a", sig)) => asymmetric.push(base64_sig(sig)?),
                _ => {}
            }
        }
        check_timestamp(timestamp, now, self.tolerance)?;
        let mut message = Vec::with_capacity(id.len() + timestamp.len() + body.len() + 2);
        message.extend_from_slice(id.as_bytes());
        message.push(b'.');
        message.extend_from_slice(timestamp.as_bytes());
        message.push(b'.');
        message.extend_from_slice(body);
        let ok = any_mac_matches(&self.secrets, &message, &symmetric)
            || asymmetric.iter().any(|sig| {
                self.public_keys.iter().any(|key| {
                    UnparsedPublicKey::new(&ED25519, key)
                        .verify(&message, sig)
                        .is_ok()
                })
            });
        if ok {
            return Ok(Verified::new("standard-webhooks", None));
        }
        Err(VerifyError::BadSignature)
    }

    fn channel(&self) -> &str {
        "standard-webhooks"
    }
}
