//! The verify layer: checks the sender's signature before anything touches
//! the store. The channel verifiers need the `verify` feature.
//!
//! A forged or stale notification is answered with the channel's failure
//! reply (status 401) and never claims a key, so a forged copy that reuses a
//! real notification id cannot hold the claim and delay the genuine one. Every
//! refusal is counted as the outcome `unverified` and logged with its reason
//! (never the secret, never the body). A verified request carries a
//! [`Verified`] marker in its extensions; a request that already carries one
//! when it reaches the layer (a notification verified when it was queued,
//! delivered later by the gateway's queue worker) is not checked again.
//!
//! One [`Verifier`] per channel, each built from that channel's keys:
//!
//! | channel | keys | what is checked |
//! |---|---|---|
//! | WeChat Pay v3 | [`WechatPayV3Keys`] | RSA-SHA256 over `timestamp\nnonce\nbody\n`, key by `Wechatpay-Serial`, 5 min window; optional AES-256-GCM decryption of `resource` |
//! | WeChat Pay v2 | [`WechatPayV2Keys`] | `sign`, MD5 or HMAC-SHA256 with the API key |
//! | Alipay | [`AlipayKeys`] | RSA2 over the sorted parameters |
//! | Stripe | [`StripeKeys`] | `Stripe-Signature` `t=`/`v1=` HMAC-SHA256, 300 s window |
//! | Standard Webhooks | [`StandardWebhooksKeys`] | `webhook-signature` `v1,` HMAC-SHA256 and `v1a,` Ed25519, 5 min window |
//! | Adyen | [`AdyenKeys`] | HMAC-SHA256 `additionalData.hmacSignature` of every item |
//! | any sender that signs with an HMAC (GitHub, Shopify, Slack, Paddle, Square…) | [`HmacScheme`] | HMAC-SHA1, -SHA256 or -SHA512 over a template of the body, a timestamp, headers and the URL; hex or base64, an optional prefix or `k=v` pairs; a tolerance on the timestamp |
//! | PayPal | [`PayPalKeys`] | CRC32 + RSA-SHA256 over the transmission fields, configured certificate, 5 min window, single-use transmission ids |
//!
//! Several keys may be configured for every channel, so keys rotate without
//! downtime: a signature is accepted if any configured key verifies it. All
//! comparisons of secrets and MACs are constant-time. Every method that adds
//! a key or secret returns `Result<Self, SigningKeyError>`: a key that cannot be
//! read, or an empty secret, is refused when the keys are built, not when the
//! first notification arrives.
//!
//! # Hostile input
//!
//! - **Bounded work**: a signature header lists at most [`MAX_SIGNATURES`]
//!   candidates (`Stripe-Signature` `v1=`, `webhook-signature` entries); a
//!   longer list is refused before any MAC is computed, and each secret's
//!   MAC is computed once and compared in constant time with every
//!   candidate. A timestamp the clock cannot hold is malformed.
//! - **One parse**: a signed body that two readers could read differently is
//!   refused: a JSON member repeated in any object (Adyen, PayPal), a
//!   repeated form parameter or a segment that is no `name=value` pair
//!   (Alipay), a repeated XML element, a nested element where a field's text
//!   is expected, text outside the fields or a second root (WeChat Pay v2).
//!   WeChat Pay v2 and Alipay keys are read by the verifier's own parser.
//! - **One field map per signed string**: Alipay and WeChat Pay v2 sign the
//!   decoded `k=v` pairs joined with `&`, so a decoded name holding `&` or
//!   `=`, or a value holding `&` and after it `=`, is refused: the signed
//!   string would read a field boundary there, and a genuine signature
//!   would also cover a rewrite that folds one field into another
//!   (`notify_id=N%26notify_time%3DT`: another `notify_id`, another key).
//! - **Bounded fields**: a signed body of more than [`MAX_FIELDS`] (256)
//!   fields is refused (form parameters, XML fields, members of one JSON
//!   object); duplicate checks are linear (a hash set), so a 64 KiB body of
//!   ten thousand fields costs about what a normal one does.
//! - **Nothing leaked**: the refusal's body is `signature invalid`, or the
//!   channel's own failure form once the preset's reply rewrites it (WeChat
//!   Pay's `FAIL`, Alipay's `fail`); the reason is logged with the request's
//!   `x-request-id`.
//!
//! The cryptography comes from [`ring`] (RSA PKCS#1 v1.5, HMAC, AES-256-GCM,
//! Ed25519: audited, constant-time, no open RustSec advisory for these
//! operations), `md-5` only for the legacy WeChat Pay v2 MD5 `sign`, and
//! `x509-cert` to read certificates and public keys from PEM or DER.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use std::time::{Duration, UNIX_EPOCH};
//! use tower::{service_fn, ServiceExt};
//! use tower_idempotency::verify::{StripeKeys, VerifyLayer};
//! use tower_idempotency::IdempotencyLayer;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let keys = StripeKeys::new().secret("whsec_test_secret").unwrap();
//! // The clock is injectable (tests with recorded notifications); it defaults
//! // to the system clock.
//! let verify = VerifyLayer::new(keys).clock(|| UNIX_EPOCH + Duration::from_secs(1_700_000_000));
//! let layer = IdempotencyLayer::stripe().verify(verify);
//! let svc = tower::Layer::layer(&layer, service_fn(|_req: Request<_>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::default()))
//! }));
//! let forged = Request::post("/notify/stripe")
//!     .header("stripe-signature", "t=1700000000,v1=00")
//!     .body(Full::new(Bytes::from_static(br#"{"id":"evt_1","type":"charge.succeeded"}"#)))
//!     .unwrap();
//! let res = svc.oneshot(forged).await.unwrap();
//! assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
//! # }
//! ```
//!
//! # Obtaining the keys
//!
//! - **WeChat Pay v3**: the platform certificates (download them with the
//!   "download platform certificates" API or `wechatpay-go`'s certificate
//!   downloader) or, for merchants on the newer scheme, the WeChat Pay public
//!   key and its id (`PUB_KEY_ID_…`) from the merchant platform ("API security").
//!   The key id is the `Wechatpay-Serial` header value. The APIv3 key is the
//!   32-byte key set in the same place.
//! - **WeChat Pay v2**: the API key (32 characters) set under "API security".
//! - **Alipay**: the "Alipay public key" (支付宝公钥) shown in the open platform
//!   console after uploading the application's public key; the bare base64
//!   string or a PEM file.
//! - **Stripe**: the endpoint's signing secret (`whsec_…`) in the dashboard's
//!   webhook endpoint page, or printed by `stripe listen`.
//! - **Standard Webhooks**: the `whsec_…` secret (symmetric) or the `whpk_…`
//!   public key (asymmetric) given by the sender for the endpoint.
//! - **Adyen**: the HMAC key (64 hex digits) generated in the Customer Area
//!   when editing the webhook.
//! - **PayPal**: the webhook id of the app's webhook (developer dashboard) and
//!   the certificate named by the `PAYPAL-CERT-URL` header, downloaded once and
//!   configured (no network call is made while verifying).
// Without the `verify` feature the channel types are absent: link to docs.rs.
#![cfg_attr(
    not(feature = "verify"),
    doc = "\n\n[`WechatPayV3Keys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.WechatPayV3Keys.html\n[`WechatPayV2Keys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.WechatPayV2Keys.html\n[`AlipayKeys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.AlipayKeys.html\n[`StripeKeys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.StripeKeys.html\n[`StandardWebhooksKeys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.StandardWebhooksKeys.html\n[`AdyenKeys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.AdyenKeys.html\n[`PayPalKeys`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.PayPalKeys.html\n[`HmacScheme`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/verify/struct.HmacScheme.html\n[`ring`]: https://docs.rs/ring"
)]

