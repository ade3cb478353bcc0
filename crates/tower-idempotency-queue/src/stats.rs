//! What a broker-backed queue reports as its [`QueueStats`]: the count of
//! entries waiting, of dead letters, and the age of the oldest entry.

use super::QueueStats;
use crate::common::now_ms;
use std::time::Duration;

/// The stats of a queue that counts its entries and dead letters and knows
/// when its oldest waiting entry was stored (ms since the Unix epoch;
/// `None` when nothing waits). The oldest entry's age is measured from
/// now, by this process's clock.
#[cfg_attr(not(any(feature = "redis", feature = "nats")), allow(dead_code))]
pub(super) fn counted(depth: u64, dead: u64, oldest_stored_ms: Option<u64>) -> QueueStats {
    QueueStats {
        depth,
        oldest: oldest_stored_ms.map(|t| Duration::from_millis(now_ms().saturating_sub(t))),
        dead,
        ..QueueStats::default()
    }
}
