//! The conformance suite every [`Store`] passes: the record life cycle,
//! owners, leases, windows, waiters, tokens, fencing tokens, positions and
//! races, one `async fn` per case, generic over the store. The memory, tiered, Redis
//! and SQL stores all run it, and so can a store of your own.
//!
//! [`store_tests!`] writes one `#[tokio::test]` per case for a store; a
//! case can also be called on its own. The cases run against a live store
//! in real time (a lease of 200 ms runs out after 200 ms), and each uses
//! keys of its own, so that they can share one server.
//!
//! ```no_run
//! use tower_idempotency::store::testing::store_tests;
//! use tower_idempotency::store::MemoryStore;
//!
//! // The store of each test, and what must stay alive while it runs (a
//! // server, a temporary file): `None` skips the test.
//! async fn memory() -> Option<(MemoryStore, ())> {
//!     Some((MemoryStore::new(), ()))
//! }
//!
//! store_tests!(memory_store, memory);
//! # fn main() {}
//! ```
//!
//! The generated tests run on tokio's multi-threaded runtime: the crate
//! that uses the macro needs `tokio` with the `macros` and
//! `rt-multi-thread` features among its dev-dependencies.

// The cases are tests: a failing one panics with what it saw.
#![allow(clippy::missing_panics_doc)]

use super::{Claim, CompletedRecord, Forgotten, OwnerToken, RecordState, Store, StoredResponse};
use crate::Fingerprint;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use std::sync::Arc;
use std::time::Duration;

mod fences;
mod positions;

pub use fences::{
    concurrent_claimers_never_share_a_fence, fence, fences_grow_across_forget,
    fences_grow_across_lease_takeover, fences_grow_across_record_expiry,
    fences_grow_across_release,
};
pub use positions::{
    advance, advance_moves_forward, advance_refuses_equal_and_behind,
    concurrent_advances_only_move_forward, positions_are_kept_for_their_ttl,
};

/// A key no other test (or earlier run against the same server) uses,
/// named after `case`.
pub fn unique_key(case: &str) -> String {
    format!(
        "idem:conformance:{case}:{:032x}",
        OwnerToken::new().as_u128()
    )
}

/// The fingerprint of `s`.
pub fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(s.as_bytes())
}

/// A completed record with `fingerprint` as a channel's answer would be:
/// `201`, repeated headers, a UTF-8 JSON body (or none, `omitted`), and
/// gRPC trailers if `trailers`.
pub fn record(fingerprint: Fingerprint, omitted: bool, trailers: bool) -> Arc<CompletedRecord> {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.append("set-cookie", HeaderValue::from_static("a=1"));
    headers.append("set-cookie", HeaderValue::from_static("b=2"));
    headers.insert("x-request-id", HeaderValue::from_static("r-42"));
    let trailers = trailers.then(|| {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        t.insert("grpc-message", HeaderValue::from_static("ok"));
        t
    });
    Arc::new(CompletedRecord {
        fingerprint,
        response: StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: if omitted {
                Bytes::new()
            } else {
                Bytes::from(r#"{"code":"SUCCESS","message":"成功"}"#)
            },
            trailers,
            body_omitted: omitted,
        },
    })
}

/// Asserts that `got` is `want`, field by field.
#[track_caller]
pub fn assert_same(got: &CompletedRecord, want: &CompletedRecord) {
    assert_eq!(got.fingerprint, want.fingerprint);
    assert_eq!(got.response.status, want.response.status);
    assert_eq!(got.response.headers, want.response.headers);
    assert_eq!(got.response.body, want.response.body);
    assert_eq!(got.response.trailers, want.response.trailers);
    assert_eq!(got.response.body_omitted, want.response.body_omitted);
}

/// The lease of the cases' claims unless a case says otherwise.
pub const LEASE: Duration = Duration::from_secs(30);
/// The window of the cases' records unless a case says otherwise.
pub const WINDOW: Duration = Duration::from_secs(3600);

/// Claims `key` for a new owner.
///
/// # Panics
///
/// If the store answers an error.
pub async fn claim<S: Store>(store: &S, key: &str, f: Fingerprint, lease: Duration) -> Claim {
    store
        .claim(key, f, OwnerToken::new(), lease)
        .await
        .expect("claim")
}

/// Asserts that `claim` acquired the key.
#[track_caller]
pub fn assert_acquired(claim: &Claim) {
    assert!(
        matches!(claim, Claim::Acquired(_)),
        "expected Acquired, got {claim:?}"
    );
}

