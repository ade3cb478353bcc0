//! Fencing tokens: every claim that wins a key gets a larger token than
//! every claim of that key before it, whatever happened in between.

use super::*;

/// The fencing token of a claim that won.
#[track_caller]
pub fn fence(claim: &Claim) -> u64 {
    match claim {
        Claim::Acquired(held) => held.fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn claim_as<S: Store>(store: &S, key: &str, owner: OwnerToken, lease: Duration) -> Claim {
    store
        .claim(key, fp("fence"), owner, lease)
        .await
        .expect("claim")
}

/// Back-to-back claims of one key, each released by its owner: every
/// winner's fencing token is larger than the one before, a resent claim
/// keeps its token, and other keys' tokens are never zero.
pub async fn fences_grow_across_release<S: Store>(store: S) {
    let key = unique_key("fence-release");
    let mut last = 0;
    // Back to back, so that a store whose clock has not moved on must still
    // count up.
    for _ in 0..20 {
        let owner = OwnerToken::new();
        let got = claim_as(&store, &key, owner, LEASE).await;
        let f = fence(&got);
        assert!(f > last, "fence {f} after {last}");
        // A resent claim by the same owner keeps its token.
        assert_eq!(fence(&claim_as(&store, &key, owner, LEASE).await), f);
        assert!(store.release(&key, owner).await.unwrap());
        last = f;
    }
    // Other keys have fences of their own, but never zero.
    assert!(fence(&claim(&store, &unique_key("fence-other"), fp("fence"), LEASE).await) > 0);
}

/// A claim taken over after its lease ran out: the new owner's fencing
/// token is larger.
pub async fn fences_grow_across_lease_takeover<S: Store>(store: S) {
    let key = unique_key("fence-takeover");
    let old = OwnerToken::new();
    let first = fence(&claim_as(&store, &key, old, Duration::from_millis(200)).await);
    tokio::time::sleep(Duration::from_millis(350)).await;
    let new = OwnerToken::new();
    let second = fence(&claim_as(&store, &key, new, LEASE).await);
    assert!(second > first, "takeover got {second} after {first}");
    // The late owner's resent claim finds the new owner, not its own token.
    assert_in_flight(&claim_as(&store, &key, old, LEASE).await, fp("fence"));
}

/// A completed record forgotten and claimed again: the new fencing token is
/// larger.
pub async fn fences_grow_across_forget<S: Store>(store: S) {
    let key = unique_key("fence-forget");
    let mut last = 0;
    for _ in 0..3 {
        let owner = OwnerToken::new();
        let f = fence(&claim_as(&store, &key, owner, LEASE).await);
        assert!(f > last, "fence {f} after {last}");
        let rec = record(fp("fence"), false, false);
        assert!(store.complete(&key, owner, rec, WINDOW).await.unwrap());
        assert_eq!(store.forget(&key).await.unwrap(), Forgotten::Deleted);
        last = f;
    }
}

/// A completed record whose window ended, claimed again: the new fencing
/// token is larger.
pub async fn fences_grow_across_record_expiry<S: Store>(store: S) {
    let key = unique_key("fence-expiry");
    let owner = OwnerToken::new();
    let first = fence(&claim_as(&store, &key, owner, LEASE).await);
    let rec = record(fp("fence"), false, false);
    assert!(store
        .complete(&key, owner, rec, Duration::from_millis(300))
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(600)).await;
    let second = fence(&claim(&store, &key, fp("fence"), LEASE).await);
    assert!(second > first, "after expiry {second} after {first}");
}

/// Claimers that race for one key, each releasing soon after it wins and
/// the others waiting as duplicates do: the tokens, in the order the owners
/// held the key, strictly grow.
pub async fn concurrent_claimers_never_share_a_fence<S: Store>(store: S) {
    const TASKS: usize = 12;
    const ROUNDS: usize = 4;
    let key: Arc<str> = unique_key("fence-storm").into();
    let held = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, key, held, barrier) =
                (store.clone(), key.clone(), held.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut won = 0;
                while won < ROUNDS {
                    let owner = OwnerToken::new();
                    match store.claim(&key, fp("fence"), owner, LEASE).await.unwrap() {
                        Claim::Acquired(h) => {
                            // Recorded while the key is held: the order of
                            // the list is the order of the owners.
                            held.lock().await.push(h.fence);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            assert!(store.release(&key, owner).await.unwrap());
                            won += 1;
                        }
                        // As the layer's duplicates do: wait for the owner.
                        Claim::InFlight { watch, .. } => {
                            let _ = tokio::time::timeout(LEASE, watch.changed()).await;
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let held = held.lock().await;
    assert_eq!(held.len(), TASKS * ROUNDS);
    for pair in held.windows(2) {
        assert!(pair[1] > pair[0], "fences {} then {}", pair[0], pair[1]);
    }
}
