//! The key layer: buffers the body, reads the idempotency key and the
//! fingerprint, scopes the key, and hands the same bytes on.
//!
//! The key goes into the request extensions as an [`IdempotencyKey`], which
//! the [dedup layer](crate::dedup) reads. Bodies over the limit get 413; a
//! missing or malformed key gets 400 on routes where the key is required (only
//! for the unsafe methods POST, PUT, PATCH, DELETE); anything else passes
//! through untouched.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::key::{Field, FingerprintSpec, KeyLayer, KeySpec};
//! use tower_idempotency::IdempotencyKey;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let layer = KeyLayer::new(KeySpec::new([Field::json("/id")], FingerprintSpec::Request))
//!     .preset("stripe")
//!     .route("webhook");
//! let svc = ServiceBuilder::new().layer(layer).service(service_fn(
//!     |req: Request<Full<Bytes>>| async move {
//!         let key = req.extensions().get::<IdempotencyKey>().unwrap();
//!         Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
//!             key.as_str().to_owned(),
//!         ))))
//!     },
//! ));
//! let req = Request::post("/").body(Full::new(Bytes::from_static(br#"{"id":"evt_1"}"#))).unwrap();
//! let res = svc.clone().oneshot(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::OK);
//!
//! // A body with no key is refused with a message naming what was expected.
//! let req = Request::post("/").body(Full::new(Bytes::from_static(b"{}"))).unwrap();
//! let res = svc.oneshot(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::BAD_REQUEST);
//! # }
//! ```

/// The `Visitor` methods of a JSON walk that passes over scalars (booleans,
/// numbers, strings, null): only maps and arrays matter to it.
macro_rules! skip_scalars {
    () => {
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    };
}

mod extract;
pub(crate) mod form;
mod json;
mod layer;
mod principal;
mod scope;
pub(crate) mod service;
#[cfg(feature = "verify")]
mod unique;
pub(crate) mod xml;

pub use crate::Fingerprint;
pub use extract::{ExtractKey, Extracted, Field, FingerprintSpec, KeyError, KeySpec};
#[cfg(feature = "verify")]
pub(crate) use form::{parse_form_strict, FormField};
pub use layer::KeyLayer;
pub use principal::{
    AndPrincipal, AuthorizationHash, CookiePrincipal, ExtensionPrincipal, HeaderPrincipal,
    InvalidPrincipalName, NoPrincipal, OrPrincipal, Principal,
};
pub(crate) use scope::route_of;
pub use scope::{MAX_PART_LEN, MAX_STORED_KEY_LEN};
pub(crate) use service::is_guarded_method;
pub use service::{Key, ResponseFuture};
#[cfg(feature = "verify")]
pub(crate) use unique::unique_members;
pub(crate) use xml::flat_fields;

use bytes::Bytes;
use std::fmt;
use std::sync::Arc;

/// The most fields a signed body may hold: form parameters (Alipay), children
/// of the XML root (WeChat Pay v2), members of any one JSON object (Adyen,
/// PayPal). A real notification has about 30; a body with more is refused
/// with the channel's failure reply (401, `unverified`) before its fields are
/// trusted, so that a 64 KiB body of ten thousand fields costs no more than a
/// normal one.
pub const MAX_FIELDS: usize = 256;

/// Extra bytes that an earlier layer (the verify layer, after decrypting a
/// WeChat Pay v3 resource) asks the [`KeyLayer`] to fold into the fingerprint
/// of the request; put it into the request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintExtra(pub Bytes);

/// The request a guarded response answered, as the [`KeyLayer`] buffered
/// it: put into the response's extensions when
/// [`KeyLayer::capture_request`] is on, for outer code that records it (a
/// journal). `decrypted` is the WeChat Pay v3 resource the verify layer
/// decrypted, when it did. Both are shared (reference-counted), not copied.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CapturedRequest {
    /// The body as received.
    pub body: Bytes,
    /// The decrypted WeChat Pay v3 `resource`, if the route decrypts.
    pub decrypted: Option<Bytes>,
    /// Whether a verify layer checked the sender's signature (the request
    /// carried its `Verified` marker).
    pub verified: bool,
}

impl CapturedRequest {
    /// A request of `body`, with the resource a verify layer decrypted
    /// (`decrypted`) and whether it checked the sender (`verified`).
    pub fn new(body: Bytes, decrypted: Option<Bytes>, verified: bool) -> Self {
        Self {
            body,
            decrypted,
            verified,
        }
    }
}

/// The scoped idempotency key of a request, put into its extensions by the
/// [`KeyLayer`].
///
/// With the `axum` feature it is an axum extractor too (`key:
/// IdempotencyKey`, or `Option<IdempotencyKey>`). Without it
/// (`cargo add tower-idempotency --features axum`) rustc cannot name the
/// feature: its error is axum's ``the trait bound `fn(IdempotencyKey) -> …
/// {…}: Handler<_, _>` is not satisfied``.
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    scoped: Arc<str>,
    fingerprint: Fingerprint,
    preset: Arc<str>,
    token: Option<Arc<str>>,
}

