//! One poller per in-flight key, shared by every waiting duplicate of one
//! instance: the bookkeeping of a store whose waiters must poll the backend.

use super::{Watch, WatchSender};
use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

/// The pollers of one store instance: for each in-flight key that
/// duplicates on this instance wait on, one [`Poller`] and one shared
/// [`Watch`] channel, however many wait.
///
/// For a [`Store`](super::Store) whose backend cannot push changes (or not
/// reliably): a claim that finds a key in flight under `owner` asks
/// [`watch`](Self::watch) for its [`Watch`]. Waiters of the same key and
/// owner share one poller; a new owner (the old one's lease ran out, and a
/// claim took the key over) gets a new one. The store looks at its backend
/// every interval, by itself, in one of two ways:
///
/// - **a task per key**: `watch` calls its `start` with each new poller;
///   the store spawns a task that looks at that key every interval and
///   calls [`stop`](Self::stop) when the key's owner is no longer the
///   poller's, when the look fails, or when the poller
///   [is idle](Poller::is_idle);
/// - **one loop for every key**: `start` spawns one loop if none runs; each
///   round, [`active`](Self::active) stops the idle pollers and hands out
///   the others, which the store looks up together (one statement for many
///   keys), then stops those whose owner changed.
///
/// An owner on this instance that completes or releases its key calls
/// [`wake`](Self::wake): its waiters look again at once, instead of at the
/// next look. A poller stops after [`IDLE`](Self::IDLE) without a new
/// waiter, and wakes the waiters it still has: they claim again and start
/// a new one if they still wait. Waking a waiter is never wrong: it only
/// makes it claim again and find out for itself.
///
/// `K` is the key as the store keeps it (a `String`, bytes), `O` the owner
/// as the backend shows it (the owner token's bytes). Clones share the
/// pollers.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::store::{Poller, Pollers};
///
/// /// The owner the backend shows for `key` now (here: nobody, it completed).
/// async fn owner_of(_key: &str) -> Result<Option<u64>, std::io::Error> {
///     Ok(None)
/// }
///
/// /// A task per key: looks every 25 ms until the key's owner changes.
/// async fn poll(pollers: Pollers<String, u64>, poller: Poller<String, u64>) {
///     loop {
///         tokio::time::sleep(Duration::from_millis(25)).await;
///         if poller.is_idle() {
///             break;
///         }
///         match owner_of(poller.key()).await {
///             Ok(Some(owner)) if owner == *poller.owner() => {}
///             // Changed, or the look failed: the waiters claim again.
///             _ => break,
///         }
///     }
///     pollers.stop(&poller);
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let pollers: Pollers<String, u64> = Pollers::new();
/// let start = |poller: &Poller<String, u64>| {
///     tokio::spawn(poll(pollers.clone(), poller.clone()));
/// };
/// // Two duplicates wait on the key that owner 7 holds: one poller.
/// let first = pollers.watch("order-42".to_owned(), 7, start);
/// let second = pollers.watch("order-42".to_owned(), 7, |_| unreachable!());
/// assert_eq!(pollers.len(), 1);
/// // At its first look the poller finds the key no longer held by 7.
/// first.changed().await;
/// second.changed().await;
/// assert!(pollers.is_empty());
/// # }
/// ```
pub struct Pollers<K, O> {
    map: Arc<Mutex<HashMap<K, Poller<K, O>>>>,
}

/// One instance's look-out on one in-flight key, held by one owner: what
/// [`Pollers::watch`] hands to the store's polling. Clones are the same
/// poller.
pub struct Poller<K, O>(Arc<Inner<K, O>>);

struct Inner<K, O> {
    key: K,
    owner: O,
    /// Dropped with the last clone: that too wakes the waiters.
    sender: WatchSender,
    last_subscribed: Mutex<Instant>,
}

impl<K, O> Pollers<K, O> {
    /// How long a poller lasts without a new waiter: 5 seconds. Then it
    /// stops and wakes the waiters it still has.
    pub const IDLE: Duration = Duration::from_secs(5);

    /// No pollers.
    pub fn new() -> Self {
        Self {
            map: Arc::default(),
        }
    }

    /// How many keys are watched.
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }

    /// Whether no key is watched.
    pub fn is_empty(&self) -> bool {
        lock(&self.map).is_empty()
    }
}

