//! [`Watch`]: how a waiting copy learns that a record may have changed.

use std::time::Duration;
use tokio::sync::watch;

/// Tells a waiting duplicate when to look at the record again.
///
/// Stores that see changes (the memory store) hand out a subscription to one
/// shared channel per key; stores that poll their backend share one poller
/// per key among an instance's waiters with [`Pollers`](super::Pollers); others hand out a
/// poll interval.
#[derive(Debug)]
pub struct Watch {
    kind: WatchKind,
}

#[derive(Debug)]
enum WatchKind {
    Channel(watch::Receiver<()>),
    Poll(Duration),
}

/// The sending side of a [`Watch`]: dropping it (or calling
/// [`notify`](Self::notify)) wakes every waiter.
#[derive(Debug)]
pub struct WatchSender(watch::Sender<()>);

impl WatchSender {
    /// A new channel with no subscribers.
    pub fn new() -> Self {
        Self(watch::Sender::new(()))
    }

    /// A new subscription.
    pub fn subscribe(&self) -> Watch {
        Watch {
            kind: WatchKind::Channel(self.0.subscribe()),
        }
    }

    /// Wakes every subscriber.
    pub fn notify(&self) {
        self.0.send_replace(());
    }
}

impl Default for WatchSender {
    fn default() -> Self {
        Self::new()
    }
}

impl Watch {
    /// A watch that only waits for `interval` (for stores that must be polled).
    pub fn poll(interval: Duration) -> Self {
        Self {
            kind: WatchKind::Poll(interval),
        }
    }

    /// Waits until the record may have changed.
    pub async fn changed(self) {
        match self.kind {
            // Err means the sender is gone: the owner finished one way or another.
            WatchKind::Channel(mut rx) => {
                let _ = rx.changed().await;
            }
            WatchKind::Poll(interval) => tokio::time::sleep(interval).await,
        }
    }
}