impl IdempotencyKey {
    /// A key from its parts: the stored key is
    /// `prefix:preset:route:principal:key` (empty principal when there is none).
    ///
    /// `:`, `%` and `#` in the first four parts are percent-escaped so that
    /// parts never run together; a part longer than [`MAX_PART_LEN`] is
    /// replaced by a hash of it, so a stored key is never longer than
    /// [`MAX_STORED_KEY_LEN`].
    pub fn new(
        prefix: &str,
        preset: Arc<str>,
        route: &str,
        principal: Option<&str>,
        key: &str,
        fingerprint: Fingerprint,
    ) -> Self {
        let mut scoped = String::with_capacity(
            (prefix.len() + preset.len() + route.len() + key.len() + 8).min(MAX_STORED_KEY_LEN),
        );
        for part in [prefix, &preset, route, principal.unwrap_or("")] {
            scope::push_part(&mut scoped, part);
            scoped.push(':');
        }
        scope::push_key(&mut scoped, key);
        Self {
            scoped: Arc::from(scoped),
            fingerprint,
            preset,
            token: None,
        }
    }

    /// Marks the key as a one-time client token that the dedup layer must
    /// consume from the store (under `token_key`) before the first run.
    pub fn with_token(mut self, token_key: impl Into<Arc<str>>) -> Self {
        self.token = Some(token_key.into());
        self
    }

    /// The store key of the client token this request must consume, if any.
    pub fn token_key(&self) -> Option<&Arc<str>> {
        self.token.as_ref()
    }

    /// The store key of a client token: `prefix:token:principal:token`.
    pub fn token_store_key(prefix: &str, principal: Option<&str>, token: &str) -> String {
        let mut out = String::with_capacity(prefix.len() + token.len() + 16);
        for part in [prefix, "token", principal.unwrap_or("")] {
            scope::push_part(&mut out, part);
            out.push(':');
        }
        scope::push_key(&mut out, token);
        out
    }

    /// The stored (scoped) key.
    pub fn as_str(&self) -> &str {
        &self.scoped
    }

    /// The stored key, shared.
    pub fn as_arc(&self) -> &Arc<str> {
        &self.scoped
    }

    /// The fingerprint of the request.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The preset (or scope name) the key belongs to, for metrics.
    pub fn preset(&self) -> &str {
        &self.preset
    }

    /// [`preset`](Self::preset), shared: a metric's label without a copy.
    pub fn preset_arc(&self) -> &Arc<str> {
        &self.preset
    }

    /// A redacted form for logs: the scope and a short hash of the key.
    pub fn redacted(&self) -> String {
        let fp = Fingerprint::of(self.scoped.as_bytes()).to_bytes();
        format!(
            "{}:#{:02x}{:02x}{:02x}{:02x}",
            self.preset, fp[0], fp[1], fp[2], fp[3]
        )
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("key", &self.redacted())
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

/// The body bytes handed on by the key layer.
pub type KeyBody = http_body_util::Full<Bytes>;

#[cfg(feature = "axum")]
mod axum_extract {
    use super::IdempotencyKey;
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;
    use http::StatusCode;
    use std::convert::Infallible;

    /// With the `axum` feature, a handler behind the layers can take the
    /// request's key: `async fn h(key: IdempotencyKey)` (400 when the request
    /// has none) or `Option<IdempotencyKey>`.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_idempotency::{IdempotencyKey, IdempotencyLayer};
    ///
    /// async fn create(key: IdempotencyKey) -> String {
    ///     format!("order for {}", key.redacted())
    /// }
    /// let app: Router = Router::new()
    ///     .route("/orders", post(create).layer(IdempotencyLayer::idempotency_key()));
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<IdempotencyKey>().cloned().ok_or((
                StatusCode::BAD_REQUEST,
                "this route needs an idempotency key\n",
            ))
        }
    }

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotencyKey>().cloned())
        }
    }
}

/// The `key_hash` of a stored key that the crate's spans record (and the
/// queue's `deliver` span): the first 16 hex digits of its SHA-256, so that
/// the spans of one key can be found together while the key itself (an
/// order number, a client's key) is never exported. Computed only when
/// formatted.
///
/// ```
/// use tower_idempotency::key::KeyHash;
/// // SHA-256("abc") = ba7816bf8f01cfea414140de5dae2223...
/// assert_eq!(KeyHash("abc").to_string(), "ba7816bf8f01cfea");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct KeyHash<'a>(pub &'a str);

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.0.as_bytes());
        for b in &digest[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
