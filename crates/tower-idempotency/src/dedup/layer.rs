use super::config::{DedupConfig, OnStoreError, MAX_SETTING, MIN_LEASE};
use super::service::Dedup;
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

/// `d` within `min..=max`.
const fn clamp(d: Duration, min: Duration, max: Duration) -> Duration {
    if d.as_nanos() < min.as_nanos() {
        min
    } else if d.as_nanos() > max.as_nanos() {
        max
    } else {
        d
    }
}

/// Applies [`Dedup`] to a service. See the [module docs](crate::dedup).
#[derive(Debug, Clone)]
pub struct DedupLayer<St> {
    store: St,
    config: DedupConfig,
    tasks: TaskTracker,
}

impl<St: Store> DedupLayer<St> {
    /// A dedup layer over `store` with the defaults below.
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: DedupConfig::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// How long a completed record is replayed. Defaults to 25 hours
    /// (longer than WeChat Pay and Alipay retry; not as long as Stripe,
    /// PayPal or Adyen do: the [presets](crate::Preset) set their channel's
    /// window). At most a year (a longer one is taken as a year).
    pub const fn window(mut self, window: Duration) -> Self {
        self.config.window = clamp(window, Duration::ZERO, MAX_SETTING);
        self
    }

    /// How long a claim holds without renewal; it is renewed every `lease/3`
    /// while the inner service runs, and runs out if the instance dies.
    /// Defaults to 30 seconds. From [`MIN_LEASE`] (100 ms) to a year: a
    /// value outside is taken as the nearest end.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = clamp(lease, MIN_LEASE, MAX_SETTING);
        self
    }

    /// How long a duplicate waits for the first request before it gets a
    /// retryable answer; zero answers at once. Keep it below the sender's
    /// timeout (WeChat Pay waits 5 s). Defaults to 4 seconds. At most a year.
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = clamp(wait, Duration::ZERO, MAX_SETTING);
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

    /// Whether an inner call whose caller hung up is finished in the
    /// background (so its result is recorded and the next retry replays it)
    /// rather than cancelled (its claim released). This covers a caller that
    /// stops reading a streamed success: the rest of the body is drained (up
    /// to the run limit) and the record completed when it ends. A completion
    /// already under way is finished either way. Defaults to `true`.
    pub const fn finish_on_disconnect(mut self, finish: bool) -> Self {
        self.config.finish_on_disconnect = finish;
        self
    }

    /// Whether each guarded response carries its
    /// [`IdempotencyKey`](crate::IdempotencyKey) in its extensions, for outer
    /// code that reads it (an access log, a journal; the crate's
    /// `idempotency` span records its `preset` and `key_hash` from there).
    /// Off, a response costs one extension less (an allocation and a
    /// reference count) and that span records only its `outcome`. Defaults
    /// to `true`.
    pub const fn key_in_response(mut self, on: bool) -> Self {
        self.config.key_in_response = on;
        self
    }

    /// The largest response body kept for replay. A success is streamed to
    /// the caller as it is produced and copied into the record up to this
    /// limit; a larger one still completes the record when its body ends (the
    /// inner service is never run again), but its replay carries the status
    /// and headers, an empty body and `idempotent-body-omitted: true`.
    /// Defaults to 1 MiB.
    pub const fn max_cached_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_cached_body = bytes;
        self
    }

    /// The same settings over another store.
    pub fn with_store<St2: Store>(self, store: St2) -> DedupLayer<St2> {
        DedupLayer {
            store,
            config: self.config,
            tasks: self.tasks,
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

    /// The run limit: the longest an inner call may run, its response body
    /// included. Past it the inner future (or body) is dropped, the claim is
    /// released so that the next retry runs again, the caller gets the
    /// retryable failure (503 with `Retry-After`, or the channel's failure
    /// reply) and the event is logged and counted as
    /// [`Outcome::RunLimitExceeded`](crate::Outcome::RunLimitExceeded). No
    /// key stays blocked longer than this by a hung handler or upstream.
    ///
    /// The limit bounds the inner call, not the caller's reading: a success
    /// streams at the caller's pace, and when the limit passes while the
    /// call waits for a caller that stopped reading, that caller is let go
    /// (its body ends in error) and the call gets the limit once more, from
    /// then, to read the rest of its body and record the success (its body
    /// up to [`max_cached_body_bytes`](Self::max_cached_body_bytes)); the retry replays
    /// it. A key is thus blocked at most twice the limit. Defaults to 5
    /// minutes. At most a year.
    pub const fn max_run(mut self, limit: Duration) -> Self {
        self.config.max_run = clamp(limit, Duration::ZERO, MAX_SETTING);
        self
    }

    /// The reply deadline: the caller's patience. Past it the caller gets the
    /// retryable failure (503 with `Retry-After`, or the channel's failure
    /// reply) while the inner call goes on in the background, holding and
    /// renewing its claim, until it answers or the run limit ends; its
    /// success is recorded, so the next retry replays it instead of running
    /// it again. Set it below the sender's timeout (WeChat Pay waits 5 s).
    /// Defaults to no deadline: the caller waits as long as the inner call
    /// runs (up to the run limit).
    pub const fn reply_timeout(mut self, timeout: Duration) -> Self {
        self.config.reply_timeout = Some(clamp(timeout, Duration::ZERO, MAX_SETTING));
        self
    }

    /// The tracker that background work is spawned on: calls finished after
    /// their caller hung up or after the reply deadline, completions retried
    /// in the background, releases. Share one tracker across layers, and at
    /// shutdown wait for it so that no recorded success is lost:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_idempotency::dedup::DedupLayer;
    /// use tower_idempotency::store::MemoryStore;
    /// use tower_idempotency::TaskTracker;
    ///
    /// let tracker = TaskTracker::new();
    /// let layer = DedupLayer::new(MemoryStore::new()).task_tracker(tracker.clone());
    /// // … serve until a shutdown signal, stop accepting, then:
    /// tracker.close();
    /// tracker.wait().await;
    /// assert!(layer.tasks().is_empty());
    /// # }
    /// ```
    ///
    /// Defaults to a tracker of this layer's own (see [`tasks`](Self::tasks)).
    pub fn task_tracker(mut self, tracker: TaskTracker) -> Self {
        self.tasks = tracker;
        self
    }

    /// The tracker background work is spawned on.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

impl<S, St: Store> Layer<S> for DedupLayer<St> {
    type Service = Dedup<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Dedup::from_parts(
            inner,
            self.store.clone(),
            Arc::new(self.config.clone()),
            self.tasks.clone(),
        )
    }
}

impl<S, St: Store> Dedup<S, St> {
    /// A layer over `store`.
    pub fn layer(store: St) -> DedupLayer<St> {
        DedupLayer::new(store)
    }
}
