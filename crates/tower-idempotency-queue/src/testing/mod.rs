//! The conformance suite every [`Queue`] passes: deduplication at ingest,
//! leases that run out and leases kept by renewal, retries and
//! postponements due later, dead letters listed page by page, replayed
//! once, raced against a delete, keys forgotten, and a notification for
//! several destinations queued as an entry for each, one `async fn` per
//! case, generic over the queue and calling the [`Queue`] trait alone. The
//! memory, redb, RabbitMQ, NATS JetStream and [`Sealed`] queues run every
//! case, Redis Streams every case but [`a_lease_that_runs_out_is_lost`]
//! (its lease is the instance's, not the delivery's: only another instance
//! takes an entry whose lease ran out), and so can a queue of your own.
//!
//! [`queue_tests!`] writes one `#[tokio::test]` per case for a queue; a
//! case can also be called on its own. Each case takes a queue of its own,
//! empty (cases fetch whatever is due, so two cases cannot share one
//! queue; they can share one server), and uses keys of its own. The cases
//! run in real time: they fetch with a lease of [`LEASE`], hold an entry
//! by renewal for [`HOLD`], and retry or postpone for [`AFTER`]. A queue
//! whose lease is set when it is opened rather than by each fetch (NATS
//! JetStream's ack wait) must be opened with a lease shorter than
//! [`HOLD`].
//!
//! What a queue cannot do by design, it says through the trait, and the
//! case that needs it ends there: a queue whose [`delete_dead`] or
//! [`forget`] answers [`Unsupported`](QueueErrorKind::Unsupported) skips
//! the cases of those calls.
//!
//! ```no_run
//! use tower_idempotency_queue::testing::queue_tests;
//! use tower_idempotency_queue::MemoryQueue;
//!
//! // The queue of each test, and what must stay alive while it runs (a
//! // server, a temporary file): `None` skips the test.
//! async fn memory() -> Option<(MemoryQueue, ())> {
//!     Some((MemoryQueue::new(), ()))
//! }
//!
//! // Every case.
//! queue_tests!(memory_queue, memory);
//! // Or the cases listed (leave one out with a comment saying why).
//! queue_tests!(memory_queue_some, memory;
//!     copies_of_one_key_make_one_entry,
//!     a_dead_letter_is_replayed_once,
//! );
//! # fn main() {}
//! ```
//!
//! The generated tests run on tokio's multi-threaded runtime: the crate
//! that uses the macro needs `tokio` with the `macros` and
//! `rt-multi-thread` features among its dev-dependencies.
//!
//! [`Sealed`]: crate::Sealed
//! [`delete_dead`]: Queue::delete_dead
//! [`forget`]: Queue::forget

// The cases are tests: a failing one panics with what it saw.
#![allow(clippy::missing_panics_doc)]

use crate::{Delivery, EntryId, Ingested, Message, Queue, QueueErrorKind};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;
use tower_idempotency::store::OwnerToken;
use tower_idempotency::Fingerprint;

/// The lease of the cases' fetches and renewals.
pub const LEASE: Duration = Duration::from_millis(250);
/// How long a case holds an entry by renewal (past the end of its first
/// lease, and of a lease a queue sets when it is opened if it is shorter).
pub const HOLD: Duration = Duration::from_millis(1200);
/// How long the cases' retries and postponements wait.
pub const AFTER: Duration = Duration::from_millis(250);
/// How long a case waits for an entry that is due (a lease run out, a
/// retry due, a replay) before it fails.
pub const WITHIN: Duration = Duration::from_secs(10);
/// How far a queue's timers and clock may run ahead of the cases' (a
/// due time kept in milliseconds): an entry fetched earlier than its time
/// by more fails the case.
pub const SLACK: Duration = Duration::from_millis(20);

/// A key no other test (or earlier run against the same server) uses,
/// named after `case`.
pub fn unique_key(case: &str) -> String {
    format!(
        "queue:conformance:{case}:{:032x}",
        OwnerToken::new().as_u128()
    )
}

