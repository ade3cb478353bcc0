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

mod extract;
mod json;
mod service;

#[cfg(feature = "verify")]
pub(crate) use extract::decode_form;
pub use extract::{ExtractKey, Extracted, Field, FingerprintSpec, KeyError, KeySpec};
pub(crate) use service::is_guarded_method;
pub use service::{Key, KeyLayer, ResponseFuture};

use bytes::Bytes;
use http::request::Parts;
use http::HeaderName;
use sha2::{Digest, Sha256};
use std::fmt;
use std::sync::Arc;

/// A hash of the fields that define a request's meaning (16 bytes of SHA-256).
///
/// Two copies of one notification have the same fingerprint; a request that
/// reuses a key with another payload has another.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// The fingerprint of some bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_digest(Sha256::new_with_prefix(bytes))
    }

    /// The fingerprint of a client request: method, path and body.
    pub fn of_request(parts: &Parts, body: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(parts.method.as_str().as_bytes());
        h.update([0]);
        h.update(parts.uri.path().as_bytes());
        h.update([0]);
        h.update(body);
        Self::from_digest(h)
    }

    pub(crate) fn from_digest(h: Sha256) -> Self {
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Self(out)
    }

    /// The raw bytes, for stores that persist them.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// Rebuilds a fingerprint from [`to_bytes`](Self::to_bytes).
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}

/// Extra bytes that an earlier layer (the verify layer, after decrypting a
/// WeChat Pay v3 resource) asks the [`KeyLayer`] to fold into the fingerprint
/// of the request; put it into the request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintExtra(pub Bytes);

impl Fingerprint {
    /// This fingerprint with `extra` folded in.
    pub fn with_extra(self, extra: &[u8]) -> Self {
        let mut h = Sha256::new_with_prefix(self.0);
        h.update(extra);
        Self::from_digest(h)
    }
}

/// The scoped idempotency key of a request, put into its extensions by the
/// [`KeyLayer`].
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
    pub fn new(
        prefix: &str,
        preset: Arc<str>,
        route: &str,
        principal: Option<&str>,
        key: &str,
        fingerprint: Fingerprint,
    ) -> Self {
        let mut scoped = String::with_capacity(
            prefix.len()
                + preset.len()
                + route.len()
                + key.len()
                + 8
                + principal.map_or(0, str::len),
        );
        for part in [prefix, &preset, route, principal.unwrap_or("")] {
            escape_into(&mut scoped, part);
            scoped.push(':');
        }
        scoped.push_str(key);
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
            escape_into(&mut out, part);
            out.push(':');
        }
        out.push_str(token);
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

    pub(crate) fn preset_arc(&self) -> &Arc<str> {
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

/// `:` and `%` in a scope part are percent-escaped so parts cannot run together.
fn escape_into(out: &mut String, part: &str) {
    for c in part.chars() {
        match c {
            ':' => out.push_str("%3A"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
}

/// Who is asking: client-API keys are scoped to the principal so that no one
/// can fetch another user's response.
///
/// Implemented by [`NoPrincipal`], [`HeaderPrincipal`], [`AuthorizationHash`]
/// and closures `Fn(&Parts) -> Option<String>`.
pub trait Principal: Send + Sync + 'static {
    /// The principal of one request, if any.
    fn principal(&self, parts: &Parts) -> Option<String>;
}

impl<F> Principal for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// No principal: every sender shares one scope (the channel presets' default,
/// since a channel is one sender).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPrincipal;

impl Principal for NoPrincipal {
    fn principal(&self, _parts: &Parts) -> Option<String> {
        None
    }
}

/// The value of a header, such as a tenant id set by an authenticating proxy.
#[derive(Debug, Clone)]
pub struct HeaderPrincipal(pub HeaderName);

impl Principal for HeaderPrincipal {
    fn principal(&self, parts: &Parts) -> Option<String> {
        parts
            .headers
            .get(&self.0)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

/// A hash of the `Authorization` header (the idempotency-key preset's
/// default): the credential itself is never stored.
#[derive(Debug, Clone, Copy, Default)]
pub struct AuthorizationHash;

impl Principal for AuthorizationHash {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let auth = parts.headers.get(http::header::AUTHORIZATION)?;
        let fp = Fingerprint::of(auth.as_bytes()).to_bytes();
        Some(fp.iter().map(|b| format!("{b:02x}")).collect())
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
