//! [`Shares`]: the default cap of each route within a pool that several
//! routes share, so that one slow route cannot hold every slot.

use super::Slots;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Per name (a route's prefix), a pool of at most half of a shared pool's
/// slots, the same for every clone: a route with no cap of its own holds at
/// most that much of the upstream's calls, so that the other routes (the
/// callbacks behind a hung client API) keep the rest.
#[derive(Clone)]
pub(crate) struct Shares {
    max: usize,
    by_name: Arc<Mutex<HashMap<String, Slots>>>,
}

impl Shares {
    /// The shares of a pool of `pool` slots: half of it each (at least one).
    pub(crate) fn new(pool: usize) -> Self {
        Self {
            max: (pool / 2).max(1),
            by_name: Arc::default(),
        }
    }

    /// The share named `name`: one pool per name, shared by every clone.
    pub(crate) fn get(&self, name: &str) -> Slots {
        let mut by_name = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        by_name
            .entry(name.to_owned())
            .or_insert_with(|| Slots::new(self.max))
            .clone()
    }
}

impl fmt::Debug for Shares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shares").field("max", &self.max).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::Shares;

    #[test]
    fn one_pool_per_name_of_half_the_slots() {
        let shares = Shares::new(1024);
        let a = shares.get("/api");
        assert_eq!(a.max(), 512);
        let _held = a.try_acquire().unwrap();
        // Another clone, the same name: the same pool.
        assert_eq!(shares.clone().get("/api").in_flight(), 1);
        assert_eq!(shares.get("/notify").in_flight(), 0);
        assert_eq!(Shares::new(1).get("/").max(), 1);
        assert_eq!(Shares::new(3).get("/").max(), 1);
    }
}