/// A notification of `key`, as a channel sends it.
pub fn message(key: &str) -> Message {
    let mut m = Message::new(
        key,
        Fingerprint::of(key.as_bytes()),
        format!(r#"{{"id":"{key}","event_type":"TRANSACTION.SUCCESS"}}"#),
    );
    m.uri = http::Uri::from_static("/notify/conformance");
    m.headers.insert(
        "wechatpay-serial",
        http::HeaderValue::from_static("5157F09EFDC096DE15EBE81A47057A72"),
    );
    m
}

/// Ingests `message(key)`, which must be queued as a new entry.
pub async fn queue_new<Q: Queue>(queue: &Q, key: &str) -> EntryId {
    match queue.ingest(message(key)).await.expect("ingest") {
        Ingested::Queued(id) => id,
        other => panic!("{key}: expected Queued, got {other:?}"),
    }
}

/// Fetches (with [`LEASE`]) until `n` entries came or [`WITHIN`] passed.
pub async fn fetch_n<Q: Queue>(queue: &Q, n: usize) -> Vec<Delivery> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && start.elapsed() < WITHIN {
        let batch = queue.fetch(n - got.len(), LEASE).await.expect("fetch");
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        got.extend(batch);
    }
    got
}

/// The one entry the queue hands out within [`WITHIN`].
pub async fn fetch_one<Q: Queue>(queue: &Q) -> Delivery {
    let mut got = fetch_n(queue, 1).await;
    assert_eq!(got.len(), 1, "no entry came within {WITHIN:?}");
    got.remove(0)
}

