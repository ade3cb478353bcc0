//! Waiting duplicates on one instance share one poller per key: one small
//! read per interval, however many wait.

use super::scripts::OWNER_LEN;
use super::RedisStore;
use redis::aio::ConnectionLike;
use redis::RedisError;
use std::time::Duration;
use tower_idempotency_core::store::{Poller, Pollers, Watch};

/// This instance's pollers: per key, the first bytes of the in-flight value
/// (the owner) its waiters wait on.
pub(super) type KeyPollers = Pollers<String, [u8; OWNER_LEN]>;

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The owner on this instance completed or released `key`: wake this
    /// instance's waiters now instead of at the poller's next look. (The
    /// poller itself stops at its next look, when it sees the change.)
    pub(super) fn wake_local_waiters(&self, key: &str) {
        self.pollers.wake(key);
    }

    /// A watch shared by every waiter of this instance on `key` while it is
    /// held by the in-flight value starting with `owner`.
    pub(super) fn watch(&self, key: String, owner: [u8; OWNER_LEN]) -> Watch {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Watch::poll(self.poll_interval);
        };
        // A replaced poller watched an older owner: it notices the change at
        // its next look and wakes its waiters.
        self.pollers.watch(key, owner, |poller| {
            runtime.spawn(poll(
                self.conn.clone(),
                self.pollers.clone(),
                poller.clone(),
                self.poll_interval,
            ));
        })
    }
}

/// Every `interval`, one `GETRANGE` of the key's first bytes; stops (and
/// wakes the poller's waiters) when they are no longer the owner, on an
/// error, or when the poller is idle.
async fn poll<C: ConnectionLike + Send>(
    mut conn: C,
    pollers: KeyPollers,
    poller: Poller<String, [u8; OWNER_LEN]>,
    interval: Duration,
) {
    loop {
        tokio::time::sleep(interval).await;
        if poller.is_idle() {
            break;
        }
        let head: Result<Vec<u8>, RedisError> = redis::cmd("GETRANGE")
            .arg(poller.key())
            .arg(0)
            .arg(OWNER_LEN - 1)
            .query_async(&mut conn)
            .await;
        match head {
            Ok(head) if head == poller.owner()[..] => {}
            Ok(_) => break,
            // The waiters claim again and meet the error themselves.
            Err(_) => break,
        }
    }
    pollers.stop(&poller);
}