impl<K, O> Pollers<K, O>
where
    K: Hash + Eq + Clone,
    O: PartialEq,
{
    /// A watch on `key` while `owner` holds it, shared by every waiter of
    /// this instance on the same key and owner.
    ///
    /// When a poller of `key` and `owner` exists, the watch is one more
    /// subscription to it, and it is no longer idle (its [`IDLE`](Self::IDLE)
    /// time starts again). Otherwise a new poller takes the key's place
    /// (one of an older owner is replaced: its waiters are woken when its
    /// last clone is dropped or it is [stopped](Self::stop)) and `start` is
    /// called with it, so that the store looks at the key.
    ///
    /// `start` runs under the pollers' lock: what it starts and what
    /// [`active`](Self::active)'s `when_empty` stops cannot miss each other.
    /// So it must not call these pollers itself (spawn a task that does),
    /// and must not block.
    pub fn watch(&self, key: K, owner: O, start: impl FnOnce(&Poller<K, O>)) -> Watch {
        let mut map = lock(&self.map);
        if let Some(poller) = map.get(&key)
            && poller.0.owner == owner
        {
            *lock(&poller.0.last_subscribed) = Instant::now();
            return poller.0.sender.subscribe();
        }
        let poller = Poller(Arc::new(Inner {
            key: key.clone(),
            owner,
            sender: WatchSender::new(),
            last_subscribed: Mutex::new(Instant::now()),
        }));
        let watch = poller.0.sender.subscribe();
        // A replaced poller watched an older owner: dropped here unless its
        // polling holds it, which notices the change at its next look.
        map.insert(key, poller.clone());
        start(&poller);
        drop(map);
        watch
    }

    /// The owner on this instance completed or released `key`: wakes the
    /// waiters of `key` now and forgets its poller (whose polling stops at
    /// its next look, when it sees the change).
    pub fn wake<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let poller = lock(&self.map).remove(key);
        if let Some(poller) = poller {
            poller.0.sender.notify();
        }
    }

    /// The end of `poller`'s polling: forgets it unless another poller
    /// took its key's place since, and wakes its waiters.
    pub fn stop(&self, poller: &Poller<K, O>) {
        {
            let mut map = lock(&self.map);
            if map
                .get(&poller.0.key)
                .is_some_and(|p| Arc::ptr_eq(&p.0, &poller.0))
            {
                map.remove(&poller.0.key);
            }
        }
        poller.0.sender.notify();
    }

    /// One round of a loop that looks at every key at once: stops the
    /// [idle](Poller::is_idle) pollers (their waiters are woken) and returns
    /// the others, to be looked up; stop those whose owner changed with
    /// [`stop`](Self::stop).
    ///
    /// When no poller is left, `when_empty` runs under the pollers' lock
    /// before the empty list is returned: the loop ends, and a
    /// [`watch`](Self::watch) whose `start` starts a new one (under the
    /// same lock) cannot miss that it ended.
    pub fn active(&self, when_empty: impl FnOnce()) -> Vec<Poller<K, O>> {
        let mut map = lock(&self.map);
        map.retain(|_, poller| {
            let idle = poller.is_idle();
            if idle {
                poller.0.sender.notify();
            }
            !idle
        });
        if map.is_empty() {
            when_empty();
            return Vec::new();
        }
        map.values().cloned().collect()
    }
}

impl<K, O> Poller<K, O> {
    /// The key it watches.
    pub fn key(&self) -> &K {
        &self.0.key
    }

    /// The owner its waiters wait for: while the backend shows this owner
    /// on the key, they keep waiting.
    pub fn owner(&self) -> &O {
        &self.0.owner
    }

    /// Whether no waiter came for [`Pollers::IDLE`]: the polling of one
    /// key should then stop (with [`Pollers::stop`]);
    /// [`Pollers::active`] stops such pollers itself.
    pub fn is_idle(&self) -> bool {
        lock(&self.0.last_subscribed).elapsed() > Pollers::<K, O>::IDLE
    }
}

impl<K, O> Clone for Pollers<K, O> {
    fn clone(&self) -> Self {
        Self {
            map: self.map.clone(),
        }
    }
}

impl<K, O> Default for Pollers<K, O> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, O> Clone for Poller<K, O> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<K, O> fmt::Debug for Pollers<K, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pollers")
            .field("keys", &self.len())
            .finish()
    }
}

impl<K: fmt::Debug, O: fmt::Debug> fmt::Debug for Poller<K, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Poller")
            .field("key", &self.0.key)
            .field("owner", &self.0.owner)
            .finish_non_exhaustive()
    }
}

