//! Fencing tokens: what a claim that won holds.

use super::OwnerToken;

/// What a claim that won holds: the caller's owner token and the claim's
/// fencing token.
///
/// The fencing token is a number that grows per key: every claim that wins a
/// key (after a release, a lease that ran out, a forgotten or expired record)
/// gets a strictly larger one than every claim of that key before it, and
/// two claims of one key never share one. A resent claim by the same owner
/// gets its own token again. Hand it to whatever the owner writes, and let
/// that write be refused when a larger token has written already
/// (`UPDATE … SET …, fence = :token WHERE id = :id AND fence < :token`):
/// an owner whose lease ran out while it still worked can then no longer
/// write over the owner that took the key over.
///
/// It compares equal to its [`OwnerToken`], so that
/// `matches!(claim, Claim::Acquired(held) if held == token)` reads as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ownership {
    /// The owner token the claim was made with.
    pub owner: OwnerToken,
    /// The fencing token of the claim.
    pub fence: u64,
}

impl Ownership {
    /// `owner`'s claim with fencing token `fence`.
    pub const fn new(owner: OwnerToken, fence: u64) -> Self {
        Self { owner, fence }
    }
}

impl PartialEq<OwnerToken> for Ownership {
    fn eq(&self, other: &OwnerToken) -> bool {
        self.owner == *other
    }
}

/// The floor of the fencing tokens a store that keeps its counters in
/// memory hands out: microseconds since the Unix epoch on this machine's
/// clock (0 before 1970), so that a restarted process still hands out
/// tokens larger than those of its previous run.
pub fn fence_floor() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}