/// Asserts that `claim` found the key in flight with fingerprint `want`.
#[track_caller]
pub fn assert_in_flight(claim: &Claim, want: Fingerprint) {
    match claim {
        Claim::InFlight { fingerprint, .. } => assert_eq!(*fingerprint, want),
        other => panic!("expected InFlight, got {other:?}"),
    }
}

/// The completed record `claim` found.
///
/// # Panics
///
/// If the claim did not find one.
#[track_caller]
pub fn completed(claim: Claim) -> Arc<CompletedRecord> {
    match claim {
        Claim::Completed(rec) => rec,
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A claim of an absent key acquires it for the caller's token; other keys
/// are independent.
pub async fn claim_on_absent_acquires<S: Store>(store: S) {
    let key = unique_key("absent");
    let token = OwnerToken::new();
    let got = store.claim(&key, fp("a"), token, LEASE).await.unwrap();
    assert!(matches!(got, Claim::Acquired(t) if t == token), "{got:?}");
    // Other keys are independent.
    assert_acquired(&claim(&store, &unique_key("absent-other"), fp("a"), LEASE).await);
}

/// A claim of a key in flight answers `InFlight` with the first claim's
/// fingerprint, whatever the second one brings.
pub async fn second_claim_sees_in_flight<S: Store>(store: S) {
    let key = unique_key("in-flight");
    assert_acquired(&claim(&store, &key, fp("first"), LEASE).await);
    // The second brings another fingerprint: it must see the first one.
    assert_in_flight(&claim(&store, &key, fp("second"), LEASE).await, fp("first"));
    assert_in_flight(&claim(&store, &key, fp("first"), LEASE).await, fp("first"));
}

/// [`claim_unwatched`](Store::claim_unwatched) answers as a claim does:
/// it acquires an absent key, finds a key in
/// flight with its owner's fingerprint, and a completed record; a key it
/// holds is released and claimed again like any other.
pub async fn unwatched_claim_answers_as_claim<S: Store>(store: S) {
    let key = unique_key("unwatched");
    let token = OwnerToken::new();
    let got = store
        .claim_unwatched(&key, fp("first"), token, LEASE)
        .await
        .unwrap();
    assert!(matches!(got, Claim::Acquired(t) if t == token), "{got:?}");
    let found = store
        .claim_unwatched(&key, fp("second"), OwnerToken::new(), LEASE)
        .await
        .unwrap();
    assert_in_flight(&found, fp("first"));
    assert_in_flight(&claim(&store, &key, fp("second"), LEASE).await, fp("first"));
    assert!(store.release(&key, token).await.unwrap());
    let again = OwnerToken::new();
    let got = store
        .claim_unwatched(&key, fp("again"), again, LEASE)
        .await
        .unwrap();
    assert!(matches!(got, Claim::Acquired(t) if t == again), "{got:?}");
    let rec = record(fp("again"), false, false);
    assert!(store
        .complete(&key, again, rec.clone(), WINDOW)
        .await
        .unwrap());
    let found = store
        .claim_unwatched(&key, fp("again"), OwnerToken::new(), LEASE)
        .await
        .unwrap();
    assert_same(&completed(found), &rec);
}

/// The owner's completion is replayed as it was: status, every header
/// (repeated ones too), body, trailers, and a body left out.
pub async fn complete_by_owner_replays_faithfully<S: Store>(store: S) {
    for (omitted, trailers) in [(false, false), (false, true), (true, false), (true, true)] {
        let key = unique_key("complete");
        let token = OwnerToken::new();
        store.claim(&key, fp("p"), token, LEASE).await.unwrap();
        let rec = record(fp("p"), omitted, trailers);
        assert!(store
            .complete(&key, token, rec.clone(), WINDOW)
            .await
            .unwrap());
        let got = completed(claim(&store, &key, fp("p"), LEASE).await);
        assert_same(&got, &rec);
        // A repeat with another payload still gets the record (the layer
        // compares fingerprints) and never a claim.
        let got = completed(claim(&store, &key, fp("other"), LEASE).await);
        assert_same(&got, &rec);
    }
}

/// Completing, renewing or releasing with a token that does not own the
/// key changes nothing.
pub async fn non_owner_changes_nothing<S: Store>(store: S) {
    let key = unique_key("non-owner");
    let owner = OwnerToken::new();
    let stranger = OwnerToken::new();
    store.claim(&key, fp("o"), owner, LEASE).await.unwrap();
    let rec = record(fp("o"), false, false);
    assert!(!store
        .complete(&key, stranger, rec.clone(), WINDOW)
        .await
        .unwrap());
    assert!(!store.renew(&key, stranger, LEASE).await.unwrap());
    assert!(!store.release(&key, stranger).await.unwrap());
    assert_in_flight(&claim(&store, &key, fp("x"), LEASE).await, fp("o"));
    // The owner still owns it.
    assert!(store.renew(&key, owner, LEASE).await.unwrap());
    assert!(store
        .complete(&key, owner, rec.clone(), WINDOW)
        .await
        .unwrap());
    // A completed record is left alone by everyone's complete, renew and
    // release, the former owner's included.
    let other = record(fp("evil"), false, false);
    for token in [stranger, owner] {
        assert!(!store
            .complete(&key, token, other.clone(), WINDOW)
            .await
            .unwrap());
        assert!(!store.renew(&key, token, LEASE).await.unwrap());
        assert!(!store.release(&key, token).await.unwrap());
    }
    assert_same(&completed(claim(&store, &key, fp("o"), LEASE).await), &rec);
}

/// The owner's release frees the key: the next claim acquires it.
pub async fn release_by_owner_frees_the_key<S: Store>(store: S) {
    let key = unique_key("release");
    let owner = OwnerToken::new();
    store.claim(&key, fp("r"), owner, LEASE).await.unwrap();
    assert!(store.release(&key, owner).await.unwrap());
    assert!(!store.release(&key, owner).await.unwrap(), "released twice");
    let next = OwnerToken::new();
    let got = store.claim(&key, fp("r"), next, LEASE).await.unwrap();
    assert!(matches!(got, Claim::Acquired(t) if t == next), "{got:?}");
    // The former owner can no longer touch the new claim.
    assert!(!store.release(&key, owner).await.unwrap());
    assert!(!store.renew(&key, owner, LEASE).await.unwrap());
    assert_in_flight(&claim(&store, &key, fp("r"), LEASE).await, fp("r"));
}

/// A claim whose lease ran out can be taken by another owner, and the late
/// owner can then neither complete, renew nor release it.
pub async fn lease_expiry_makes_it_claimable<S: Store>(store: S) {
    let key = unique_key("lease");
    let old = OwnerToken::new();
    store
        .claim(&key, fp("old"), old, Duration::from_millis(200))
        .await
        .unwrap();
    assert_in_flight(&claim(&store, &key, fp("new"), LEASE).await, fp("old"));
    tokio::time::sleep(Duration::from_millis(350)).await;
    let new = OwnerToken::new();
    let got = store.claim(&key, fp("new"), new, LEASE).await.unwrap();
    assert!(matches!(got, Claim::Acquired(t) if t == new), "{got:?}");
    // The late owner can never overwrite or delete the new claim.
    let late = record(fp("old"), false, false);
    assert!(!store.complete(&key, old, late, WINDOW).await.unwrap());
    assert!(!store.renew(&key, old, LEASE).await.unwrap());
    assert!(!store.release(&key, old).await.unwrap());
    assert_in_flight(&claim(&store, &key, fp("x"), LEASE).await, fp("new"));
}

/// `renew` extends the lease from now; the renewed lease runs out too.
pub async fn renew_extends_the_lease<S: Store>(store: S) {
    let key = unique_key("renew");
    let owner = OwnerToken::new();
    store
        .claim(&key, fp("n"), owner, Duration::from_millis(300))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(store
        .renew(&key, owner, Duration::from_millis(1000))
        .await
        .unwrap());
    // Past the original expiry (300 ms), well before the renewed one.
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_in_flight(&claim(&store, &key, fp("n"), LEASE).await, fp("n"));
    // And the renewed lease runs out too.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_acquired(&claim(&store, &key, fp("n"), LEASE).await);
}

/// A completed record is kept for its window and no longer.
pub async fn window_expiry_forgets_the_record<S: Store>(store: S) {
    let key = unique_key("window");
    let owner = OwnerToken::new();
    store.claim(&key, fp("w"), owner, LEASE).await.unwrap();
    let rec = record(fp("w"), false, false);
    assert!(store
        .complete(&key, owner, rec, Duration::from_millis(300))
        .await
        .unwrap());
    completed(claim(&store, &key, fp("w"), LEASE).await);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_acquired(&claim(&store, &key, fp("w"), LEASE).await);
}

/// 100 claims of one key at the same instant: exactly one wins, and every
/// other sees the winner's fingerprint.
pub async fn concurrent_claims_have_one_winner<S: Store>(store: S) {
    const N: usize = 100;
    let key: Arc<str> = unique_key("storm").into();
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                let mine = fp(&format!("copy {i}"));
                barrier.wait().await;
                let got = store
                    .claim(&key, mine, OwnerToken::new(), LEASE)
                    .await
                    .unwrap();
                (mine, got)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (mine, Claim::Acquired(_)) => winners.push(mine),
            (_, Claim::InFlight { fingerprint, .. }) => seen.push(fingerprint),
            (_, other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim wins");
    assert_eq!(seen.len(), N - 1);
    assert!(seen.iter().all(|f| *f == winners[0]), "all see the winner");
}

/// Duplicates waiting on a key in flight wake within a second when its
/// owner completes or releases it.
pub async fn waiters_wake_on_complete_and_release<S: Store>(store: S) {
    for finish_with_complete in [true, false] {
        let key = unique_key("wake");
        let owner = OwnerToken::new();
        store.claim(&key, fp("k"), owner, LEASE).await.unwrap();
        let mut waiters = Vec::new();
        for _ in 0..5 {
            let Claim::InFlight { watch, .. } = claim(&store, &key, fp("k"), LEASE).await else {
                panic!("expected InFlight");
            };
            waiters.push(tokio::spawn(watch.changed()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let start = std::time::Instant::now();
        if finish_with_complete {
            let rec = record(fp("k"), false, false);
            assert!(store.complete(&key, owner, rec, WINDOW).await.unwrap());
        } else {
            assert!(store.release(&key, owner).await.unwrap());
        }
        for w in waiters {
            tokio::time::timeout(Duration::from_secs(2), w)
                .await
                .expect("waiter woke")
                .unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        let again = claim(&store, &key, fp("k"), LEASE).await;
        if finish_with_complete {
            completed(again);
        } else {
            assert_acquired(&again);
        }
    }
}

/// A Redis Cluster client resends a script after a dropped connection:
/// a resent claim or token take must answer what the first one did.
pub async fn resent_calls_answer_the_same<S: Store>(store: S) {
    let key = unique_key("resend");
    let owner = OwnerToken::new();
    let first = store.claim(&key, fp("r"), owner, LEASE).await.unwrap();
    assert!(
        matches!(first, Claim::Acquired(t) if t == owner),
        "{first:?}"
    );
    let again = store.claim(&key, fp("r"), owner, LEASE).await.unwrap();
    assert!(
        matches!(again, Claim::Acquired(t) if t == owner),
        "a resent claim must find its own claim, got {again:?}"
    );
    // Anyone else still sees it in flight, and the owner still owns it.
    assert_in_flight(&claim(&store, &key, fp("r"), LEASE).await, fp("r"));
    let rec = record(fp("r"), false, false);
    assert!(store
        .complete(&key, owner, rec.clone(), WINDOW)
        .await
        .unwrap());
    assert_same(&completed(claim(&store, &key, fp("r"), LEASE).await), &rec);
    // A resent take of a client token by the request that took it.
    let token = unique_key("resend-token");
    store
        .put_token(&token, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(store.take_token(&token, owner).await.unwrap());
    assert!(
        store.take_token(&token, owner).await.unwrap(),
        "a resent take must still answer taken"
    );
    assert!(
        !store.take_token(&token, OwnerToken::new()).await.unwrap(),
        "another request must not take it"
    );
}

/// `inspect` follows a key through its life cycle without changing it, and
/// `forget` deletes a completed record (the next claim acquires) but never
/// an in-flight claim.
pub async fn inspect_and_forget_follow_the_life_cycle<S: Store>(store: S) {
    let key = unique_key("inspect");
    assert!(matches!(
        store.inspect(&key).await.unwrap(),
        RecordState::Absent
    ));
    assert_eq!(store.forget(&key).await.unwrap(), Forgotten::Absent);
    let token = OwnerToken::new();
    assert_acquired(&claim(&store, &key, fp("p"), LEASE).await);
    // That claim's owner is unknown here; claim a second key with `token`.
    let owned = unique_key("inspect-owned");
    store.claim(&owned, fp("p"), token, LEASE).await.unwrap();
    match store.inspect(&owned).await.unwrap() {
        RecordState::InFlight {
            fingerprint,
            age,
            lease_left,
        } => {
            assert_eq!(fingerprint, fp("p"));
            assert!(
                lease_left <= LEASE && lease_left > LEASE / 2,
                "{lease_left:?}"
            );
            assert!(age.is_none_or(|a| a < LEASE / 2), "{age:?}");
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(store.forget(&owned).await.unwrap(), Forgotten::InFlight);
    // Still the owner's: forget left it alone.
    assert_in_flight(&claim(&store, &owned, fp("other"), LEASE).await, fp("p"));
    let rec = record(fp("p"), false, true);
    assert!(store
        .complete(&owned, token, rec.clone(), WINDOW)
        .await
        .unwrap());
    match store.inspect(&owned).await.unwrap() {
        RecordState::Completed { record, left } => {
            assert_same(&record, &rec);
            assert!(left <= WINDOW && left > WINDOW / 2, "{left:?}");
        }
        other => panic!("expected Completed, got {other:?}"),
    }
    assert_eq!(store.forget(&owned).await.unwrap(), Forgotten::Deleted);
    assert!(matches!(
        store.inspect(&owned).await.unwrap(),
        RecordState::Absent
    ));
    // The next copy runs again.
    assert_acquired(&claim(&store, &owned, fp("p"), LEASE).await);
    // A client token is not a record: forget leaves it.
    let tok = unique_key("inspect-token");
    store
        .put_token(&tok, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(store.forget(&tok).await.unwrap(), Forgotten::Absent);
    assert!(store.take_token(&tok, OwnerToken::new()).await.unwrap());
}

/// `forget` racing the owner's completion answers what was there (in
/// flight, or deleted), never `Absent` for a key that was claimed or
/// completed all along; once it answered `Deleted`, the next copy runs.
pub async fn forget_racing_a_completion_never_answers_absent<S: Store>(store: S) {
    for i in 0..40 {
        let key: Arc<str> = unique_key(&format!("forget-race-{i}")).into();
        let owner = OwnerToken::new();
        assert_acquired(&store.claim(&key, fp("f"), owner, LEASE).await.unwrap());
        let (s1, k1) = (store.clone(), key.clone());
        let done = tokio::spawn(async move {
            s1.complete(&k1, owner, record(fp("f"), false, false), WINDOW)
                .await
                .unwrap()
        });
        let forgot = store.forget(&key).await.unwrap();
        assert!(done.await.unwrap());
        assert_ne!(forgot, Forgotten::Absent, "round {i}");
        if forgot == Forgotten::Deleted {
            assert_acquired(&claim(&store, &key, fp("f"), LEASE).await);
        } else {
            assert_eq!(store.forget(&key).await.unwrap(), Forgotten::Deleted);
            assert_acquired(&claim(&store, &key, fp("f"), LEASE).await);
        }
    }
}

/// `replace` swaps a completed record without the key ever being absent,
/// and changes nothing for a key absent or in flight.
pub async fn replace_changes_a_completed_record_in_one_step<S: Store>(store: S) {
    let key = unique_key("replace");
    // No record: nothing is written.
    assert!(!store
        .replace(&key, record(fp("a"), true, false), WINDOW)
        .await
        .unwrap());
    let token = OwnerToken::new();
    assert_acquired(&store.claim(&key, fp("a"), token, LEASE).await.unwrap());
    // A claim is left to its owner.
    assert!(!store
        .replace(&key, record(fp("a"), true, false), WINDOW)
        .await
        .unwrap());
    assert_in_flight(&claim(&store, &key, fp("a"), LEASE).await, fp("a"));
    assert!(store
        .complete(&key, token, record(fp("a"), false, false), WINDOW)
        .await
        .unwrap());
    let new = record(fp("a"), true, true);
    assert!(store.replace(&key, new.clone(), WINDOW).await.unwrap());
    assert_same(&completed(claim(&store, &key, fp("a"), LEASE).await), &new);
    // Claims racing replaces find the record, old or new, never the key
    // absent.
    let key: Arc<str> = key.into();
    let barrier = Arc::new(tokio::sync::Barrier::new(40));
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                if i % 2 == 0 {
                    let rec = record(fp("a"), i % 4 == 0, false);
                    assert!(store.replace(&key, rec, WINDOW).await.unwrap());
                } else {
                    completed(claim(&store, &key, fp("a"), LEASE).await);
                }
            })
        })
        .collect();
    for c in calls {
        c.await.unwrap();
    }
    // The new window counts from the replace: the record goes when it
    // ends.
    assert!(store
        .replace(&key, new.clone(), Duration::from_millis(300))
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_acquired(&claim(&store, &key, fp("a"), LEASE).await);
}

/// A client token is taken once, even by 50 takers at the same instant; a
/// token given back can be taken again.
pub async fn client_tokens_are_consumed_once<S: Store>(store: S) {
    let key = unique_key("token");
    store
        .put_token(&key, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(store.take_token(&key, OwnerToken::new()).await.unwrap());
    assert!(
        !store.take_token(&key, OwnerToken::new()).await.unwrap(),
        "taken twice"
    );
    assert!(!store
        .take_token(&unique_key("unknown"), OwnerToken::new())
        .await
        .unwrap());
    // Given back (a failed submit), it can be taken again.
    store
        .put_token(&key, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(store.take_token(&key, OwnerToken::new()).await.unwrap());
    // An expired token is gone.
    let short = unique_key("token-short");
    store
        .put_token(&short, Duration::from_millis(200))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!store.take_token(&short, OwnerToken::new()).await.unwrap());
    // Of 50 simultaneous takes, exactly one wins.
    let raced: Arc<str> = unique_key("token-race").into();
    store
        .put_token(&raced, Duration::from_secs(60))
        .await
        .unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let takes: Vec<_> = (0..50)
        .map(|_| {
            let (store, key, barrier) = (store.clone(), raced.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.take_token(&key, OwnerToken::new()).await.unwrap()
            })
        })
        .collect();
    let mut won = 0;
    for t in takes {
        won += usize::from(t.await.unwrap());
    }
    assert_eq!(won, 1);
}

/// Writes one `#[tokio::test]` per case of the suite for a store:
/// `store_tests!(module, setup)` makes a module `module` whose tests each
/// get their store from `setup().await`, an `Option<(store, guard)>`: the
/// guard (a server, a temporary file) is kept alive while the test runs,
/// and `None` skips the test (the server could not be started here).
///
/// The tests run on a multi-threaded runtime in real time.
/// `store_tests!(module, setup, paused)` runs them on a single-threaded
/// runtime whose clock is paused (`start_paused`): for a store on tokio's
/// clock, such as the memory store, waiting for a lease or a window to run
/// out then takes no time (the crate's tokio needs `test-util`).
///
/// See the [module](self) for an example.
#[doc(inline)]
pub use crate::__store_tests as store_tests;

#[doc(hidden)]
#[macro_export]
macro_rules! __store_tests {
    ($name:ident, $setup:path) => {
        $crate::__store_tests!(@module $name, $setup,
            tokio::test(flavor = "multi_thread", worker_threads = 4));
    };
    ($name:ident, $setup:path, paused) => {
        $crate::__store_tests!(@module $name, $setup, tokio::test(start_paused = true));
    };
    (@module $name:ident, $setup:path, $test:meta) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::__store_tests!(@cases $setup, $test;
                claim_on_absent_acquires,
                second_claim_sees_in_flight,
                unwatched_claim_answers_as_claim,
                complete_by_owner_replays_faithfully,
                non_owner_changes_nothing,
                release_by_owner_frees_the_key,
                lease_expiry_makes_it_claimable,
                renew_extends_the_lease,
                window_expiry_forgets_the_record,
                concurrent_claims_have_one_winner,
                waiters_wake_on_complete_and_release,
                client_tokens_are_consumed_once,
                replace_changes_a_completed_record_in_one_step,
                resent_calls_answer_the_same,
                inspect_and_forget_follow_the_life_cycle,
                forget_racing_a_completion_never_answers_absent,
                fences_grow_across_release,
                fences_grow_across_lease_takeover,
                fences_grow_across_forget,
                fences_grow_across_record_expiry,
                concurrent_claimers_never_share_a_fence,
                advance_moves_forward,
                advance_refuses_equal_and_behind,
                concurrent_advances_only_move_forward,
                positions_are_kept_for_their_ttl,
            );
        }
    };
    (@cases $setup:path, $test:meta; $($case:ident,)*) => {
        $(
            #[$test]
            async fn $case() {
                let Some((store, _guard)) = $setup().await else {
                    return;
                };
                $crate::store::testing::$case(store).await;
            }
        )*
    };
}
