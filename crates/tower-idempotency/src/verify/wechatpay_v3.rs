//! WeChat Pay API v3: RSA-SHA256 over `timestamp\nnonce\nbody\n`.

use super::keys::{SigningKeyError, RsaPublicKey};
use super::{base64_sig, check_timestamp, header, Verified, Verifier, VerifyError};
use crate::key::FingerprintExtra;
use bytes::Bytes;
use http::request::Parts;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, SystemTime};

/// The decrypted `resource` of a WeChat Pay v3 notification (the transaction
/// or refund JSON), put into the request extensions when an APIv3 key is
/// configured. The body itself is left as signed, so the key (`/id`) and any
/// later check still see the original notification.
///
/// With the `axum` feature a handler takes it as an extractor:
/// `async fn on_paid(DecryptedResource(tx): DecryptedResource)`. On a route
/// that does not decrypt (no [`WechatPayV3Keys::api_v3_key`], or no
/// `.verify(..)`) the extractor answers 500, which the WeChat Pay layers turn
/// into the channel's failure reply: the notification is retried, never lost.
/// `Option<DecryptedResource>` is `None` there instead.
///
/// Without the `axum` feature (`cargo add tower-idempotency --features
/// axum,verify`) it is no extractor, and rustc cannot name the feature:
/// its error is axum's ``the trait bound `fn(DecryptedResource) -> … {…}:
/// Handler<_, _>` is not satisfied``.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecryptedResource(pub Bytes);

#[cfg(feature = "axum")]
mod axum_extract {
    use super::DecryptedResource;
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;
    use http::StatusCode;
    use std::convert::Infallible;

    /// The resource the verify layer decrypted; 500 on a route that does not
    /// decrypt (a configuration error: the channel retries).
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> FromRequestParts<S> for DecryptedResource {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<DecryptedResource>().cloned().ok_or((
                StatusCode::INTERNAL_SERVER_ERROR,
                "this route does not decrypt WeChat Pay v3 resources: \
                 configure WechatPayV3Keys::api_v3_key and .verify(..)\n",
            ))
        }
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> OptionalFromRequestParts<S> for DecryptedResource {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<DecryptedResource>().cloned())
        }
    }
}

/// The keys of a WeChat Pay v3 route.
///
/// ```
/// use tower_idempotency::verify::WechatPayV3Keys;
/// let pem = std::fs::read("tests/fixtures/wechatpay_v3_platform_cert.pem").unwrap();
/// let keys = WechatPayV3Keys::new()
///     .platform_key("D7CE59D1F522D701", &pem).unwrap()
///     .api_v3_key("testMchAPIv3Key0testMchAPIv3Key0").unwrap();
/// assert_eq!(keys.serials().count(), 1);
/// ```
#[derive(Clone)]
pub struct WechatPayV3Keys {
    keys: HashMap<String, RsaPublicKey>,
    api_v3_key: Option<LessSafeKeyBytes>,
    tolerance: Duration,
}

/// The APIv3 key, kept as bytes so that the keys stay `Clone`.
#[derive(Clone)]
struct LessSafeKeyBytes(Vec<u8>);

impl WechatPayV3Keys {
    /// No keys yet; a tolerance of 5 minutes.
    pub fn new() -> Self {
        Self {
            keys: HashMap::new(),
            api_v3_key: None,
            tolerance: Duration::from_secs(300),
        }
    }

    /// Adds the platform certificate or WeChat Pay public key (PEM, DER or
    /// bare base64) named `serial` in the `Wechatpay-Serial` header. Add one
    /// per key while keys rotate.
    pub fn platform_key(
        mut self,
        serial: impl Into<String>,
        pem_or_der: impl AsRef<[u8]>,
    ) -> Result<Self, SigningKeyError> {
        let key = RsaPublicKey::from_pem_or_der(pem_or_der)?;
        self.keys.insert(serial.into(), key);
        Ok(self)
    }