/// Fetches for `span`: nothing may be handed out.
pub async fn assert_nothing_due<Q: Queue>(queue: &Q, span: Duration) {
    let start = Instant::now();
    loop {
        let got = queue.fetch(10, LEASE).await.expect("fetch");
        assert!(
            got.is_empty(),
            "handed out after {:?}, and should not be: {:?}",
            start.elapsed(),
            got.iter().map(|d| &d.message.key).collect::<Vec<_>>()
        );
        if start.elapsed() >= span {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Seven copies of one notification arriving at once make one entry: one
/// copy answers `Queued`, six `Duplicate`; a copy with another payload is
/// refused (`Mismatch`) and stores nothing; the entry is handed out once.
pub async fn copies_of_one_key_make_one_entry<Q: Queue>(queue: Q) {
    let key = unique_key("copies");
    let start = Arc::new(Barrier::new(7));
    let copies: Vec<_> = (0..7)
        .map(|_| {
            let (queue, key, go) = (queue.clone(), key.clone(), start.clone());
            tokio::spawn(async move {
                go.wait().await;
                queue.ingest(message(&key)).await.expect("ingest")
            })
        })
        .collect();
    let (mut queued, mut duplicates) = (0, 0);
    for copy in copies {
        match copy.await.unwrap() {
            Ingested::Queued(_) => queued += 1,
            Ingested::Duplicate => duplicates += 1,
            other => panic!("a copy of the same payload: {other:?}"),
        }
    }
    assert_eq!((queued, duplicates), (1, 6));
    let mut forged = message(&key);
    forged.fingerprint = Fingerprint::of(b"another payload");
    assert_eq!(queue.ingest(forged).await.unwrap(), Ingested::Mismatch);
    assert_eq!(queue.stats().await.unwrap().depth, 1);
    let d = fetch_one(&queue).await;
    assert_eq!(d.message.key, key);
    assert_eq!(d.message.body, message(&key).body);
    assert_eq!(d.message.headers, message(&key).headers);
    assert_eq!(d.attempt, 1);
    assert!(queue.ack(&d).await.unwrap(), "the holder's ack");
    // Delivered: a late copy is still a duplicate, and nothing is left.
    assert_eq!(
        queue.ingest(message(&key)).await.unwrap(),
        Ingested::Duplicate
    );
    assert_nothing_due(&queue, LEASE / 2).await;
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
}

/// A lease that runs out is lost: the entry is not handed to another
/// fetch before, and is after; then every settlement of the first holder
/// answers `false` and changes nothing, the second holder's ack holds, and
/// the entry is delivered once.
pub async fn a_lease_that_runs_out_is_lost<Q: Queue>(queue: Q) {
    let key = unique_key("lease-lost");
    queue_new(&queue, &key).await;
    let first = fetch_one(&queue).await;
    let fetched = Instant::now();
    assert_nothing_due(&queue, LEASE / 2).await;
    let second = fetch_one(&queue).await;
    assert!(
        fetched.elapsed() + SLACK >= LEASE,
        "handed out again {:?} into a lease of {LEASE:?}",
        fetched.elapsed()
    );
    assert_eq!(second.message.key, key);
    assert!(second.attempt >= 2, "a second attempt: {}", second.attempt);
    assert!(!queue.ack(&first).await.unwrap(), "ack of a lost lease");
    assert!(
        !queue.retry(&first, AFTER, "late").await.unwrap(),
        "retry of a lost lease"
    );
    assert!(
        !queue.dead_letter(&first, "late").await.unwrap(),
        "dead letter of a lost lease"
    );
    assert!(queue.ack(&second).await.unwrap(), "the holder's ack");
    // Delivered once: nothing comes back, nothing died.
    assert_nothing_due(&queue, LEASE + LEASE / 2).await;
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
    assert_eq!(
        queue.ingest(message(&key)).await.unwrap(),
        Ingested::Duplicate
    );
}

/// A renewed lease holds: an entry renewed every quarter of its lease is
/// not handed to another fetch for [`HOLD`] (well past its first lease's
/// end), and its holder's ack then holds.
pub async fn renew_keeps_a_lease<Q: Queue>(queue: Q) {
    let key = unique_key("renew");
    queue_new(&queue, &key).await;
    let held = fetch_one(&queue).await;
    let start = Instant::now();
    while start.elapsed() < HOLD {
        assert!(
            queue.renew(&held, LEASE).await.unwrap(),
            "renewal {:?} into the hold",
            start.elapsed()
        );
        let got = queue.fetch(10, LEASE).await.unwrap();
        assert!(
            got.is_empty(),
            "a renewed entry handed out {:?} into the hold",
            start.elapsed()
        );
        tokio::time::sleep(LEASE / 4).await;
    }
    assert!(queue.renew(&held, LEASE).await.unwrap(), "last renewal");
    assert!(queue.ack(&held).await.unwrap(), "the holder's ack");
    assert_nothing_due(&queue, LEASE + LEASE / 2).await;
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

/// A retry and a postponement make the entry due [`AFTER`] from then, not
/// before; a retry counts as an attempt.
pub async fn retry_and_postpone_make_an_entry_due_later<Q: Queue>(queue: Q) {
    let key = unique_key("due-later");
    queue_new(&queue, &key).await;
    let d = fetch_one(&queue).await;
    let asked = Instant::now();
    assert!(queue.retry(&d, AFTER, "upstream down").await.unwrap());
    assert_nothing_due(&queue, AFTER / 2).await;
    let d = fetch_one(&queue).await;
    assert!(
        asked.elapsed() + SLACK >= AFTER,
        "a retry due after {AFTER:?} handed out after {:?}",
        asked.elapsed()
    );
    assert_eq!(d.message.key, key);
    assert_eq!(d.attempt, 2, "the retry counted");
    let asked = Instant::now();
    assert!(queue.postpone(&d, AFTER, "no route").await.unwrap());
    assert_nothing_due(&queue, AFTER / 2).await;
    let d = fetch_one(&queue).await;
    assert!(
        asked.elapsed() + SLACK >= AFTER,
        "a postponement for {AFTER:?} handed out after {:?}",
        asked.elapsed()
    );
    // A postponement may count (the trait's default) or not.
    assert!(matches!(d.attempt, 2 | 3), "attempt {}", d.attempt);
    assert!(queue.ack(&d).await.unwrap());
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
}

/// Dead letters listed page by page: each page holds at most its limit,
/// and every letter comes once, none missing, even when one already
/// listed is replayed between two pages; a copy of a dead-lettered key is
/// a duplicate.
pub async fn dead_letters_are_paged_each_once<Q: Queue>(queue: Q) {
    const N: usize = 7;
    const PAGE: usize = 3;
    let keys: HashSet<String> = (0..N).map(|_| unique_key("paging")).collect();
    for key in &keys {
        queue_new(&queue, key).await;
    }
    let held = fetch_n(&queue, N).await;
    assert_eq!(held.len(), N, "every entry fetched");
    for d in &held {
        assert!(queue.dead_letter(d, "upstream down").await.unwrap());
    }
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, N as u64), "{stats:?}");
    let all = queue.dead_letters(N + 1).await.unwrap();
    assert_eq!(all.len(), N);
    let found = queue.find_dead(&all[0].id).await.unwrap().expect("found");
    assert_eq!(found.message.key, all[0].message.key);
    assert_eq!(found.error, "upstream down");
    let copy = queue.ingest(message(&all[0].message.key)).await.unwrap();
    assert_eq!(copy, Ingested::Duplicate, "a copy of a dead-lettered key");
    let (mut ids, mut listed) = (HashSet::new(), Vec::new());
    let mut after: Option<EntryId> = None;
    let mut replayed = None;
    for _ in 0..=N {
        let page = queue.dead_page(after.as_ref(), PAGE).await.unwrap();
        assert!(page.len() <= PAGE, "a page of {}", page.len());
        let Some(last) = page.last() else {
            break;
        };
        after = Some(last.id.clone());
        for letter in &page {
            assert!(ids.insert(letter.id.clone()), "{} listed twice", letter.id);
            listed.push(letter.message.key.clone());
        }
        // A letter already listed leaves: the pages after go on.
        if replayed.is_none() {
            assert!(queue.replay(&page[0].id).await.unwrap());
            replayed = Some(page[0].message.key.clone());
        }
    }
    let listed_keys: HashSet<String> = listed.iter().cloned().collect();
    assert_eq!(listed.len(), N, "{listed:?}");
    assert_eq!(listed_keys, keys);
    assert_eq!(queue.dead_letters(N + 1).await.unwrap().len(), N - 1);
    let back = fetch_one(&queue).await;
    assert_eq!(Some(back.message.key.clone()), replayed);
    assert!(queue.ack(&back).await.unwrap());
}

/// Two replays of one dead letter at once: one answers `true`, the other
/// `false`; the entry is queued again once, with its attempts reset, and
/// delivered once.
pub async fn a_dead_letter_is_replayed_once<Q: Queue>(queue: Q) {
    let key = unique_key("replay");
    queue_new(&queue, &key).await;
    let d = fetch_one(&queue).await;
    assert!(queue.dead_letter(&d, "upstream down").await.unwrap());
    let dead = queue.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.key, key);
    let start = Arc::new(Barrier::new(2));
    let replays: Vec<_> = (0..2)
        .map(|_| {
            let (queue, id, go) = (queue.clone(), dead[0].id.clone(), start.clone());
            tokio::spawn(async move {
                go.wait().await;
                queue.replay(&id).await.unwrap()
            })
        })
        .collect();
    let mut won = 0;
    for r in replays {
        won += usize::from(r.await.unwrap());
    }
    assert_eq!(won, 1, "replays that had the letter");
    assert!(
        !queue.replay(&dead[0].id).await.unwrap(),
        "replayed already"
    );
    assert!(queue.dead_letters(10).await.unwrap().is_empty());
    let again = fetch_one(&queue).await;
    assert_eq!(again.message.key, key);
    assert_eq!(again.message.body, message(&key).body);
    assert_eq!(again.attempt, 1, "attempts reset");
    assert!(queue.ack(&again).await.unwrap());
    assert_nothing_due(&queue, LEASE + LEASE / 2).await;
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
}

/// A replay and a delete of one dead letter, raced: exactly one of them
/// has it. A replayed letter is delivered once; a deleted one never, and
/// its key is forgotten (a later copy is queued again). Skipped by a
/// queue that cannot delete dead letters.
pub async fn a_raced_replay_and_delete_have_the_letter_once<Q: Queue>(queue: Q) {
    const N: usize = 16;
    let keys: Vec<String> = (0..N).map(|_| unique_key("replay-delete")).collect();
    for key in &keys {
        queue_new(&queue, key).await;
    }
    for d in fetch_n(&queue, N).await {
        assert!(queue.dead_letter(&d, "upstream down").await.unwrap());
    }
    let dead = queue.dead_letters(N + 1).await.unwrap();
    assert_eq!(dead.len(), N);
    let (mut replayed, mut deleted) = (HashSet::new(), HashSet::new());
    for (n, letter) in dead.iter().enumerate() {
        let start = Arc::new(Barrier::new(2));
        let (q, id, go) = (queue.clone(), letter.id.clone(), start.clone());
        let replay = tokio::spawn(async move {
            go.wait().await;
            q.replay(&id).await.unwrap()
        });
        let (q, id, go) = (queue.clone(), letter.id.clone(), start.clone());
        let delete = tokio::spawn(async move {
            go.wait().await;
            // Every other round gives the replay a head start of a moment,
            // so that both orders are met.
            if n % 2 == 0 {
                tokio::task::yield_now().await;
            }
            q.delete_dead(&id).await
        });
        let replay = replay.await.unwrap();
        let delete = match delete.await.unwrap() {
            Err(e) if e.kind() == QueueErrorKind::Unsupported => {
                // This queue cannot delete: nothing to race.
                assert!(replay, "the replay alone had the letter");
                return;
            }
            other => other.expect("delete_dead"),
        };
        assert!(
            replay != delete.is_some(),
            "letter {n}: replayed {replay}, deleted {}",
            delete.is_some()
        );
        if let Some(gone) = &delete {
            assert_eq!(gone.message.key, letter.message.key);
            deleted.insert(letter.message.key.clone());
        } else {
            replayed.insert(letter.message.key.clone());
        }
    }
    assert!(queue.dead_letters(N + 1).await.unwrap().is_empty());
    let back = fetch_n(&queue, replayed.len()).await;
    let back_keys: HashSet<String> = back.iter().map(|d| d.message.key.clone()).collect();
    assert_eq!(back.len(), replayed.len());
    assert_eq!(back_keys, replayed);
    for d in &back {
        assert!(queue.ack(d).await.unwrap());
    }
    assert_nothing_due(&queue, LEASE).await;
    for key in &deleted {
        let copy = queue.ingest(message(key)).await.unwrap();
        assert!(
            matches!(copy, Ingested::Queued(_)),
            "a copy of a deleted letter's key: {copy:?}"
        );
    }
}

/// Forgetting a delivered key lets its next copy be queued and delivered
/// again; a key never seen answers `false`; a key still queued or
/// dead-lettered is refused, and its copy stays a duplicate. Skipped by a
/// queue that cannot forget.
pub async fn forget_lets_a_delivered_key_be_queued_again<Q: Queue>(queue: Q) {
    let key = unique_key("forget");
    match queue.forget(&key).await {
        Err(e) if e.kind() == QueueErrorKind::Unsupported => return,
        got => assert!(!got.expect("forget"), "a key never seen"),
    }
    queue_new(&queue, &key).await;
    assert!(queue.forget(&key).await.is_err(), "a key still queued");
    assert_eq!(
        queue.ingest(message(&key)).await.unwrap(),
        Ingested::Duplicate
    );
    let d = fetch_one(&queue).await;
    assert!(queue.ack(&d).await.unwrap());
    assert_eq!(
        queue.ingest(message(&key)).await.unwrap(),
        Ingested::Duplicate
    );
    assert!(queue.forget(&key).await.unwrap(), "a delivered key");
    assert!(!queue.forget(&key).await.unwrap(), "forgotten already");
    queue_new(&queue, &key).await;
    let d = fetch_one(&queue).await;
    assert_eq!(d.message.key, key);
    assert!(queue.ack(&d).await.unwrap());
    // Dead-lettered: refused, a copy stays a duplicate.
    let dead = unique_key("forget-dead");
    queue_new(&queue, &dead).await;
    let d = fetch_one(&queue).await;
    assert!(queue.dead_letter(&d, "upstream down").await.unwrap());
    assert!(queue.forget(&dead).await.is_err(), "a dead-lettered key");
    assert_eq!(
        queue.ingest(message(&dead)).await.unwrap(),
        Ingested::Duplicate
    );
    assert_eq!(queue.stats().await.unwrap().dead, 1);
}

/// A notification for two destinations ([`Queue::ingest_each`]) is an
/// entry for each: a copy is a duplicate for both; each is handed out,
/// acknowledged or dead-lettered on its own, carries its destination and
/// the notification's key; a dead letter names its destination and its
/// replay queues that destination's entry alone; forgetting one
/// destination's key queues the next copy for that destination alone.
pub async fn each_destination_is_an_entry_of_its_own<Q: Queue>(queue: Q) {
    use crate::destination_key;
    let key = unique_key("destinations");
    let both = ["orders", "ledger"];
    let got = queue.ingest_each(message(&key), both).await.unwrap();
    assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    let again = queue.ingest_each(message(&key), both).await.unwrap();
    assert_eq!(again, Ingested::Duplicate, "a copy, for both");
    let mut forged = message(&key);
    forged.fingerprint = Fingerprint::of(b"another payload");
    let forged = queue.ingest_each(forged, both).await.unwrap();
    assert_eq!(forged, Ingested::Mismatch);
    assert_eq!(queue.stats().await.unwrap().depth, 2);
    let mut handed = fetch_n(&queue, 2).await;
    assert_eq!(handed.len(), 2);
    handed.sort_by(|a, b| a.message.destination.cmp(&b.message.destination));
    let [ledger, orders] = [&handed[0], &handed[1]];
    assert_eq!(ledger.message.destination.as_deref(), Some("ledger"));
    assert_eq!(orders.message.destination.as_deref(), Some("orders"));
    for d in &handed {
        assert_eq!(d.message.notification_key(), key);
        assert_eq!(d.message.body, message(&key).body);
        assert_eq!(d.message.headers, message(&key).headers);
        assert_eq!(d.attempt, 1);
    }
    assert_eq!(orders.message.key, destination_key(&key, "orders"));
    assert!(queue.ack(orders).await.unwrap());
    assert!(queue.dead_letter(ledger, "ledger down").await.unwrap());
    let dead = queue.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1, "the ledger's entry alone");
    assert_eq!(dead[0].message.destination.as_deref(), Some("ledger"));
    assert_eq!(dead[0].message.notification_key(), key);
    let again = queue.ingest_each(message(&key), both).await.unwrap();
    assert_eq!(
        again,
        Ingested::Duplicate,
        "delivered to one, dead for the other"
    );
    assert!(queue.replay(&dead[0].id).await.unwrap());
    let back = fetch_one(&queue).await;
    assert_eq!(back.message.destination.as_deref(), Some("ledger"));
    assert_eq!(back.attempt, 1);
    assert!(queue.ack(&back).await.unwrap());
    assert_nothing_due(&queue, LEASE).await;
    match queue.forget(&destination_key(&key, "orders")).await {
        Err(e) if e.kind() == QueueErrorKind::Unsupported => return,
        got => assert!(got.expect("forget"), "a delivered destination"),
    }
    let got = queue.ingest_each(message(&key), both).await.unwrap();
    assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    let d = fetch_one(&queue).await;
    assert_eq!(d.message.destination.as_deref(), Some("orders"));
    assert!(queue.ack(&d).await.unwrap());
    assert_nothing_due(&queue, LEASE).await;
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.depth, stats.dead), (0, 0), "{stats:?}");
}

