use super::service::Dedup;
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;
use tower_layer::Layer;

/// What to do when the store fails or times out (DESIGN P7).
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
}

impl DedupConfig {
    pub(crate) const fn new() -> Self {
        Self {
            window: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            wait: Duration::from_secs(4),
            store_timeout: Duration::from_secs(1),
            on_store_error: OnStoreError::FailClosed,
            finish_on_disconnect: true,
            max_cached_body: 1024 * 1024,
            strict: false,
            token_ttl: Duration::from_secs(300),
        }
    }
}

/// Applies [`Dedup`] to a service. See the [module docs](crate::dedup).
#[derive(Debug, Clone)]
pub struct DedupLayer<St> {
    store: St,
    config: DedupConfig,
}

impl<St: Store> DedupLayer<St> {
    /// A dedup layer over `store` with the defaults below.
    pub const fn new(store: St) -> Self {
        Self {
            store,
            config: DedupConfig::new(),
        }
    }

    /// How long a completed record is replayed. Defaults to 24 hours.
    pub const fn window(mut self, window: Duration) -> Self {
        self.config.window = window;
        self
    }

    /// How long a claim holds without renewal; it is renewed every `lease/3`
    /// while the inner service runs, and runs out if the instance dies.
    /// Defaults to 30 seconds.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long a duplicate waits for the first request before it gets a
    /// retryable answer; zero answers at once. Keep it below the sender's
    /// timeout (WeChat Pay waits 5 s). Defaults to 4 seconds.
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// The timeout of every store call. Defaults to 1 second.
    pub const fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config.store_timeout = timeout;
        self
    }

    /// What to do when the store fails. Defaults to [`OnStoreError::FailClosed`].
    pub const fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.config.on_store_error = policy;
        self
    }

    /// Whether an inner call whose caller hung up is finished in a spawned
    /// task (so its result is recorded and the next retry replays it) rather
    /// than cancelled (its claim released). Defaults to `true`.
    pub const fn finish_on_disconnect(mut self, finish: bool) -> Self {
        self.config.finish_on_disconnect = finish;
        self
    }

    /// The largest response body kept for replay. A larger success still
    /// completes the record (the inner service is never run again), but its
    /// replay carries the status and headers, an empty body and
    /// `idempotent-body-omitted: true`. Defaults to 1 MiB.
    pub const fn max_cached_body(mut self, bytes: usize) -> Self {
        self.config.max_cached_body = bytes;
        self
    }

    /// The same settings over another store.
    pub fn with_store<St2: Store>(self, store: St2) -> DedupLayer<St2> {
        DedupLayer {
            store,
            config: self.config,
        }
    }

    /// Strict mode: a copy of a request that is running or done gets 409
    /// "duplicate submission" instead of waiting for and replaying the first
    /// response. Defaults to `false` (wait and replay).
    pub const fn strict(mut self, strict: bool) -> Self {
        self.config.strict = strict;
        self
    }

    /// How long a client token lives again when the request that consumed it
    /// fails, so that the client can retry with it. Defaults to 5 minutes.
    pub const fn token_ttl(mut self, ttl: Duration) -> Self {
        self.config.token_ttl = ttl;
        self
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

impl<S, St: Store> Layer<S> for DedupLayer<St> {
    type Service = Dedup<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Dedup::from_parts(inner, self.store.clone(), Arc::new(self.config.clone()))
    }
}
