//! Where records live: the [`Store`] trait and its backends.
//!
//! The trait, its records and errors, and the parts a store builds on come
//! from [`tower_idempotency_core`], re-exported here under the same names;
//! the memory store and the tiered store are this crate's own.
//!
//! A record goes through this life cycle:
//!
//! ```text
//! absent ──claim──▶ in-flight{owner, fingerprint, lease} ──complete──▶ completed{fingerprint, response}
//!                      ├─ release (owner only) ──▶ absent
//!                      └─ lease expired ──▶ claimable again
//! ```
//!
//! Every operation but `claim` is checked against the owner token, so an owner
//! whose lease ran out can never overwrite or delete a newer owner's record.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{Claim, MemoryStore, OwnerToken, Store};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = MemoryStore::new();
//! let fp = Fingerprint::of(b"order 42");
//! let first = OwnerToken::new();
//! let claim = store.claim("k", fp, first, Duration::from_secs(30)).await.unwrap();
//! assert!(matches!(claim, Claim::Acquired(t) if t == first));
//! // Every claim that wins a key carries a fencing token that grows per key.
//! let Claim::Acquired(held) = claim else { unreachable!() };
//! assert!(store.release("k", first).await.unwrap());
//! let again = store.claim("k", fp, OwnerToken::new(), Duration::from_secs(30)).await.unwrap();
//! assert!(matches!(again, Claim::Acquired(next) if next.fence > held.fence));
//! let second = store.claim("k", fp, OwnerToken::new(), Duration::from_secs(30)).await.unwrap();
//! // A second claim while the first runs sees it in flight.
//! assert!(matches!(second, Claim::InFlight { .. }));
//! # }
//! ```

mod memory;
mod tiered;

pub use memory::{MemoryStore, MemoryStoreBuilder};
pub use tiered::TieredStore;
pub use tower_idempotency_core::store::*;

/// A claim answered with a variant this version of the layers does not
/// know (from a store built on a later version of the contract): a store
/// failure, handled by the store-error policy.
pub(crate) fn unknown_claim() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unsupported,
        "the store answered a claim this version does not know",
    )
}

#[cfg(test)]
mod tests {
    //! The boxed store over the memory store.
    use super::{BoxStore, MemoryStore};
    use crate::store::{Claim, CompletedRecord, Forgotten, OwnerToken, RecordState, Store};
    use crate::Fingerprint;
    use std::sync::Arc;
    use std::time::Duration;

    /// Every call reaches the wrapped store, the defaulted ones too.
    #[tokio::test]
    async fn every_call_goes_to_the_wrapped_store() {
        let store = BoxStore::new(MemoryStore::new());
        let fp = Fingerprint::of(b"x");
        let token = OwnerToken::new();
        let lease = Duration::from_secs(5);
        assert!(matches!(
            store.claim("k", fp, token, lease).await.unwrap(),
            Claim::Acquired(_)
        ));
        assert!(store.renew("k", token, lease).await.unwrap());
        let record = Arc::new(CompletedRecord::new(
            fp,
            crate::store::StoredResponse::new(
                http::StatusCode::OK,
                http::HeaderMap::new(),
                bytes::Bytes::from_static(b"ok"),
            ),
        ));
        let window = Duration::from_secs(60);
        assert!(store
            .complete("k", token, record.clone(), window)
            .await
            .unwrap());
        assert!(matches!(
            store
                .downcast_ref::<MemoryStore>()
                .unwrap()
                .inspect("k")
                .await
                .unwrap(),
            RecordState::Completed { .. }
        ));
        assert!(store.replace("k", record, window).await.unwrap());
        assert_eq!(store.forget("k").await.unwrap(), Forgotten::Deleted);
        assert!(!store.release("k", token).await.unwrap());
        store.put_token("t", window).await.unwrap();
        assert!(store.take_token("t", OwnerToken::new()).await.unwrap());
    }

    /// The store behind is found by its type, and only by it.
    #[test]
    fn downcast_finds_the_wrapped_type() {
        let store = BoxStore::new(MemoryStore::new());
        assert!(store.downcast_ref::<MemoryStore>().is_some());
        assert!(store.downcast_ref::<BoxStore>().is_none());
        assert!(format!("{store:?}").contains("MemoryStore"), "{store:?}");
    }
}
