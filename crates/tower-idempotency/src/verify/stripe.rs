//! Stripe: `Stripe-Signature: t=…,v1=…`, HMAC-SHA256 over `t.body`.

use super::keys::SigningKeyError;
use super::{
    any_mac_matches, check_timestamp, header, too_many_signatures, Verified, Verifier, VerifyError,
    MAX_SIGNATURES,
};
use bytes::Bytes;
use http::request::Parts;
use ring::hmac;
use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime};

/// The signing secrets of a Stripe endpoint.
///
/// ```
/// use tower_idempotency::verify::StripeKeys;
/// let keys = StripeKeys::new().secret("whsec_old")?.secret("whsec_new")?;
/// assert_eq!(keys.len(), 2);
/// assert!(StripeKeys::new().secret("").is_err());
/// # Ok::<(), tower_idempotency::verify::SigningKeyError>(())
/// ```
#[derive(Clone)]
pub struct StripeKeys {
    secrets: Vec<hmac::Key>,
    tolerance: Duration,
}

impl StripeKeys {
    /// No secrets yet; a tolerance of 300 seconds (Stripe's own default).
    pub fn new() -> Self {
        Self {
            secrets: Vec::new(),
            tolerance: Duration::from_secs(300),
        }
    }

    /// Adds an endpoint signing secret (`whsec_…`, used as is, prefix
    /// included, as Stripe does). Add the old and the new one while rolling.
    /// An empty secret is an error (anyone could sign with it).
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(SigningKeyError::new("the Stripe signing secret is empty"));
        }
        self.secrets.push(hmac::Key::new(hmac::HMAC_SHA256, secret));
        Ok(self)
    }

    /// How far `t=` may lie from now. Defaults to 300 seconds.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// How many secrets are configured.
    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    /// Whether no secret is configured.
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }
}

impl Default for StripeKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for StripeKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StripeKeys")
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Verifier for StripeKeys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, now: SystemTime) -> Result<Verified, VerifyError> {
        let value = header(parts, "stripe-signature")?;
        let mut timestamp = None;
        let mut signatures: Vec<&str> = Vec::new();
        for item in value.split(',') {
            match item.trim().split_once('=') {
                Some(("t", t)) => timestamp = Some(t),
                Some(("v1", sig)) => {
                    if signatures.len() == MAX_SIGNATURES {
                        return Err(too_many_signatures());
                    }
                    signatures.push(sig);
                }
                _ => {}
            }
        }
        let timestamp = timestamp.ok_or(VerifyError::Missing("t= in Stripe-Signature"))?;
        if signatures.is_empty() {
            return Err(VerifyError::Missing("v1= in Stripe-Signature"));
        }
        let signatures = signatures
            .into_iter()
            .map(|sig| {
                hex::decode(sig).map_err(|_| VerifyError::Malformed(Cow::Borrowed("v1 signature")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        check_timestamp(timestamp, now, self.tolerance)?;
        let mut message = Vec::with_capacity(timestamp.len() + 1 + body.len());
        message.extend_from_slice(timestamp.as_bytes());
        message.push(b'.');
        message.extend_from_slice(body);
        // One MAC per secret, compared (constant time) with every candidate,
        // as stripe-go does.
        if !any_mac_matches(&self.secrets, &message, &signatures) {
            return Err(VerifyError::BadSignature);
        }
        Ok(Verified::new("stripe", None))
    }

    fn channel(&self) -> &str {
        "stripe"
    }
}
