//! The epoch marker: a key written once, without expiry, whose absence
//! tells that Redis lost its data (a flush, or a restart without
//! persistence) and with it every record.

use super::{lock, RedisStore};
use redis::aio::ConnectionLike;
use redis::RedisError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The marker's key, after the store's prefix.
pub(super) const EPOCH_KEY: &str = "idem:epoch";

/// One store's (and its clones') view of the marker.
pub(super) struct Epoch {
    /// The marker value last seen; `None` before the first look.
    known: Mutex<Option<Vec<u8>>>,
    started: Instant,
    /// When the marker was last looked at (ms since `started`, plus 1).
    last_check: AtomicU64,
    checking: AtomicBool,
    losses: AtomicU64,
}

impl Epoch {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            known: Mutex::new(None),
            started: Instant::now(),
            last_check: AtomicU64::new(0),
            checking: AtomicBool::new(false),
            losses: AtomicU64::new(0),
        })
    }

    pub(super) fn losses(&self) -> u64 {
        self.losses.load(Ordering::Relaxed)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Looks at the marker in the background if the last look is older
    /// than the check interval: at most one `GET` per interval and instance
    /// (plus one `SET NX` when the marker must be written).
    pub(super) fn check_epoch_soon(&self) {
        let Some(interval) = self.epoch_interval else {
            return;
        };
        let epoch = &self.epoch;
        let now = u64::try_from(epoch.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = epoch.last_check.load(Ordering::Relaxed);
        let due =
            last == 0 || now + 1 >= last + u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
        if !due || epoch.checking.swap(true, Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            epoch.checking.store(false, Ordering::Release);
            return;
        };
        epoch.last_check.store(now + 1, Ordering::Relaxed);
        let (store, epoch) = (self.clone(), self.epoch.clone());
        runtime.spawn(async move {
            // A failed look is tried again at the next interval.
            let _ = store.check_epoch().await;
            epoch.checking.store(false, Ordering::Release);
        });
    }

    /// Looks at the marker now: writes it if absent (`SET NX`, no expiry),
    /// and counts a data loss when a marker seen before is gone or was
    /// replaced. Returns whether a loss was seen.
    pub(super) async fn check_epoch(&self) -> Result<bool, RedisError> {
        let key = format!("{}{EPOCH_KEY}", self.prefix);
        let mut conn = self.conn.clone();
        let found: Option<Vec<u8>> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        let current = match found {
            Some(v) => v,
            None => {
                let mine = tower_idempotency_core::store::OwnerToken::new()
                    .as_u128()
                    .to_be_bytes()
                    .to_vec();
                let set: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg(&mine[..])
                    .arg("NX")
                    .query_async(&mut conn)
                    .await?;
                if set.is_some() {
                    mine
                } else {
                    // Another instance wrote it first.
                    let again: Option<Vec<u8>> =
                        redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
                    again.unwrap_or(mine)
                }
            }
        };
        let lost = {
            let mut known = lock(&self.epoch.known);
            let lost = known.as_ref().is_some_and(|k| *k != current);
            *known = Some(current);
            lost
        };
        if lost {
            self.epoch.losses.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("idempotency_store_data_loss_total").increment(1);
            #[cfg(feature = "tracing")]
            tracing::warn!(
                marker = %key,
                "redis lost its data (flushed, or restarted without persistence): every \
                 completed record is gone and retries of those keys will run again; \
                 turn on AOF (appendonly yes, appendfsync always)"
            );
        }
        Ok(lost)
    }
}

/// How often the marker is looked at by default.
pub(super) const EPOCH_INTERVAL: Duration = Duration::from_secs(1);
