//! The settings of [`Dedup`](super::Dedup), shared by the layer, the
//! service and the run.

use std::time::Duration;

/// What to do when the store fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Answer a retryable failure (503 with `Retry-After`, or the channel's
    /// failure reply) so that the sender comes back later: nothing doubled,
    /// nothing lost. The default.
    #[default]
    FailClosed,
    /// Pass the request through unguarded and rely on the business backstop
    /// (a unique index). Counted as `passed_through`.
    FailOpen,
}

#[derive(Debug, Clone)]
pub(crate) struct DedupConfig {
    pub(crate) window: Duration,
    pub(crate) lease: Duration,
    pub(crate) wait: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) finish_on_disconnect: bool,
    pub(crate) max_cached_body: usize,
    pub(crate) strict: bool,
    pub(crate) token_ttl: Duration,
    pub(crate) max_run: Duration,
    pub(crate) reply_timeout: Option<Duration>,
    pub(crate) key_in_response: bool,
}

impl DedupConfig {
    pub(crate) const fn new() -> Self {
        Self {
            window: Duration::from_secs(25 * 3600),
            lease: Duration::from_secs(30),
            wait: Duration::from_secs(4),
            store_timeout: Duration::from_secs(1),
            on_store_error: OnStoreError::FailClosed,
            finish_on_disconnect: true,
            max_cached_body: 1024 * 1024,
            strict: false,
            token_ttl: Duration::from_secs(300),
            max_run: Duration::from_secs(300),
            reply_timeout: None,
            key_in_response: true,
        }
    }
}