mod layer;
mod service;

pub use crate::key::MAX_FIELDS;
pub use layer::{Clock, VerifyLayer};
pub use service::{ResponseFuture, Verify, VerifyBody};

/// Declares the modules and types that need the `verify` feature.
macro_rules! with_crypto {
    ($($item:item)*) => {
        $(
            #[cfg(feature = "verify")]
            #[cfg_attr(docsrs, doc(cfg(feature = "verify")))]
            $item
        )*
    };
}

with_crypto! {
    mod adyen;
    mod alipay;
    mod keys;
    mod pairs;
    mod paypal;
    mod signature;
    mod standard_webhooks;
    mod stripe;
    mod wechatpay_v2;
    mod wechatpay_v3;

    pub use adyen::AdyenKeys;
    pub use alipay::AlipayKeys;
    pub use keys::{SigningKeyError, RsaPublicKey};
    pub use paypal::PayPalKeys;
    pub use signature::{
        BodyShape, HmacAlgorithm, HmacScheme, HmacSchemeBuilder, SecretEncoding,
        SignatureEncoding, SignedTemplate, TemplateError,
    };
    pub use standard_webhooks::StandardWebhooksKeys;
    pub use stripe::StripeKeys;
    pub use wechatpay_v2::WechatPayV2Keys;
    pub use wechatpay_v3::{DecryptedResource, WechatPayV3Keys};
}

