//! The settings of [`Dedup`](super::Dedup), shared by the layer, the
//! service and the run.

use std::time::Duration;

// One definition of each setting's default and bounds: the layers'
// builders, the message consumer and the gateway (its route options and
// its configuration parser) all read these.

/// How long a completed record is replayed unless a preset or the builder
/// says otherwise: 25 hours (longer than WeChat Pay and Alipay retry).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(25 * 3600);

/// How long a claim holds without renewal: 30 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How long a copy waits for the first request: 4 seconds (below WeChat
/// Pay's 5 s timeout).
pub const DEFAULT_WAIT: Duration = Duration::from_secs(4);

/// The timeout of every store call: 1 second.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest run of the inner service before it is cancelled and the
/// claim released: 5 minutes.
pub const DEFAULT_MAX_RUN: Duration = Duration::from_secs(300);

/// The largest response body kept for replay: 1 MiB.
pub const DEFAULT_MAX_CACHED_BODY: usize = 1024 * 1024;

/// How long a one-time client token lives: 5 minutes.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(300);

/// The shortest lease [`DedupLayer::lease`](super::DedupLayer::lease) takes: a shorter one would
/// make the renewal (every `lease/3`) spin.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The longest window, lease, wait, run limit or reply deadline the
/// builders take (a year); a longer one is taken as this.
///
/// A program that reads these settings from its users (flags, a
/// configuration file) can compare against it to refuse a longer one
/// instead of having it shortened without a word.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::dedup::MAX_SETTING;
///
/// let asked = Duration::from_secs(2 * 365 * 24 * 3600);
/// assert!(asked > MAX_SETTING, "two years: refused");
/// ```
pub const MAX_SETTING: Duration = Duration::from_secs(365 * 24 * 3600);

/// What to do when the store fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
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
            window: DEFAULT_WINDOW,
            lease: DEFAULT_LEASE,
            wait: DEFAULT_WAIT,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            on_store_error: OnStoreError::FailClosed,
            finish_on_disconnect: true,
            max_cached_body: DEFAULT_MAX_CACHED_BODY,
            strict: false,
            token_ttl: DEFAULT_TOKEN_TTL,
            max_run: DEFAULT_MAX_RUN,
            reply_timeout: None,
            key_in_response: true,
        }
    }
}