    /// Decrypts `resource` with the APIv3 key (32 bytes: AES-256-GCM; a
    /// 16-byte key, which the official SDKs also accept, selects AES-128-GCM):
    /// the plaintext goes into the request extensions as a
    /// [`DecryptedResource`], and its `transaction_id`, `trade_state` and
    /// `amount.total` join the fingerprint. A notification that does not
    /// decrypt is refused. Defaults to no decryption.
    pub fn api_v3_key(mut self, key: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
        let key = key.as_ref();
        if key.len() != 32 && key.len() != 16 {
            return Err(SigningKeyError::new("the APIv3 key must be 32 bytes"));
        }
        self.api_v3_key = Some(LessSafeKeyBytes(key.to_vec()));
        Ok(self)
    }

    /// How far `Wechatpay-Timestamp` may lie from now. Defaults to 5 minutes.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The configured serials.
    pub fn serials(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }
}

impl Default for WechatPayV3Keys {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for WechatPayV3Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WechatPayV3Keys")
            .field("serials", &self.keys.keys().collect::<Vec<_>>())
            .field("api_v3_key", &self.api_v3_key.as_ref().map(|_| "<redacted>"))
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

#[derive(Deserialize)]
struct Notification<'a> {
    #[serde(borrow)]
    resource: Option<Resource<'a>>,
}

#[derive(Deserialize)]
struct Resource<'a> {
    #[serde(borrow)]
    ciphertext: Cow<'a, str>,
    #[serde(borrow, default)]
    associated_data: Cow<'a, str>,
    #[serde(borrow)]
    nonce: Cow<'a, str>,
}

#[derive(Deserialize)]
struct Transaction<'a> {
    #[serde(borrow, default)]
    transaction_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    trade_state: Option<Cow<'a, str>>,
    #[serde(default)]
    amount: Option<Amount>,
}

#[derive(Deserialize)]
struct Amount {
    #[serde(default)]
    total: Option<i64>,
}

impl WechatPayV3Keys {
    /// The plaintext of the notification's `resource`.
    fn open(key: &LessSafeKeyBytes, body: &Bytes) -> Result<Bytes, VerifyError> {
        let malformed = |what| VerifyError::Malformed(Cow::Borrowed(what));
        let note: Notification<'_> =
            serde_json::from_slice(body).map_err(|_| malformed("notification JSON"))?;
        let Some(resource) = note.resource else {
            return Err(VerifyError::Missing("resource"));
        };
        let nonce = Nonce::try_assume_unique_for_key(resource.nonce.as_bytes())
            .map_err(|_| malformed("resource nonce"))?;
        let mut in_out = base64_sig(&resource.ciphertext)?;
        let algorithm = if key.0.len() == 16 { &AES_128_GCM } else { &AES_256_GCM };
        let key = LessSafeKey::new(
            UnboundKey::new(algorithm, &key.0).map_err(|_| VerifyError::Decrypt)?,
        );
        let plain = key
            .open_in_place(nonce, Aad::from(resource.associated_data.as_bytes()), &mut in_out)
            .map_err(|_| VerifyError::Decrypt)?;
        Ok(Bytes::copy_from_slice(plain))
    }

    fn decrypt(&self, key: &LessSafeKeyBytes, parts: &mut Parts, body: &Bytes) -> Result<(), VerifyError> {
        let malformed = |what| VerifyError::Malformed(Cow::Borrowed(what));
        let plain = Self::open(key, body)?;
        let tx: Transaction<'_> =
            serde_json::from_slice(&plain).map_err(|_| malformed("decrypted resource"))?;
        let mut extra = Vec::with_capacity(64);
        for field in [tx.transaction_id.as_deref(), tx.trade_state.as_deref()] {
            extra.extend_from_slice(field.unwrap_or_default().as_bytes());
            extra.push(0);
        }
        if let Some(total) = tx.amount.and_then(|a| a.total) {
            extra.extend_from_slice(total.to_string().as_bytes());
        }
        parts.extensions.insert(FingerprintExtra(Bytes::from(extra)));
        parts.extensions.insert(DecryptedResource(plain));
        Ok(())
    }
}

