//! PayPal: SHA256withRSA over `transmission_id|time|webhook_id|crc32(body)`.

use super::keys::{KeyError, RsaPublicKey};
use super::{base64_sig, header, Verified, Verifier, VerifyError};
use bytes::Bytes;
use http::request::Parts;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

/// The webhook id and signing certificates of a PayPal webhook.
///
/// The certificate is configured, never downloaded: fetch the one named by
/// the `PAYPAL-CERT-URL` header once (it must be served by a `paypal.com`
/// host) and configure it; add the next one before PayPal rotates. Its
/// expiry and chain are not checked here.
///
/// ```
/// use tower_idempotency::verify::PayPalKeys;
/// let pem = std::fs::read("tests/fixtures/paypal_cert_ValidateCertTest.pem").unwrap();
/// let keys = PayPalKeys::new("0FV983392A0531201").certificate(&pem).unwrap();
/// # let _ = keys;
/// ```
#[derive(Clone)]
pub struct PayPalKeys {
    webhook_id: Arc<str>,
    certs: Vec<RsaPublicKey>,
}

impl PayPalKeys {
    /// The keys of the webhook `webhook_id` (shown in the developer
    /// dashboard); no certificate yet.
    pub fn new(webhook_id: impl Into<Arc<str>>) -> Self {
        Self {
            webhook_id: webhook_id.into(),
            certs: Vec::new(),
        }
    }

    /// Adds a signing certificate (PEM or DER) or its public key.
    pub fn certificate(mut self, pem_or_der: impl AsRef<[u8]>) -> Result<Self, KeyError> {
        self.certs.push(RsaPublicKey::from_pem_or_der(pem_or_der)?);
        Ok(self)
    }
}

impl fmt::Debug for PayPalKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PayPalKeys")
            .field("webhook_id", &self.webhook_id)
            .field("certs", &self.certs.len())
            .finish()
    }
}

impl Verifier for PayPalKeys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, _now: SystemTime) -> Result<Verified, VerifyError> {
        let id = header(parts, "paypal-transmission-id")?;
        let time = header(parts, "paypal-transmission-time")?;
        let sig = header(parts, "paypal-transmission-sig")?;
        if let Ok(algo) = header(parts, "paypal-auth-algo") {
            if !algo.eq_ignore_ascii_case("SHA256withRSA") {
                return Err(VerifyError::Malformed(Cow::Borrowed(
                    "PAYPAL-AUTH-ALGO (only SHA256withRSA is accepted)",
                )));
            }
        }
        let sig = base64_sig(sig)?;
        let message = format!(
            "{id}|{time}|{}|{}",
            self.webhook_id,
            crc32fast::hash(body)
        );
        if !self
            .certs
            .iter()
            .any(|cert| cert.verify_sha256(message.as_bytes(), &sig))
        {
            return Err(VerifyError::BadSignature);
        }
        Ok(Verified::new(self.channel(), None))
    }

    fn channel(&self) -> &'static str {
        "paypal"
    }
}
