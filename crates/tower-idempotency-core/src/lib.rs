//! The store contract of [tower-idempotency]: what a store of idempotency
//! records implements, and nothing of the layers.
//!
//! A store crate (Redis, SQL, or your own) depends on this crate alone, so
//! that a change to a layer is never a breaking change for a store, and a
//! store's build compiles no layer, body parser or channel. The layers
//! crate re-exports everything here under the same paths
//! (`tower_idempotency::store::Store`, `tower_idempotency::Fingerprint`).
//!
//! - [`store::Store`]: the trait, with its records ([`store::Claim`],
//!   [`store::CompletedRecord`], [`store::StoredResponse`],
//!   [`store::RecordState`]) and errors ([`store::StoreError`]);
//! - [`store::OwnerToken`] and fencing ([`store::Ownership`]);
//! - [`Fingerprint`]: what a request means, compared on every copy;
//! - [`store::BoxStore`] and [`store::Either`]: a store picked at run time;
//! - [`store::CompletedCache`], [`store::Pollers`] and [`store::codec`]: the
//!   parts a store over the network builds on (a local cache of completed
//!   records, shared polling of in-flight keys, the record's bytes);
//! - `store::testing` (feature `testing`): the conformance suite every
//!   store passes.
//!
//! # Writing a store
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tower_idempotency_core::store::{
//!     Claim, CompletedRecord, Forgotten, OwnerToken, RecordState, Store, StoreError,
//! };
//! use tower_idempotency_core::Fingerprint;
//!
//! /// A store that keeps nothing and refuses every claim: the smallest
//! /// thing that compiles against the contract.
//! #[derive(Clone)]
//! struct Refusing;
//!
//! fn down() -> StoreError {
//!     StoreError::new(tower_idempotency_core::store::StoreErrorKind::Backend, "down")
//! }
//!
//! impl Store for Refusing {
//!     async fn claim(&self, _: &str, _: Fingerprint, _: OwnerToken, _: Duration)
//!         -> Result<Claim, StoreError> { Err(down()) }
//!     async fn complete(&self, _: &str, _: OwnerToken, _: Arc<CompletedRecord>, _: Duration)
//!         -> Result<bool, StoreError> { Err(down()) }
//!     async fn renew(&self, _: &str, _: OwnerToken, _: Duration)
//!         -> Result<bool, StoreError> { Err(down()) }
//!     async fn release(&self, _: &str, _: OwnerToken) -> Result<bool, StoreError> { Err(down()) }
//! }
//! # let _ = (Forgotten::Absent, RecordState::Absent);
//! ```
//!
//! [tower-idempotency]: https://docs.rs/tower-idempotency

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod fingerprint;
pub mod path;
pub mod store;

pub use fingerprint::Fingerprint;

// Every Rust block of the README is a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}
