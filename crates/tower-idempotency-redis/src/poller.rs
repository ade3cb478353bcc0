//! Waiting duplicates on one instance share one poller per key: one small
//! read per interval, however many wait.

use super::scripts::OWNER_LEN;
use super::{lock, RedisStore};
use redis::aio::ConnectionLike;
use redis::RedisError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tower_idempotency::store::{Watch, WatchSender};

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The owner on this instance completed or released `key`: wake this
    /// instance's waiters now instead of at the poller's next look. (The
    /// poller itself stops at its next look, when it sees the change.)
    pub(super) fn wake_local_waiters(&self, key: &str) {
        let poller = lock(&self.pollers).remove(key);
        if let Some(poller) = poller {
            poller.sender.notify();
        }
    }

    /// A watch shared by every waiter of this instance on `key` while it is
    /// held by the in-flight value starting with `owner`.
    pub(super) fn watch(&self, key: String, owner: [u8; OWNER_LEN]) -> Watch {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Watch::poll(self.poll_interval);
        };
        let mut pollers = lock(&self.pollers);
        if let Some(poller) = pollers.get(&key) {
            if poller.owner == owner {
                *lock(&poller.last_subscribed) = Instant::now();
                return poller.sender.subscribe();
            }
        }
        let poller = Arc::new(Poller {
            owner,
            sender: WatchSender::new(),
            last_subscribed: Mutex::new(Instant::now()),
        });
        let watch = poller.sender.subscribe();
        // A replaced poller watched an older owner: it notices the change at
        // its next look and wakes its waiters.
        pollers.insert(key.clone(), poller.clone());
        drop(pollers);
        runtime.spawn(poll(
            self.conn.clone(),
            self.pollers.clone(),
            key,
            poller,
            self.poll_interval,
        ));
        watch
    }
}

/// One instance's look-out on one in-flight key.
pub(super) struct Poller {
    owner: [u8; OWNER_LEN],
    sender: WatchSender,
    last_subscribed: Mutex<Instant>,
}

/// A poller stops after this long without a new waiter; it wakes the
/// waiters left, which claim again and start a new one if they still wait.
const POLLER_IDLE: Duration = Duration::from_secs(5);

async fn poll<C: ConnectionLike + Send>(
    mut conn: C,
    pollers: Arc<Mutex<HashMap<String, Arc<Poller>>>>,
    key: String,
    poller: Arc<Poller>,
    interval: Duration,
) {
    loop {
        tokio::time::sleep(interval).await;
        if lock(&poller.last_subscribed).elapsed() > POLLER_IDLE {
            break;
        }
        let head: Result<Vec<u8>, RedisError> = redis::cmd("GETRANGE")
            .arg(&key)
            .arg(0)
            .arg(OWNER_LEN - 1)
            .query_async(&mut conn)
            .await;
        match head {
            Ok(head) if head == poller.owner => {}
            Ok(_) => break,
            // The waiters claim again and meet the error themselves.
            Err(_) => break,
        }
    }
    {
        let mut pollers = lock(&pollers);
        if pollers.get(&key).is_some_and(|p| Arc::ptr_eq(p, &poller)) {
            pollers.remove(&key);
        }
    }
    poller.sender.notify();
}
