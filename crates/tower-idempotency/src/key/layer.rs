//! [`KeyLayer`]: where a key is read, how it is scoped, what is refused.

use super::{ExtractKey, Key, NoPrincipal, Principal};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use tower_layer::Layer;

/// Applies [`Key`] to a service. See the [module docs](crate::key).
#[derive(Clone)]
pub struct KeyLayer {
    pub(crate) config: KeyConfig,
}

#[derive(Clone)]
pub(crate) struct KeyConfig {
    pub(crate) extractor: Arc<dyn ExtractKey>,
    pub(crate) principal: Arc<dyn Principal>,
    pub(crate) prefix: Cow<'static, str>,
    pub(crate) preset: Arc<str>,
    pub(crate) route: Option<Arc<str>>,
    pub(crate) max_body: usize,
    pub(crate) max_key_len: usize,
    pub(crate) required: bool,
    pub(crate) describe: Arc<str>,
    pub(crate) consume_token: bool,
    pub(crate) capture: bool,
}

impl KeyLayer {
    /// A key layer reading keys with `extractor`.
    ///
    /// Defaults: key required, body limit 1 MiB, key at most 256 bytes, no
    /// principal, prefix `idem`, scope name `custom`, route = the matched route
    /// or the normalised request path (see [`route`](Self::route)).
    pub fn new(extractor: impl ExtractKey) -> Self {
        Self::from_arc(Arc::new(extractor), Arc::from("the idempotency key"))
    }

    pub(crate) fn from_arc(extractor: Arc<dyn ExtractKey>, describe: Arc<str>) -> Self {
        Self {
            config: KeyConfig {
                extractor,
                principal: Arc::new(NoPrincipal),
                prefix: Cow::Borrowed("idem"),
                preset: Arc::from("custom"),
                route: None,
                max_body: 1024 * 1024,
                max_key_len: 256,
                required: true,
                describe,
                consume_token: false,
                capture: false,
            },
        }
    }

    /// The scope (and metrics) name of this key source. Defaults to `custom`.
    pub fn preset(mut self, name: impl Into<Arc<str>>) -> Self {
        self.config.preset = name.into();
        self
    }

    /// The first part of every stored key. Defaults to `idem`.
    pub fn prefix(mut self, prefix: impl Into<Cow<'static, str>>) -> Self {
        self.config.prefix = prefix.into();
        self
    }

    /// The route part of the stored key. Defaults to the route axum matched
    /// (`/orders/{id}`, with the `axum` feature), otherwise the request path in
    /// normal form (`/orders/`, `//orders` and `/orders/./` are `/orders`;
    /// `%31` is `1`), so two routes never share a record and one route never
    /// has two.
    pub fn route(mut self, route: impl Into<Arc<str>>) -> Self {
        self.config.route = Some(route.into());
        self
    }

    /// Who is asking. Defaults to [`NoPrincipal`].
    pub fn principal(mut self, principal: impl Principal) -> Self {
        self.config.principal = Arc::new(principal);
        self
    }

    /// The most body bytes to buffer; larger bodies get 413. Defaults to 1 MiB.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body = bytes;
        self
    }

    /// The longest key accepted; longer ones get 400. Defaults to 256 bytes.
    pub fn max_key_len(mut self, bytes: usize) -> Self {
        self.config.max_key_len = bytes;
        self
    }

    /// Whether a POST, PUT, PATCH or DELETE without a key gets 400 (`true`)
    /// or passes through unguarded (`false`). Defaults to `true`.
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// Whether the key is a one-time client token issued by
    /// [`IssueToken`](crate::token::IssueToken), which the first request must
    /// consume. Defaults to `false`.
    pub fn consume_token(mut self, consume: bool) -> Self {
        self.config.consume_token = consume;
        self
    }

    /// Whether each response of a request that had a key carries the
    /// request's buffered body (and the decrypted WeChat Pay v3 resource) as
    /// a [`CapturedRequest`](super::CapturedRequest) in its extensions, for a journal. Defaults to
    /// `false`.
    pub fn capture_request(mut self, capture: bool) -> Self {
        self.config.capture = capture;
        self
    }

    /// How the expected key is named in 400 messages, e.g. "JSON value at
    /// `/id`". Defaults to "the idempotency key" (a preset names its
    /// fields, as [`KeySpec::describe`](crate::key::KeySpec::describe) does).
    pub fn key_description(mut self, what: impl Into<Arc<str>>) -> Self {
        self.config.describe = what.into();
        self
    }
}

impl fmt::Debug for KeyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for KeyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyConfig")
            .field("preset", &self.preset)
            .field("prefix", &self.prefix)
            .field("route", &self.route)
            .field("max_body", &self.max_body)
            .field("max_key_len", &self.max_key_len)
            .field("required", &self.required)
            .finish()
    }
}

impl<S> Layer<S> for KeyLayer {
    type Service = Key<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Key {
            inner,
            config: Arc::new(self.config.clone()),
        }
    }
}