use bytes::Bytes;
use http::request::Parts;
use std::borrow::Cow;
use std::fmt;
#[cfg(feature = "verify")]
use std::time::Duration;
use std::time::SystemTime;

/// Checks that a buffered request comes from the channel.
///
/// Implementations may add extensions to `parts` (for example the decrypted
/// WeChat Pay v3 resource, or extra fingerprint fields as a
/// [`FingerprintExtra`](crate::key::FingerprintExtra)).
pub trait Verifier: Send + Sync + 'static {
    /// Verifies the request at time `now`; `Ok` carries the id of the key
    /// that verified it, when the channel names one.
    fn verify(
        &self,
        parts: &mut Parts,
        body: &Bytes,
        now: SystemTime,
    ) -> Result<Verified, VerifyError>;

    /// The channel name used in logs: a built-in channel's name, or a
    /// configured preset's (any name).
    fn channel(&self) -> &str;

    /// Puts again into `parts` what [`verify`](Self::verify) read from a
    /// request it accepted earlier, when that request is handled again
    /// later (a queued notification delivered): its signature and
    /// timestamp are not checked again. WeChat Pay v3 with an APIv3 key
    /// decrypts its resource into a [`DecryptedResource`] (not the
    /// fingerprint's extra fields). Nothing by default.
    fn reopen(&self, parts: &mut Parts, body: &Bytes) -> Result<(), VerifyError> {
        let _ = (parts, body);
        Ok(())
    }
}

/// The marker a verified request carries in its extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    channel: Cow<'static, str>,
    key_id: Option<String>,
}

impl Verified {
    /// A marker for `channel` (a built-in channel's `&'static str`, or a
    /// configured preset's name), naming the key when the channel names one.
    pub fn new(channel: impl Into<Cow<'static, str>>, key_id: Option<String>) -> Self {
        Self {
            channel: channel.into(),
            key_id,
        }
    }

    /// The channel whose signature was checked.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The id of the key that verified the request (WeChat Pay v3 serial),
    /// when the channel names one.
    pub fn key_id(&self) -> Option<&str> {
        self.key_id.as_deref()
    }
}