impl Verifier for WechatPayV3Keys {
    fn verify(&self, parts: &mut Parts, body: &Bytes, now: SystemTime) -> Result<Verified, VerifyError> {
        let serial = header(parts, "wechatpay-serial")?;
        let timestamp = header(parts, "wechatpay-timestamp")?;
        let nonce = header(parts, "wechatpay-nonce")?;
        let signature = header(parts, "wechatpay-signature")?;
        let key = self
            .keys
            .get(serial)
            .ok_or_else(|| VerifyError::UnknownKey(serial.to_owned()))?;
        check_timestamp(timestamp, now, self.tolerance)?;
        let signature = base64_sig(signature)?;
        let mut message = Vec::with_capacity(timestamp.len() + nonce.len() + body.len() + 3);
        for part in [timestamp.as_bytes(), nonce.as_bytes(), body] {
            message.extend_from_slice(part);
            message.push(b'\n');
        }
        if !key.verify_sha256(&message, &signature) {
            return Err(VerifyError::BadSignature);
        }
        let serial = serial.to_owned();
        if let Some(api_v3_key) = &self.api_v3_key {
            self.decrypt(api_v3_key, parts, body)?;
        }
        Ok(Verified::new("wechatpay-v3", Some(serial)))
    }

    fn channel(&self) -> &str {
        "wechatpay-v3"
    }

    /// Decrypts the resource again with the APIv3 key, if one is set.
    fn reopen(&self, parts: &mut Parts, body: &Bytes) -> Result<(), VerifyError> {
        if let Some(api_v3_key) = &self.api_v3_key {
            let plain = Self::open(api_v3_key, body)?;
            parts.extensions.insert(DecryptedResource(plain));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{DecryptedResource, WechatPayV3Keys};
    use crate::verify::{Verifier, VerifyError};
    use base64::Engine as _;
    use bytes::Bytes;
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

    const KEY: &[u8; 32] = b"0123456789abcdef0123456789abcdef";

    fn notification(plain: &str) -> Bytes {
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, KEY).unwrap());
        let mut sealed = plain.as_bytes().to_vec();
        let nonce = Nonce::try_assume_unique_for_key(b"fdasflkja484").unwrap();
        key.seal_in_place_append_tag(nonce, Aad::from(b"transaction"), &mut sealed)
            .unwrap();
        let ciphertext = base64::engine::general_purpose::STANDARD.encode(&sealed);
        Bytes::from(format!(
            r#"{{"id":"EV-1","resource":{{"ciphertext":"{ciphertext}","associated_data":"transaction","nonce":"fdasflkja484"}}}}"#
        ))
    }

    /// A notification accepted earlier: its resource is decrypted again,
    /// with no signature header and no timestamp to check.
    #[test]
    fn reopen_decrypts_without_checking_again() {
        let keys = WechatPayV3Keys::new().api_v3_key(KEY).unwrap();
        let plain = r#"{"out_trade_no":"1","trade_state":"SUCCESS"}"#;
        let (mut parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        keys.reopen(&mut parts, &notification(plain)).unwrap();
        let DecryptedResource(got) = parts.extensions.get::<DecryptedResource>().unwrap();
        assert_eq!(got, plain.as_bytes());

        // Another key: not decrypted, and nothing inserted.
        let other = WechatPayV3Keys::new().api_v3_key([7u8; 32]).unwrap();
        let (mut parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        let err = other.reopen(&mut parts, &notification(plain)).unwrap_err();
        assert!(matches!(err, VerifyError::Decrypt), "{err}");
        assert!(parts.extensions.get::<DecryptedResource>().is_none());

        // No APIv3 key: nothing to read again.
        let (mut parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        WechatPayV3Keys::new()
            .reopen(&mut parts, &notification(plain))
            .unwrap();
        assert!(parts.extensions.get::<DecryptedResource>().is_none());
    }
}
