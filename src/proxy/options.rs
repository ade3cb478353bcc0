//! [`RouteOptions`]: per-route settings of the idempotency stack.

use crate::dedup::OnStoreError;
use crate::key::HeaderPrincipal;
use crate::store::Store;
use crate::{IdempotencyLayer, Preset};
use http::HeaderName;
use std::time::Duration;

/// Settings of one route's idempotency stack; every unset one is the
/// preset's (see [`IdempotencyLayer`]).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::proxy::RouteOptions;
///
/// let opts = RouteOptions::new().window(Duration::from_secs(25 * 3600)).max_body(64 << 10);
/// assert_eq!(opts.get_max_body(), Some(64 << 10));
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct RouteOptions {
    window: Option<Duration>,
    lease: Option<Duration>,
    wait: Option<Duration>,
    max_body: Option<usize>,
    principal_header: Option<HeaderName>,
    on_store_error: Option<OnStoreError>,
}

impl RouteOptions {
    /// Every setting the preset's.
    pub const fn new() -> Self {
        Self {
            window: None,
            lease: None,
            wait: None,
            max_body: None,
            principal_header: None,
            on_store_error: None,
        }
    }

    /// How long a success is replayed. Defaults to the preset's window.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// The claim's lease. Defaults to [`IdempotencyLayer`]'s (30 seconds).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long a duplicate waits for the first copy. Defaults to the preset's.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The request body limit (413 past it). Defaults to the preset's.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = Some(bytes);
        self
    }

    /// Scopes every key to this header's value (a tenant id set by an auth
    /// proxy). Defaults to the preset's principal.
    pub fn principal_header(mut self, name: HeaderName) -> Self {
        self.principal_header = Some(name);
        self
    }

    /// What a store outage does. Defaults to [`OnStoreError::FailClosed`].
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.on_store_error = Some(policy);
        self
    }

    /// The body limit set with [`max_body`](Self::max_body), if any.
    pub fn get_max_body(&self) -> Option<usize> {
        self.max_body
    }

    /// The body limit for `preset`.
    pub(crate) fn body_limit(&self, preset: &Preset) -> usize {
        self.max_body.unwrap_or_else(|| preset.max_body())
    }

    /// The layer for `preset` with these settings.
    pub(crate) fn layer<S: Store>(&self, preset: Preset, store: S) -> IdempotencyLayer<S> {
        let limit = self.body_limit(&preset);
        let mut layer = IdempotencyLayer::new_in(preset, store).max_body(limit);
        if let Some(policy) = self.on_store_error {
            layer = layer.on_store_error(policy);
        }
        if let Some(window) = self.window {
            layer = layer.window(window);
        }
        if let Some(lease) = self.lease {
            layer = layer.lease(lease);
        }
        if let Some(wait) = self.wait {
            layer = layer.wait(wait);
        }
        if let Some(name) = &self.principal_header {
            layer = layer.principal(HeaderPrincipal(name.clone()));
        }
        layer
    }

    /// The principal header, if set.
    pub(crate) fn get_principal_header(&self) -> Option<&HeaderName> {
        self.principal_header.as_ref()
    }
}
