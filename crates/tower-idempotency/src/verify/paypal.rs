//! PayPal: SHA256withRSA over `transmission_id|time|webhook_id|crc32(body)`.

use super::keys::{SigningKeyError, RsaPublicKey};
use super::{base64_sig, check_time, header, Verified, Verifier, VerifyError};
use crate::key::unique_members;
use bytes::Bytes;
use http::request::Parts;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The most transmission ids remembered at once (only verified ones are).
const MAX_SEEN: u64 = 200_000;

/// The webhook id and signing certificates of a PayPal webhook.
///
/// The certificate is configured, never downloaded: fetch the one named by
/// the `PAYPAL-CERT-URL` header once (it must be served by a `paypal.com`
/// host) and configure it; add the next one before PayPal rotates. Its
/// expiry and chain are not checked here.
///
/// `PAYPAL-TRANSMISSION-TIME` must lie within the [`tolerance`](Self::tolerance)
/// of now (5 minutes by default: PayPal signs every HTTP transmission, a
/// retry included, at the time it sends it), and a verified
/// `PAYPAL-TRANSMISSION-ID` is single-use for twice the tolerance, so a
/// captured transmission cannot be replayed (the ids are kept in memory, per
/// process: a fleet behind a load balancer relies on the idempotency record
/// for copies that reach another instance).
///
/// **The signature binds the body weakly**: PayPal signs a CRC32 of the
/// body, not a cryptographic hash, and 4 to 6 chosen bytes make any body
/// match a given CRC32. Take the event id (`/id`) from a verified body, but
/// fetch the amounts and the state from PayPal by that id
/// (`GET /v1/notifications/webhooks-events/{id}` or the resource's own
/// link) before acting on them.
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
    tolerance: Duration,
    /// The verified transmission ids of the last two tolerances.
    seen: moka::sync::Cache<Arc<str>, ()>,
}

fn seen_cache(tolerance: Duration) -> moka::sync::Cache<Arc<str>, ()> {
    moka::sync::Cache::builder()
        .max_capacity(MAX_SEEN)
        .time_to_live(tolerance.saturating_mul(2).max(Duration::from_secs(1)))
        .build()
}

impl PayPalKeys {
    /// The keys of the webhook `webhook_id` (shown in the developer
    /// dashboard); no certificate yet.
    pub fn new(webhook_id: impl Into<Arc<str>>) -> Self {
        let tolerance = Duration::from_secs(300);
        Self {
            webhook_id: webhook_id.into(),
            certs: Vec::new(),
            tolerance,
            seen: seen_cache(tolerance),
        }
    }

    /// How far `PAYPAL-TRANSMISSION-TIME` may lie from now; transmission ids
    /// are remembered for twice as long. Defaults to 5 minutes.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self.seen = seen_cache(tolerance);
        self
    }

    /// Adds a signing certificate (PEM or DER) or its public key.
    pub fn certificate(mut self, pem_or_der: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
        self.certs.push(RsaPublicKey::from_pem_or_der(pem_or_der)?);
        Ok(self)
    }
}

impl fmt::Debug for PayPalKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PayPalKeys")
            .field("webhook_id", &self.webhook_id)
            .field("certs", &self.certs.len())
            .field("tolerance", &self.tolerance)
            .finish_non_exhaustive()
    }
}

impl Verifier for PayPalKeys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, now: SystemTime) -> Result<Verified, VerifyError> {
        let id = header(parts, "paypal-transmission-id")?;
        let time = header(parts, "paypal-transmission-time")?;
        let sig = header(parts, "paypal-transmission-sig")?;
        if let Ok(algo) = header(parts, "paypal-auth-algo")
            && !algo.eq_ignore_ascii_case("SHA256withRSA") {
                return Err(VerifyError::Malformed(Cow::Borrowed(
                    "PAYPAL-AUTH-ALGO (only SHA256withRSA is accepted)",
                )));
            }
        let at = humantime::parse_rfc3339_weak(time.trim())
            .map_err(|_| VerifyError::Malformed(Cow::Borrowed("PAYPAL-TRANSMISSION-TIME")))?;
        check_time(at, now, self.tolerance)?;
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
        // The CRC32 binds the body weakly: at least let every reader read
        // the same event (a repeated `id` or `event_type` would be read
        // first by the key and last by most upstreams).
        unique_members(body).map_err(|e| {
            VerifyError::Malformed(Cow::Owned(format!("JSON body: {e}")))
        })?;
        // Single-use: the first verified copy of a transmission inserts it.
        let first = self.seen.entry(Arc::from(id)).or_insert(()).is_fresh();
        if !first {
            return Err(VerifyError::Replayed);
        }
        Ok(Verified::new("paypal", None))
    }

    fn channel(&self) -> &str {
        "paypal"
    }
}