/// A poisoned lock only means a panic elsewhere while it was held; the map
/// and the instants stay consistent, so keep going.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt as _;
    use std::cell::Cell;

    type P = Pollers<String, u8>;

    /// Whether `watch` was woken (without waiting).
    fn woken(watch: Watch) -> bool {
        watch.changed().now_or_never().is_some()
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_of_one_owner_share_one_poller() {
        let pollers = P::new();
        let started = Cell::new(0);
        let mut held = Vec::new();
        let a = pollers.watch("k".into(), 1, |p| {
            started.set(started.get() + 1);
            held.push(p.clone());
        });
        let b = pollers.watch("k".into(), 1, |_| started.set(started.get() + 1));
        assert_eq!(started.get(), 1);
        assert_eq!(pollers.len(), 1);
        assert_eq!((held[0].key().as_str(), *held[0].owner()), ("k", 1));
        // Another key: another poller.
        let _c = pollers.watch("other".into(), 1, |_| started.set(started.get() + 1));
        assert_eq!(started.get(), 2);
        pollers.wake("k");
        assert!(woken(a));
        assert!(woken(b));
        assert_eq!(pollers.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_owner_replaces_the_poller() {
        let pollers = P::new();
        let mut held = Vec::new();
        let old = pollers.watch("k".into(), 1, |p| held.push(p.clone()));
        let new = pollers.watch("k".into(), 2, |p| held.push(p.clone()));
        assert_eq!(held.len(), 2);
        assert_eq!(pollers.len(), 1);
        // The old poller's polling holds it: its waiters wait for its next
        // look, which stops it; that leaves the new poller in place.
        let (old, new) = (old.changed(), new.changed());
        tokio::pin!(old, new);
        assert!((&mut old).now_or_never().is_none());
        pollers.stop(&held[0]);
        assert!(old.now_or_never().is_some());
        assert!((&mut new).now_or_never().is_none());
        assert_eq!(pollers.len(), 1);
        let again = pollers.watch("k".into(), 2, |_| panic!("a second poller"));
        pollers.stop(&held[1]);
        assert!(new.now_or_never().is_some());
        assert!(woken(again));
        assert!(pollers.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_replaced_poller_nobody_holds_wakes_its_waiters() {
        let pollers = P::new();
        let old = pollers.watch("k".into(), 1, |_| {});
        let new = pollers.watch("k".into(), 2, |_| {});
        assert!(woken(old));
        let new = new.changed();
        tokio::pin!(new);
        assert!((&mut new).now_or_never().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn wake_of_a_key_nobody_watches_does_nothing() {
        let pollers = P::new();
        let watch = pollers.watch("k".into(), 1, |_| {});
        pollers.wake("other");
        let changed = watch.changed();
        tokio::pin!(changed);
        assert!((&mut changed).now_or_never().is_none());
        assert_eq!(pollers.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_poller_is_idle_after_five_seconds_without_a_new_waiter() {
        let pollers = P::new();
        let mut held = None;
        let _first = pollers.watch("k".into(), 1, |p| held = Some(p.clone()));
        let poller = held.unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(!poller.is_idle());
        // A new waiter: the five seconds start again.
        let _second = pollers.watch("k".into(), 1, |_| panic!("a second poller"));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(!poller.is_idle());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!poller.is_idle());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(poller.is_idle());
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_stops_the_idle_pollers_and_hands_out_the_others() {
        let pollers = P::new();
        let idle = pollers.watch("idle".into(), 1, |_| {});
        tokio::time::advance(Duration::from_secs(3)).await;
        let busy = pollers.watch("busy".into(), 1, |_| {});
        tokio::time::advance(Duration::from_millis(2001)).await;
        let ended = Cell::new(false);
        let active = pollers.active(|| ended.set(true));
        assert!(!ended.get());
        assert_eq!(active.len(), 1);
        assert_eq!(active[0].key(), "busy");
        assert!(woken(idle));
        let busy = busy.changed();
        tokio::pin!(busy);
        assert!((&mut busy).now_or_never().is_none());
        // The looked-up owner changed: stopped.
        pollers.stop(&active[0]);
        assert!(busy.now_or_never().is_some());
        assert!(pollers.active(|| ended.set(true)).is_empty());
        assert!(ended.get());
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_with_nothing_idle_leaves_every_poller() {
        let pollers = P::new();
        let _a = pollers.watch("a".into(), 1, |_| {});
        let _b = pollers.watch("b".into(), 2, |_| {});
        tokio::time::advance(Pollers::<String, u8>::IDLE).await;
        let mut keys: Vec<String> = pollers
            .active(|| panic!("not empty"))
            .iter()
            .map(|p| p.key().clone())
            .collect();
        keys.sort();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(pollers.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn pollers_with_a_task_per_key_end_when_the_owner_changes() {
        use std::sync::atomic::{AtomicU8, Ordering};
        // The backend: the owner of the one key, 0 for none.
        let owner = Arc::new(AtomicU8::new(1));
        let pollers = P::new();
        let start = |poller: &Poller<String, u8>| {
            let (pollers, poller, owner) = (pollers.clone(), poller.clone(), owner.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(25)).await;
                    if poller.is_idle() || owner.load(Ordering::SeqCst) != *poller.owner() {
                        break;
                    }
                }
                pollers.stop(&poller);
            });
        };
        let watch = pollers.watch("k".into(), 1, start);
        let changed = tokio::spawn(watch.changed());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!changed.is_finished());
        owner.store(0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(changed.is_finished());
        assert!(pollers.is_empty());
        // Nobody comes again: the poller stops after five seconds.
        owner.store(2, Ordering::SeqCst);
        let watch = pollers.watch("k".into(), 2, start);
        let changed = tokio::spawn(watch.changed());
        tokio::time::sleep(Duration::from_millis(4990)).await;
        assert!(!changed.is_finished());
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(changed.is_finished());
        assert!(pollers.is_empty());
    }
}
