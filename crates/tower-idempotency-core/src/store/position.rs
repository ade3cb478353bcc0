//! Where an event stands in its object's life, and what an advance found.

use std::fmt;

/// Where an event stands in the life of the object it is about: its
/// version first (a number the sender counts up, or a time), then the rank
/// of its state, which breaks ties between events of one version.
///
/// Positions compare as `(version, rank)`. An order without a version
/// places every event at version 0, so the rank alone decides.
///
/// ```
/// use tower_idempotency_core::store::Position;
///
/// let processing = Position::new(1_700_000_000, 2);
/// let succeeded = Position::new(1_700_000_000, 6);
/// assert!(processing < succeeded);
/// assert!(succeeded < Position::new(1_700_000_001, 0));
/// assert_eq!(Position::decode(&succeeded.encode()), Some(succeeded));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    version: i64,
    rank: u32,
}

impl Position {
    /// The position of version `version` and state rank `rank`.
    pub const fn new(version: i64, rank: u32) -> Self {
        Self { version, rank }
    }

    /// The version (0 for an order without one).
    pub const fn version(self) -> i64 {
        self.version
    }

    /// The rank of the state.
    pub const fn rank(self) -> u32 {
        self.rank
    }

    /// The position as 24 lower-case hex digits that sort as positions do
    /// (the version with its sign bit flipped, then the rank): what a store
    /// over the network keeps and compares.
    pub fn encode(self) -> String {
        let biased = (self.version as u64) ^ (1 << 63);
        format!("{biased:016x}{:08x}", self.rank)
    }

    /// Reads [`encode`](Self::encode)'s form back; `None` for anything else.
    pub fn decode(s: &str) -> Option<Self> {
        if s.len() != 24 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let biased = u64::from_str_radix(&s[..16], 16).ok()?;
        let rank = u32::from_str_radix(&s[16..], 16).ok()?;
        Some(Self {
            version: (biased ^ (1 << 63)) as i64,
            rank,
        })
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.version, self.rank)
    }
}

/// What [`Store::advance`](super::Store::advance) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Advance {
    /// The object's position is now the one given (it was behind it, or
    /// the object had none).
    Moved,
    /// The object is already at or past the position given: nothing
    /// changed. Carries the position it is at.
    Behind(Position),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_sorts_as_positions_do() {
        let all = [
            Position::new(i64::MIN, 0),
            Position::new(-1, u32::MAX),
            Position::new(0, 0),
            Position::new(0, 1),
            Position::new(1, 0),
            Position::new(1_700_000_000_000_000, 3),
            Position::new(i64::MAX, u32::MAX),
        ];
        let encoded: Vec<String> = all.iter().map(|p| p.encode()).collect();
        let mut sorted = encoded.clone();
        sorted.sort();
        assert_eq!(encoded, sorted);
        for (p, e) in all.iter().zip(&encoded) {
            assert_eq!(Position::decode(e), Some(*p));
        }
        assert!(Position::decode("00").is_none());
        assert!(Position::decode("8000000000000000000000AA").is_none());
    }
}
