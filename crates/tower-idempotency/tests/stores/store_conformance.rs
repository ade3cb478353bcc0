//! One conformance suite for every store (the record life cycle): the same
//! cases run against the memory store, a standalone Redis and a 3-master Redis Cluster
//! (feature `redis`; the servers are started here, see `support_redis`).

use test_support::support_redis;
use test_support::support_sql;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::{
    Claim, CompletedRecord, Forgotten, MemoryStore, OwnerToken, RecordState, Store, StoredResponse,
};
use tower_idempotency::Fingerprint;

/// Keeps whatever the store needs (a server) alive for one test.
type Guard = Option<Arc<dyn Any + Send + Sync>>;

/// A key no other test (or earlier run against the same server) uses.
fn unique_key(case: &str) -> String {
    format!(
        "idem:conformance:{case}:{:032x}",
        OwnerToken::new().as_u128()
    )
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(s.as_bytes())
}

fn record(fingerprint: Fingerprint, omitted: bool, trailers: bool) -> Arc<CompletedRecord> {
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

fn assert_same(got: &CompletedRecord, want: &CompletedRecord) {
    assert_eq!(got.fingerprint, want.fingerprint);
    assert_eq!(got.response.status, want.response.status);
    assert_eq!(got.response.headers, want.response.headers);
    assert_eq!(got.response.body, want.response.body);
    assert_eq!(got.response.trailers, want.response.trailers);
    assert_eq!(got.response.body_omitted, want.response.body_omitted);
}

const LEASE: Duration = Duration::from_secs(30);
const WINDOW: Duration = Duration::from_secs(3600);

async fn claim<S: Store>(store: &S, key: &str, f: Fingerprint, lease: Duration) -> Claim {
    store
        .claim(key, f, OwnerToken::new(), lease)
        .await
        .expect("claim")
}

#[track_caller]
fn assert_acquired(claim: &Claim) {
    assert!(
        matches!(claim, Claim::Acquired(_)),
        "expected Acquired, got {claim:?}"
    );
}

#[track_caller]
fn assert_in_flight(claim: &Claim, want: Fingerprint) {
    match claim {
        Claim::InFlight { fingerprint, .. } => assert_eq!(*fingerprint, want),
        other => panic!("expected InFlight, got {other:?}"),
    }
}

#[track_caller]
fn completed(claim: Claim) -> Arc<CompletedRecord> {
    match claim {
        Claim::Completed(rec) => rec,
        other => panic!("expected Completed, got {other:?}"),
    }
}

#[path = "store_conformance/fences.rs"]
mod fences;

/// The cases, each generic over the store.
mod cases {
    pub(super) use super::fences::{
        concurrent_claimers_never_share_a_fence, fences_grow_across_forget,
        fences_grow_across_lease_takeover, fences_grow_across_record_expiry,
        fences_grow_across_release,
    };
    use super::*;

    pub(super) async fn claim_on_absent_acquires<S: Store>(store: S) {
        let key = unique_key("absent");
        let token = OwnerToken::new();
        let got = store.claim(&key, fp("a"), token, LEASE).await.unwrap();
        assert!(matches!(got, Claim::Acquired(t) if t == token), "{got:?}");
        // Other keys are independent.
        assert_acquired(&claim(&store, &unique_key("absent-other"), fp("a"), LEASE).await);
    }

    pub(super) async fn second_claim_sees_in_flight<S: Store>(store: S) {
        let key = unique_key("in-flight");
        assert_acquired(&claim(&store, &key, fp("first"), LEASE).await);
        // The second brings another fingerprint: it must see the first one.
        assert_in_flight(&claim(&store, &key, fp("second"), LEASE).await, fp("first"));
        assert_in_flight(&claim(&store, &key, fp("first"), LEASE).await, fp("first"));
    }

    pub(super) async fn complete_by_owner_replays_faithfully<S: Store>(store: S) {
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

    pub(super) async fn non_owner_changes_nothing<S: Store>(store: S) {
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

    pub(super) async fn release_by_owner_frees_the_key<S: Store>(store: S) {
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

    pub(super) async fn lease_expiry_makes_it_claimable<S: Store>(store: S) {
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

    pub(super) async fn renew_extends_the_lease<S: Store>(store: S) {
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

    pub(super) async fn window_expiry_forgets_the_record<S: Store>(store: S) {
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

    pub(super) async fn concurrent_claims_have_one_winner<S: Store>(store: S) {
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

    pub(super) async fn waiters_wake_on_complete_and_release<S: Store>(store: S) {
        for finish_with_complete in [true, false] {
            let key = unique_key("wake");
            let owner = OwnerToken::new();
            store.claim(&key, fp("k"), owner, LEASE).await.unwrap();
            let mut waiters = Vec::new();
            for _ in 0..5 {
                let Claim::InFlight { watch, .. } = claim(&store, &key, fp("k"), LEASE).await
                else {
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
    pub(super) async fn resent_calls_answer_the_same<S: Store>(store: S) {
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
    pub(super) async fn inspect_and_forget_follow_the_life_cycle<S: Store>(store: S) {
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
    pub(super) async fn forget_racing_a_completion_never_answers_absent<S: Store>(store: S) {
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

    pub(super) async fn replace_changes_a_completed_record_in_one_step<S: Store>(store: S) {
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

    pub(super) async fn client_tokens_are_consumed_once<S: Store>(store: S) {
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
}

/// Generates the suite for one store: `store_tests!(module, setup_fn)`, where
/// `setup_fn().await` yields `Option<(store, guard)>` (`None` skips).
macro_rules! store_tests {
    ($name:ident, $setup:path) => {
        mod $name {
            use super::*;
            store_tests!(@cases $setup;
                claim_on_absent_acquires,
                second_claim_sees_in_flight,
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
            );

        }
    };
    (@cases $setup:path; $($case:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let Some((store, _guard)) = $setup().await else {
                    return;
                };
                cases::$case(store).await;
            }
        )*
    };
}

async fn memory() -> Option<(MemoryStore, Guard)> {
    Some((MemoryStore::new(), None))
}

store_tests!(memory_store, memory);

/// A store picked at run time: `Either` of two stores is a store.
async fn either_memory() -> Option<(
    tower_idempotency::store::Either<MemoryStore, MemoryStore>,
    Guard,
)> {
    Some((
        tower_idempotency::store::Either::Right(MemoryStore::new()),
        None,
    ))
}

store_tests!(either_memory_store, either_memory);

/// What only the memory store does.
mod memory_only {
    use super::*;

    /// A store far smaller than the traffic keeps the newest records: the
    /// ones a storm retries.
    #[tokio::test]
    async fn a_full_store_keeps_the_newest_records() {
        let store = MemoryStore::builder().max_bytes(64 * 1024).build();
        let keys: Vec<String> = (0..5_000)
            .map(|i| unique_key(&format!("full-{i}")))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            let owner = OwnerToken::new();
            let f = fp(&i.to_string());
            assert_acquired(&store.claim(key, f, owner, LEASE).await.unwrap());
            assert!(store
                .complete(key, owner, record(f, false, false), WINDOW)
                .await
                .unwrap());
        }
        let newest = 20;
        let mut ran_again = Vec::new();
        for (i, key) in keys.iter().enumerate().skip(keys.len() - newest) {
            let got = store
                .claim(key, fp(&i.to_string()), OwnerToken::new(), LEASE)
                .await
                .unwrap();
            if !matches!(got, Claim::Completed(_)) {
                ran_again.push(i);
            }
        }
        assert!(
            ran_again.is_empty(),
            "of the newest {newest}, these would run again: {ran_again:?}"
        );
        assert!(store.evicted_early() > 0, "the store must have been full");
    }

    /// By its own measure the store never holds more than its budget, for
    /// small and large bodies alike, and the measure returns to zero.
    #[tokio::test]
    async fn the_budget_is_never_exceeded() {
        let budget = 1 << 20;
        let store = MemoryStore::builder().max_bytes(budget).build();
        for i in 0..3_000usize {
            let key = unique_key(&format!("budget-{i}"));
            let owner = OwnerToken::new();
            let mut rec = (*record(fp("b"), false, i % 3 == 0)).clone();
            // 37 B to 64 KiB bodies, and now and then one larger than the budget.
            let size = match i % 7 {
                0 => 64 * 1024,
                1 => 2 * budget as usize,
                _ => 37,
            };
            rec.response.body = Bytes::from(vec![b'x'; size]);
            assert_acquired(&store.claim(&key, fp("b"), owner, LEASE).await.unwrap());
            assert!(store
                .complete(&key, owner, Arc::new(rec), WINDOW)
                .await
                .unwrap());
            assert!(
                store.bytes_used() <= budget,
                "after {i} records: {} bytes used of {budget}",
                store.bytes_used()
            );
        }
        assert!(!store.is_empty() && store.evicted_early() > 0);
        assert_eq!(store.expired(), 0);
    }

    /// A record larger than the store can hold is kept without its body
    /// (as a body past the cache limit is), never dropped as it is
    /// written: the call does not run again.
    #[tokio::test]
    async fn a_record_larger_than_the_store_is_kept_without_its_body() {
        let budget = 1 << 20;
        let store = MemoryStore::builder().max_bytes(budget).build();
        let key = unique_key("huge");
        let owner = OwnerToken::new();
        let mut rec = (*record(fp("h"), false, false)).clone();
        rec.response.body = Bytes::from(vec![b'x'; 2 * budget as usize]);
        rec.response.headers.insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(2 * budget),
        );
        assert_acquired(&store.claim(&key, fp("h"), owner, LEASE).await.unwrap());
        assert!(store
            .complete(&key, owner, Arc::new(rec.clone()), WINDOW)
            .await
            .unwrap());
        assert_eq!(store.evicted_early(), 0, "the record was dropped");
        assert!(store.bytes_used() <= budget);
        match store
            .claim(&key, fp("h"), OwnerToken::new(), LEASE)
            .await
            .unwrap()
        {
            Claim::Completed(kept) => {
                let kept = &kept.response;
                assert!(kept.body_omitted && kept.body.is_empty());
                assert_eq!(kept.status, rec.response.status);
                assert!(!kept.headers.contains_key(http::header::CONTENT_LENGTH));
            }
            other => panic!("the record is gone: {other:?}"),
        }
    }

    /// Records whose window ended are counted apart from early evictions.
    #[tokio::test]
    async fn expiry_is_not_an_early_eviction() {
        let store = MemoryStore::new();
        let key = unique_key("expires");
        let owner = OwnerToken::new();
        assert_acquired(&store.claim(&key, fp("e"), owner, LEASE).await.unwrap());
        let rec = record(fp("e"), false, false);
        assert!(store
            .complete(&key, owner, rec, Duration::from_millis(50))
            .await
            .unwrap());
        assert_eq!((store.len(), store.expired()), (1, 0));
        assert!(store.bytes_used() > 0);
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_acquired(&claim(&store, &key, fp("e"), LEASE).await);
        assert_eq!((store.len(), store.bytes_used()), (0, 0));
        assert_eq!((store.expired(), store.evicted_early()), (1, 0));
    }
}

mod redis_setup {
    use super::support_redis::{shared_cluster, shared_standalone};
    use super::*;
    use tower_idempotency_redis::{RedisClusterStore, RedisStore};

    pub(super) async fn standalone() -> Option<(RedisStore, Guard)> {
        let server = shared_standalone()?;
        let store = RedisStore::standalone(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    pub(super) async fn cluster() -> Option<(RedisClusterStore, Guard)> {
        let cluster = shared_cluster()?;
        let store = RedisStore::cluster(cluster.urls()).await.unwrap();
        Some((store, Some(cluster)))
    }

    /// Memory or Redis picked at run time: here Redis.
    pub(super) async fn either() -> Option<(
        tower_idempotency::store::Either<MemoryStore, RedisStore>,
        Guard,
    )> {
        let (store, guard) = standalone().await?;
        Some((tower_idempotency::store::Either::Right(store), guard))
    }

    /// Standalone with a key prefix: the same cases hold.
    pub(super) async fn prefixed() -> Option<(RedisStore, Guard)> {
        let (store, guard) = standalone().await?;
        Some((store.key_prefix("tenant-a:"), guard))
    }
}

use redis_setup::standalone as redis_standalone_setup;
use redis_setup::{cluster as redis_cluster_setup, prefixed as redis_prefixed_setup};

store_tests!(redis_standalone, redis_standalone_setup);
store_tests!(redis_prefixed, redis_prefixed_setup);
store_tests!(redis_cluster, redis_cluster_setup);
store_tests!(either_redis, redis_setup::either);

mod sql_setup {
    use super::support_sql::{shared_mariadb, shared_postgres, SqliteFile};
    use super::*;
    use tower_idempotency_sqlx::SqlStore;

    pub(super) async fn postgres() -> Option<(SqlStore, Guard)> {
        let server = shared_postgres()?;
        let store = SqlStore::connect(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    pub(super) async fn mariadb() -> Option<(SqlStore, Guard)> {
        let server = shared_mariadb()?;
        let store = SqlStore::connect(server.url()).await.unwrap();
        Some((store, Some(server)))
    }

    /// A database file of its own per test.
    pub(super) async fn sqlite() -> Option<(SqlStore, Guard)> {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url()).await.unwrap();
        Some((store, Some(Arc::new(file))))
    }
}

/// Redis in front of PostgreSQL.
async fn tiered_redis_postgres() -> Option<(
    tower_idempotency::store::TieredStore<
        tower_idempotency_redis::RedisStore,
        tower_idempotency_sqlx::SqlStore,
    >,
    Guard,
)> {
    let (front, redis) = redis_setup::standalone().await?;
    let (back, pg) = sql_setup::postgres().await?;
    let guard: Guard = Some(Arc::new((redis, pg)));
    Some((
        tower_idempotency::store::TieredStore::new(front, back),
        guard,
    ))
}

store_tests!(tiered_redis_sql, tiered_redis_postgres);

/// The tiered store's fencing tokens are the database's: a Redis whose
/// fence counter ran ahead and was then lost (a restart without
/// persistence) changes nothing.
#[tokio::test]
async fn tiered_fences_grow_when_redis_lost_its_data() {
    let Some((store, _guard)) = tiered_redis_postgres().await else {
        return;
    };
    let key = unique_key("tiered-fence");
    let counter = format!("{{{key}}}%fence");
    let mut conn = store.front().connection().clone();
    let mut last = 0;
    for lost in [false, true, false, true] {
        let owner = OwnerToken::new();
        let got = store.claim(&key, fp("t"), owner, LEASE).await.unwrap();
        let f = fences::fence(&got);
        assert!(f > last, "fence {f} after {last}");
        assert!(store.release(&key, owner).await.unwrap());
        // Redis's counter for the key runs far ahead, or is lost.
        let cmd = if lost {
            redis::cmd("DEL").arg(&counter).clone()
        } else {
            redis::cmd("SET")
                .arg(&counter)
                .arg("9000000000000000")
                .clone()
        };
        let _: () = cmd.query_async(&mut conn).await.unwrap();
        last = f;
    }
}
#[path = "store_conformance/sql_races.rs"]
mod sql_races;
store_tests!(sql_postgres, sql_setup::postgres);
store_tests!(sql_mariadb, sql_setup::mariadb);
store_tests!(sql_sqlite, sql_setup::sqlite);

/// What only the SQL store does.
mod sql_only {
    use super::support_sql::SqliteFile;
    use super::*;
    use tower_idempotency_sqlx::SqlStore;

    async fn rows(store: &SqlStore) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
            .fetch_one(store.as_sqlite().unwrap())
            .await
            .unwrap()
    }

    /// Expired rows go in batches of the given size; live ones stay.
    #[tokio::test]
    async fn expired_rows_are_swept_in_bounded_batches() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url())
            .await
            .unwrap()
            .sweep(None, 10);
        for i in 0..25 {
            let key = unique_key(&format!("sweep-{i}"));
            let owner = OwnerToken::new();
            store
                .claim(&key, fp("s"), owner, Duration::from_millis(50))
                .await
                .unwrap();
        }
        let live = unique_key("sweep-live");
        assert_acquired(&claim(&store, &live, fp("s"), LEASE).await);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(rows(&store).await, 26);
        assert_eq!(store.sweep_expired(10).await.unwrap(), 25);
        assert_eq!(rows(&store).await, 1);
        assert_in_flight(&claim(&store, &live, fp("s"), LEASE).await, fp("s"));
        // And in the background.
        let store = store.sweep(Some(Duration::from_millis(50)), 3);
        for i in 0..7 {
            let key = unique_key(&format!("sweep-bg-{i}"));
            claim(&store, &key, fp("s"), Duration::from_millis(20)).await;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rows(&store).await > 1 {
            assert!(std::time::Instant::now() < deadline, "not swept");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The fence outlives the row: a released claim stays (as a row of
    /// state 0) through a sweep, and a record swept after its window is
    /// followed by a larger token from the database's clock.
    #[tokio::test]
    async fn fences_grow_across_the_sweep() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url())
            .await
            .unwrap()
            .sweep(None, 10);
        let key = unique_key("fence-sweep");
        let mut last = 0;
        for _ in 0..5 {
            let owner = OwnerToken::new();
            let got = store.claim(&key, fp("s"), owner, LEASE).await.unwrap();
            let f = fences::fence(&got);
            assert!(f > last, "fence {f} after {last}");
            assert!(store.release(&key, owner).await.unwrap());
            assert_eq!(
                store.sweep_expired(10).await.unwrap(),
                0,
                "kept with its fence"
            );
            last = f;
        }
        let owner = OwnerToken::new();
        let f = fences::fence(&store.claim(&key, fp("s"), owner, LEASE).await.unwrap());
        assert!(f > last);
        let rec = record(fp("s"), false, false);
        assert!(store
            .complete(&key, owner, rec, Duration::from_millis(50))
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.sweep_expired(10).await.unwrap(), 1);
        assert_eq!(rows(&store).await, 0);
        let after = fences::fence(&claim(&store, &key, fp("s"), LEASE).await);
        assert!(after > f, "after the sweep {after} after {f}");
    }

    /// Keys are bytes: no collation folds case or trailing spaces, and any
    /// byte (a NUL from a JSON `\u0000`) is stored as it is.
    #[tokio::test]
    async fn keys_are_compared_byte_for_byte() {
        let mut stores = vec![];
        let file = SqliteFile::new();
        stores.push(SqlStore::connect(&file.url()).await.unwrap());
        if let Some((s, _)) = sql_setup::mariadb().await {
            stores.push(s);
        }
        if let Some((s, _)) = sql_setup::postgres().await {
            stores.push(s);
        }
        for store in stores {
            let base = unique_key("bytes");
            for key in [
                base.clone(),
                base.to_uppercase(),
                format!("{base} "),
                format!("{base}\0x"),
                format!("{base}é"),
                format!("{base}e\u{301}"),
            ] {
                assert_acquired(&claim(&store, &key, fp("b"), LEASE).await);
            }
            assert_in_flight(&claim(&store, &base, fp("b"), LEASE).await, fp("b"));
        }
    }

    #[tokio::test]
    async fn unknown_urls_and_shared_memory_are_refused() {
        for url in ["redis://localhost/", "sqlite::memory:", "nonsense"] {
            let err = SqlStore::connect(url).await.unwrap_err();
            assert_eq!(
                err.kind(),
                tower_idempotency::store::StoreErrorKind::Unsupported,
                "{url}: {err}"
            );
        }
    }

    /// PostgreSQL: a waiter on another instance is woken by the owner's
    /// `NOTIFY`, long before its own poller (here once a second) would look.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_notify_wakes_waiters_of_other_instances() {
        let Some((owner_store, _g)) = sql_setup::postgres().await else {
            return;
        };
        let (waiter_store, _g2) = sql_setup::postgres().await.unwrap();
        let waiter_store = waiter_store.poll_interval(Duration::from_secs(1));
        for complete in [true, false] {
            let key = unique_key("notify");
            let owner = OwnerToken::new();
            owner_store
                .claim(&key, fp("n"), owner, LEASE)
                .await
                .unwrap();
            let Claim::InFlight { watch, .. } = claim(&waiter_store, &key, fp("n"), LEASE).await
            else {
                panic!("expected InFlight");
            };
            let woken = tokio::spawn(watch.changed());
            // The listener connects on the first wait.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if complete {
                let rec = record(fp("n"), false, false);
                assert!(owner_store
                    .complete(&key, owner, rec, WINDOW)
                    .await
                    .unwrap());
            } else {
                assert!(owner_store.release(&key, owner).await.unwrap());
            }
            tokio::time::timeout(Duration::from_millis(600), woken)
                .await
                .expect("woken by the NOTIFY, not the 1 s poller")
                .unwrap();
        }
    }

    /// Migrations run again (every constructor runs them) change nothing.
    #[tokio::test]
    async fn migrate_is_idempotent() {
        let file = SqliteFile::new();
        let store = SqlStore::connect(&file.url()).await.unwrap();
        let key = unique_key("migrate");
        assert_acquired(&claim(&store, &key, fp("m"), LEASE).await);
        store.migrate().await.unwrap();
        let again = SqlStore::connect(&file.url()).await.unwrap();
        assert_in_flight(&claim(&again, &key, fp("m"), LEASE).await, fp("m"));
    }
}

/// What only the Redis store does.
mod redis_only {
    use super::support_redis::{
        self, redis_available, shared_cluster, shared_standalone, RedisServer,
    };
    use super::*;
    use tower_idempotency::store::StoreErrorKind;
    use tower_idempotency_redis::RedisStore;

    #[tokio::test]
    async fn complete_after_lease_ran_out_unclaimed_still_records() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let key = unique_key("late-complete");
        let owner = OwnerToken::new();
        store
            .claim(&key, fp("l"), owner, Duration::from_millis(100))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        let rec = record(fp("l"), false, true);
        assert!(store
            .complete(&key, owner, rec.clone(), WINDOW)
            .await
            .unwrap());
        assert_same(&completed(claim(&store, &key, fp("l"), LEASE).await), &rec);
    }

    /// Claims until the store has counted `want` data losses (5 s at most).
    async fn until_losses(store: &RedisStore, want: u64) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store.data_loss_events() < want && std::time::Instant::now() < deadline {
            // Errors while a server restarts are expected; the look goes on.
            let _ = store
                .claim(&unique_key("epoch"), fp("e"), OwnerToken::new(), LEASE)
                .await;
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        store.data_loss_events()
    }

    #[tokio::test]
    async fn a_redis_that_lost_its_data_is_noticed() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let port = server.port();
        let store = RedisStore::standalone(server.url())
            .await
            .unwrap()
            .epoch_check_interval(Some(Duration::from_millis(50)));
        // First use writes the marker; nothing lost yet.
        assert_eq!(until_losses(&store, 1).await, 0);
        let marker = |port| support_redis::raw_command(port, "GET idem:epoch").unwrap();
        assert!(!marker(port).starts_with("$-1"), "no marker written");
        // FLUSHALL is noticed, and the marker written again.
        assert!(support_redis::raw_command(port, "FLUSHALL")
            .unwrap()
            .starts_with("+OK"));
        assert_eq!(until_losses(&store, 1).await, 1, "FLUSHALL not noticed");
        assert!(!marker(port).starts_with("$-1"), "marker not rewritten");
        // A restart that kept the data set is not a loss...
        server.stop();
        server.restart();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            until_losses(&store, 2).await,
            1,
            "a kept data set is no loss"
        );
        // ...a restart without persistence is.
        server.stop_without_saving();
        server.restart();
        assert_eq!(until_losses(&store, 2).await, 2, "restart not noticed");
        // And a healthy server counts nothing more.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(until_losses(&store, 3).await, 2);
    }

    #[tokio::test]
    async fn take_token_deletes_only_tokens() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let key = unique_key("not-a-token");
        let owner = OwnerToken::new();
        store.claim(&key, fp("t"), owner, LEASE).await.unwrap();
        assert!(!store.take_token(&key, OwnerToken::new()).await.unwrap());
        assert_in_flight(&claim(&store, &key, fp("t"), LEASE).await, fp("t"));
    }

    #[tokio::test]
    async fn key_prefix_is_applied() {
        let Some(server) = shared_standalone() else {
            return;
        };
        let store = RedisStore::standalone(server.url())
            .await
            .unwrap()
            .key_prefix("shop:");
        let key = unique_key("prefix");
        assert_acquired(&claim(&store, &key, fp("p"), LEASE).await);
        let mut conn = store.connection().clone();
        let exists: (bool, bool) = redis::pipe()
            .exists(format!("shop:{key}"))
            .exists(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(exists, (true, false));
        // Client text cannot choose a Cluster hash tag.
        let braces = format!("{key}:{{tag}}%");
        assert_acquired(&claim(&store, &braces, fp("p"), LEASE).await);
        let stored: bool = redis::cmd("EXISTS")
            .arg(format!("shop:{key}:%7Btag%7D%25"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(stored);
        assert_in_flight(&claim(&store, &braces, fp("q"), LEASE).await, fp("p"));
        // Ttl of the claim is the lease.
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("shop:{key}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 29_000 && ttl <= 30_000, "pttl {ttl}");
    }

    #[tokio::test]
    async fn foreign_values_are_corrupt() {
        let Some((store, _g)) = redis_setup::standalone().await else {
            return;
        };
        let mut conn = store.connection().clone();
        for junk in [&b"hello"[..], &[0xF1, 1, 2][..], &[1, 2, 3][..]] {
            let key = unique_key("junk");
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(junk)
                .query_async(&mut conn)
                .await
                .unwrap();
            let err = store
                .claim(&key, fp("j"), OwnerToken::new(), LEASE)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{err}");
        }
        // A key of another type is a backend error, not a panic.
        let key = unique_key("hash");
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("f")
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
        let err = store
            .claim(&key, fp("j"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Backend, "{err}");
    }

    #[tokio::test]
    async fn a_paused_server_times_out_and_recovers() {
        if !redis_available() {
            return;
        }
        // Its own server: the pause would stall every other test.
        let server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("pause");
        assert_acquired(&claim(&store, &key, fp("t"), LEASE).await);
        let reply =
            super::support_redis::raw_command(server.port(), "CLIENT PAUSE 1500 ALL").unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
        let err = store
            .claim(&key, fp("t"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Timeout, "{err}");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_in_flight(&claim(&store, &key, fp("t"), LEASE).await, fp("t"));
    }

    #[tokio::test]
    async fn a_cancelled_claim_leaves_no_orphan() {
        if !redis_available() {
            return;
        }
        let server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("cancelled");
        // Warm the script cache, so the claim below is one EVALSHA.
        assert_acquired(&claim(&store, &unique_key("warm"), fp("w"), LEASE).await);
        let reply =
            super::support_redis::raw_command(server.port(), "CLIENT PAUSE 500 ALL").unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
        // The layer's store timeout gives up while the server holds the claim
        // back; the server runs it afterwards.
        let cancelled = tokio::time::timeout(
            Duration::from_millis(100),
            store.claim(&key, fp("c"), OwnerToken::new(), LEASE),
        )
        .await;
        assert!(cancelled.is_err(), "the claim was not cancelled");
        tokio::time::sleep(Duration::from_millis(700)).await;
        // Nobody owns that claim: it was released, not left for the lease.
        assert_acquired(&claim(&store, &key, fp("c"), LEASE).await);
    }

    #[tokio::test]
    async fn a_restarted_server_is_reconnected() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("restart");
        let owner = OwnerToken::new();
        store.claim(&key, fp("s"), owner, LEASE).await.unwrap();
        server.stop();
        let err = store
            .claim(&key, fp("s"), OwnerToken::new(), LEASE)
            .await
            .unwrap_err();
        assert_ne!(err.kind(), StoreErrorKind::Corrupt, "{err}");
        server.restart();
        // The first command after the restart may still meet the old
        // connection; the next ones succeed.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let claim = loop {
            match store.claim(&key, fp("s"), OwnerToken::new(), LEASE).await {
                Ok(claim) => break claim,
                Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // SHUTDOWN SAVE kept the claim.
        assert_in_flight(&claim, fp("s"));
        assert!(store.release(&key, owner).await.unwrap());
    }

    #[tokio::test]
    async fn a_long_outage_fails_fast_and_recovers() {
        if !redis_available() {
            return;
        }
        let mut server = RedisServer::start();
        let store = RedisStore::standalone(server.url()).await.unwrap();
        let key = unique_key("outage");
        assert_acquired(&claim(&store, &key, fp("o"), LEASE).await);
        server.stop();
        // Longer than the connection's reconnect budget; every call fails
        // well within the layer's one-second store timeout.
        let down = std::time::Instant::now();
        while down.elapsed() < Duration::from_secs(4) {
            let start = std::time::Instant::now();
            let err = store
                .claim(&key, fp("o"), OwnerToken::new(), LEASE)
                .await
                .unwrap_err();
            assert_ne!(err.kind(), StoreErrorKind::Corrupt, "{err}");
            assert!(start.elapsed() < Duration::from_millis(900), "{err}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        server.restart();
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            match store.claim(&key, fp("o"), OwnerToken::new(), LEASE).await {
                Ok(claim) => break assert_in_flight(&claim, fp("o")),
                Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn cluster_spreads_keys_over_every_master() {
        let Some(cluster) = shared_cluster() else {
            return;
        };
        let store = RedisStore::cluster(cluster.urls()).await.unwrap();
        let mut owners = Vec::new();
        for i in 0..60 {
            let key = unique_key(&format!("spread-{i}"));
            let owner = OwnerToken::new();
            let got = store.claim(&key, fp("c"), owner, LEASE).await.unwrap();
            assert!(matches!(got, Claim::Acquired(_)));
            owners.push((key, owner));
        }
        for node in cluster.nodes() {
            let reply = super::support_redis::raw_command(node.port(), "DBSIZE").unwrap();
            let n: i64 = reply.trim().trim_start_matches(':').parse().unwrap();
            assert!(n > 0, "node {} holds no key", node.port());
        }
        for (key, owner) in owners {
            assert!(store.release(&key, owner).await.unwrap());
        }
    }
}
