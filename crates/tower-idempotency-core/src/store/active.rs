//! [`ActiveClaim`]: the claim a request holds while its inner service runs.

use super::OwnerToken;
use crate::Fingerprint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The claim the dedup layer holds for a request, put into the request's
/// extensions while the inner service runs.
///
/// With the SQL store of `tower-idempotency-sqlx` a handler can complete the
/// record inside its own business transaction (`claim.complete_in(&mut tx,
/// &response)`, its `CompleteIn` trait), so that the business write and "this key is done" commit
/// together or not at all. The layer then writes no record of its own for
/// that call. Other stores ignore it.
///
/// It also carries the claim's [fencing token](super::Ownership): a number that
/// grows per key, so that a handler can refuse the write of an owner whose
/// lease ran out after a newer owner took the key over:
///
/// ```
/// use tower_idempotency::store::ActiveClaim;
///
/// // In a handler behind the dedup layer.
/// fn handle(req: &http::Request<()>) -> Option<u64> {
///     let claim = req.extensions().get::<ActiveClaim>()?;
///     // UPDATE orders SET state = 'paid', fence = $1 WHERE id = $2 AND fence < $1
///     Some(claim.fence())
/// }
/// # let _ = handle;
/// ```
#[derive(Clone, Debug)]
pub struct ActiveClaim {
    key: Arc<str>,
    owner: OwnerToken,
    fence: u64,
    fingerprint: Fingerprint,
    window: Duration,
    completed: Arc<AtomicBool>,
}

impl ActiveClaim {
    /// A claim of `key` (the stored key, as the store sees it) by `owner`,
    /// whose record is kept for `window` once completed.
    pub fn new(
        key: Arc<str>,
        owner: OwnerToken,
        fingerprint: Fingerprint,
        window: Duration,
    ) -> Self {
        Self {
            key,
            owner,
            fence: 0,
            fingerprint,
            window,
            completed: Arc::default(),
        }
    }

    /// The same claim with fencing token `fence` (0 unless set).
    pub fn with_fence(mut self, fence: u64) -> Self {
        self.fence = fence;
        self
    }

    /// The claim's fencing token: larger than the token of every earlier
    /// claim of the same key, so that a write carrying it can be refused
    /// once a newer owner has written
    /// (`… WHERE id = :id AND fence < :token`). The gateway sends it
    /// upstream as `idempotency-fencing-token`.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The stored key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The owner token of the claim.
    pub fn owner(&self) -> OwnerToken {
        self.owner
    }

    /// The fingerprint of the request that holds the claim.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// How long the completed record is kept.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Whether the inner service completed the record itself (in its own
    /// transaction): the layer then only releases the claim, which changes
    /// nothing once that transaction has committed.
    pub fn completed_by_handler(&self) -> bool {
        self.completed.load(Ordering::Acquire)
    }

    /// Says that the inner service completed the record itself, in its own
    /// transaction (a store's `complete_in` calls it once its write
    /// succeeded): the layer then writes no record of its own and only
    /// releases the claim.
    pub fn mark_completed(&self) {
        self.completed.store(true, Ordering::Release);
    }
}
