//! [`VerifyLayer`]: the verifier, its clock and limits.

use super::{Verifier, Verify, VerifyError};
use bytes::Bytes;
use http::request::Parts;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;
use tower_layer::Layer;

/// Where the verify layer reads the time (timestamps are checked against it).
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Applies [`Verify`] to a service. See the [module docs](crate::verify).
///
/// Without a verifier ([`VerifyLayer::off`], the default) requests pass
/// through untouched.
#[derive(Clone)]
pub struct VerifyLayer {
    pub(crate) verifier: Option<Arc<dyn Verifier>>,
    pub(crate) clock: Clock,
    pub(crate) preset: Arc<str>,
    pub(crate) max_body: usize,
}

impl VerifyLayer {
    /// A layer that refuses every request `verifier` does not accept.
    ///
    /// Defaults: the system clock, body limit 64 KiB (set to the preset's by
    /// [`IdempotencyLayer::verify`](crate::IdempotencyLayer::verify)).
    pub fn new(verifier: impl Verifier) -> Self {
        Self {
            verifier: Some(Arc::new(verifier)),
            ..Self::off()
        }
    }

    /// A layer that verifies nothing.
    pub fn off() -> Self {
        Self {
            verifier: None,
            clock: Arc::new(SystemTime::now),
            preset: Arc::from("custom"),
            max_body: 64 * 1024,
        }
    }

    /// Reads again what the verifier reads from a request it accepted
    /// earlier, without checking it again (see [`Verifier::reopen`]); a
    /// layer that verifies nothing does nothing.
    pub fn reopen(&self, parts: &mut Parts, body: &Bytes) -> Result<(), VerifyError> {
        match &self.verifier {
            Some(verifier) => verifier.reopen(parts, body),
            None => Ok(()),
        }
    }

    /// Whether a verifier is configured.
    pub fn is_on(&self) -> bool {
        self.verifier.is_some()
    }

    /// Reads the time from `clock` (for tests with recorded notifications).
    /// Defaults to the system clock.
    pub fn clock(mut self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The preset name used in metrics. Defaults to `custom`.
    pub fn preset(mut self, name: impl Into<Arc<str>>) -> Self {
        self.preset = name.into();
        self
    }

    /// The most body bytes to buffer; larger bodies get 413. Defaults to 64 KiB.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }
}

impl Default for VerifyLayer {
    fn default() -> Self {
        Self::off()
    }
}

impl<V: Verifier> From<V> for VerifyLayer {
    fn from(verifier: V) -> Self {
        Self::new(verifier)
    }
}

impl fmt::Debug for VerifyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifyLayer")
            .field("channel", &self.verifier.as_ref().map(|v| v.channel()))
            .field("preset", &self.preset)
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for VerifyLayer {
    type Service = Verify<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Verify {
            inner,
            config: Arc::new(self.clone()),
        }
    }
}