/// Writes one `#[tokio::test]` per case of the suite for a queue, in a
/// module `$name`: `queue_tests!(name, setup)` for every case, or
/// `queue_tests!(name, setup; case, case,)` for those listed. `setup` is an
/// `async fn() -> Option<(Q, Guard)>` called once per test: a fresh queue
/// and what must stay alive while the test runs; `None` skips the test.
///
/// See the [module docs](self) for an example.
#[doc(inline)]
pub use crate::__queue_tests as queue_tests;

#[doc(hidden)]
#[macro_export]
macro_rules! __queue_tests {
    ($name:ident, $setup:path) => {
        $crate::__queue_tests!($name, $setup;
            copies_of_one_key_make_one_entry,
            a_lease_that_runs_out_is_lost,
            renew_keeps_a_lease,
            retry_and_postpone_make_an_entry_due_later,
            dead_letters_are_paged_each_once,
            a_dead_letter_is_replayed_once,
            a_raced_replay_and_delete_have_the_letter_once,
            forget_lets_a_delivered_key_be_queued_again,
            each_destination_is_an_entry_of_its_own,
        );
    };
    ($name:ident, $setup:path; $($case:ident),+ $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let Some((queue, _guard)) = $setup().await else {
                        return;
                    };
                    $crate::testing::$case(queue).await;
                }
            )+
        }
    };
}