/// Why a request was refused. Never holds a secret or the body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerifyError {
    /// A header or field the channel always sends is absent.
    Missing(&'static str),
    /// A header or field could not be read.
    Malformed(Cow<'static, str>),
    /// No configured key verifies the signature.
    BadSignature,
    /// The timestamp lies outside the tolerance.
    Stale,
    /// The key id names no configured key.
    UnknownKey(String),
    /// The encrypted resource could not be decrypted with the configured key.
    Decrypt,
    /// A single-use transmission (PayPal's `PAYPAL-TRANSMISSION-ID`) was
    /// already verified within the window.
    Replayed,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing(what) => write!(f, "missing {what}"),
            Self::Malformed(what) => write!(f, "malformed {what}"),
            Self::BadSignature => f.write_str("bad signature"),
            Self::Stale => f.write_str("timestamp outside the tolerance"),
            Self::UnknownKey(id) => write!(f, "unknown key id {id:?}"),
            Self::Decrypt => f.write_str("resource could not be decrypted"),
            Self::Replayed => f.write_str("transmission already used"),
        }
    }
}

impl std::error::Error for VerifyError {}

/// A header as text, or [`VerifyError::Missing`].
#[cfg(feature = "verify")]
pub(crate) fn header<'a>(parts: &'a Parts, name: &'static str) -> Result<&'a str, VerifyError> {
    parts
        .headers
        .get(name)
        .ok_or(VerifyError::Missing(name))?
        .to_str()
        .map_err(|_| VerifyError::Malformed(Cow::Borrowed(name)))
}

/// Checks a Unix timestamp (seconds, decimal) against `now ± tolerance`.
#[cfg(feature = "verify")]
pub(crate) fn check_timestamp(
    ts: &str,
    now: SystemTime,
    tolerance: Duration,
) -> Result<(), VerifyError> {
    let malformed = || VerifyError::Malformed(Cow::Borrowed("timestamp"));
    let ts: u64 = ts.trim().parse().map_err(|_| malformed())?;
    // Checked: a timestamp past what `SystemTime` holds is malformed, not a
    // panic.
    let at = SystemTime::UNIX_EPOCH
        .checked_add(Duration::from_secs(ts))
        .ok_or_else(malformed)?;
    check_time(at, now, tolerance)
}

/// The most signatures a header may list (`Stripe-Signature` `v1=` entries,
/// `webhook-signature` entries). Senders list one per active secret, two
/// while rolling; a longer list is refused before any MAC is computed, so a
/// long header cannot buy CPU time.
pub const MAX_SIGNATURES: usize = 16;

/// The refusal of a header listing more than [`MAX_SIGNATURES`] signatures.
#[cfg(feature = "verify")]
pub(crate) fn too_many_signatures() -> VerifyError {
    VerifyError::Malformed(Cow::Borrowed("signature list (more than 16 signatures)"))
}

/// Checks that `at` lies within `now ± tolerance`.
#[cfg(feature = "verify")]
pub(crate) fn check_time(
    at: SystemTime,
    now: SystemTime,
    tolerance: Duration,
) -> Result<(), VerifyError> {
    let skew = match now.duration_since(at) {
        Ok(d) => d,
        Err(e) => e.duration(),
    };
    if skew > tolerance {
        return Err(VerifyError::Stale);
    }
    Ok(())
}

/// Whether the HMAC of `message` under any of `keys` equals any of
/// `candidates`: each key's MAC is computed once and compared in constant
/// time with each candidate.
#[cfg(feature = "verify")]
pub(crate) fn any_mac_matches(
    keys: &[ring::hmac::Key],
    message: &[u8],
    candidates: &[Vec<u8>],
) -> bool {
    use subtle::ConstantTimeEq;
    let mut ok = subtle::Choice::from(0);
    for key in keys {
        let tag = ring::hmac::sign(key, message);
        for candidate in candidates {
            ok |= tag.as_ref().ct_eq(candidate);
        }
    }
    ok.into()
}

/// Standard base64 decoding of a signature.
#[cfg(feature = "verify")]
pub(crate) fn base64_sig(s: &str) -> Result<Vec<u8>, VerifyError> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|_| VerifyError::Malformed(Cow::Borrowed("signature encoding")))
}
