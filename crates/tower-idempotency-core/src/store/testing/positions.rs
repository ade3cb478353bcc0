//! Positions: an object's applied position only moves forward, in one
//! compare-and-set, and is kept at least as long as asked.

use super::*;
use crate::store::{Advance, Position};

/// The time to live of the cases' positions unless a case says otherwise.
const TTL: Duration = Duration::from_secs(3600);

/// Advances `object` to `position`.
///
/// # Panics
///
/// If the store answers an error.
pub async fn advance<S: Store>(store: &S, object: &str, position: Position) -> Advance {
    store.advance(object, position, TTL).await.expect("advance")
}

/// An object without a position takes any; a later one moves it forward,
/// by version or, within one version, by rank; the read answers the last.
pub async fn advance_moves_forward<S: Store>(store: S) {
    let object = unique_key("advance-forward");
    assert_eq!(store.position(&object).await.unwrap(), None);
    // Below zero too: a version is any i64.
    for p in [
        Position::new(-5, 9),
        Position::new(0, 0),
        Position::new(0, 1),
        Position::new(1_700_000_000, 0),
        Position::new(1_700_000_000, 4),
        Position::new(1_700_000_001, 0),
    ] {
        assert_eq!(advance(&store, &object, p).await, Advance::Moved, "{p}");
        assert_eq!(store.position(&object).await.unwrap(), Some(p));
    }
    // Objects are independent.
    let other = unique_key("advance-forward-other");
    assert_eq!(store.position(&other).await.unwrap(), None);
    assert_eq!(
        advance(&store, &other, Position::new(1, 0)).await,
        Advance::Moved
    );
}

/// An equal position and every position behind are refused, with the
/// position kept, and change nothing.
pub async fn advance_refuses_equal_and_behind<S: Store>(store: S) {
    let object = unique_key("advance-behind");
    let at = Position::new(1_700_000_000, 3);
    assert_eq!(advance(&store, &object, at).await, Advance::Moved);
    for p in [
        at,
        Position::new(1_700_000_000, 2),
        Position::new(1_699_999_999, 9),
        Position::new(i64::MIN, 0),
    ] {
        assert_eq!(
            advance(&store, &object, p).await,
            Advance::Behind(at),
            "{p}"
        );
    }
    assert_eq!(store.position(&object).await.unwrap(), Some(at));
}

/// 50 tasks advance one object at the same instant, each to a position of
/// its own (ranks and versions shuffled so that smaller ones often come
/// later): the accepted positions, in the order they were accepted, are
/// strictly increasing, the largest is accepted, and it is the one kept.
pub async fn concurrent_advances_only_move_forward<S: Store>(store: S) {
    const N: u32 = 50;
    let object: Arc<str> = unique_key("advance-storm").into();
    let barrier = Arc::new(tokio::sync::Barrier::new(N as usize));
    let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            // 0, 37, 24, 11, ...: a permutation of 0..N (37 is prime to 50).
            let n = (i * 37) % N;
            let p = Position::new(i64::from(n / 5), n % 5);
            let (store, object, barrier, accepted) = (
                store.clone(),
                object.clone(),
                barrier.clone(),
                accepted.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                let got = store.advance(&object, p, TTL).await.unwrap();
                match got {
                    Advance::Moved => accepted.lock().unwrap().push(p),
                    Advance::Behind(at) => assert!(at >= p, "{p} refused at {at}"),
                }
                got
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let top = Position::new(i64::from((N - 1) / 5), (N - 1) % 5);
    let accepted = accepted.lock().unwrap().clone();
    assert!(accepted.contains(&top), "the largest is always accepted");
    assert_eq!(store.position(&object).await.unwrap(), Some(top));
    // Every accepted position was ahead of what the store held, so no two
    // accepted ones are equal.
    let mut sorted = accepted.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), accepted.len(), "accepted twice: {accepted:?}");
}

/// A position is kept at least as long as its time to live, and each
/// advance keeps it for its own time to live from then; a refused advance
/// does not shorten it.
pub async fn positions_are_kept_for_their_ttl<S: Store>(store: S) {
    let object = unique_key("advance-ttl");
    let ttl = Duration::from_millis(1500);
    let first = Position::new(1, 0);
    assert_eq!(
        store.advance(&object, first, ttl).await.unwrap(),
        Advance::Moved
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(store.position(&object).await.unwrap(), Some(first));
    // A refused advance with a short ttl leaves the longer one.
    assert_eq!(
        store
            .advance(&object, first, Duration::from_millis(100))
            .await
            .unwrap(),
        Advance::Behind(first)
    );
    let second = Position::new(2, 0);
    assert_eq!(
        store.advance(&object, second, ttl).await.unwrap(),
        Advance::Moved
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // 1.8 s after the first advance, 1.1 s after the second.
    assert_eq!(store.position(&object).await.unwrap(), Some(second));
    assert_eq!(
        store.advance(&object, first, ttl).await.unwrap(),
        Advance::Behind(second)
    );
    // Once it ran out, the object starts afresh.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(store.position(&object).await.unwrap(), None);
    assert_eq!(
        store.advance(&object, first, ttl).await.unwrap(),
        Advance::Moved
    );
}
