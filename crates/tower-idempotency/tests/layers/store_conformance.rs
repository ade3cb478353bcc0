//! The memory store (alone, and picked at run time in an `Either`) against
//! the conformance suite every store passes, and what only the memory store
//! does: a budget, early evictions, expiry.

use bytes::Bytes;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::testing::*;
use tower_idempotency::store::{Claim, MemoryStore, OwnerToken, Store};

/// Keeps whatever the store needs (a server) alive for one test.
type Guard = Option<Arc<dyn Any + Send + Sync>>;

async fn memory() -> Option<(MemoryStore, Guard)> {
    Some((MemoryStore::new(), None))
}

store_tests!(memory_store, memory, paused);

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

store_tests!(either_memory_store, either_memory, paused);

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
    #[tokio::test(start_paused = true)]
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
