//! The dedup layer: runs the inner service at most once per key and replays
//! the first success to every copy.
//!
//! It reads the [`IdempotencyKey`](crate::IdempotencyKey) that the
//! [key layer](crate::key) put into the request extensions; a request without
//! one, or with a safe method (GET, HEAD, OPTIONS, TRACE), passes through.
//! For a guarded request it claims the key in the [`Store`](crate::store::Store):
//!
//! - **acquired**: runs the inner service in a background task of the layer's
//!   [`TaskTracker`](crate::TaskTracker), renewing the lease every `lease/3`
//!   alongside it. A 2xx (and, for gRPC, `grpc-status: 0`) is streamed to the
//!   caller and teed into the record (up to
//!   [`max_cached_body_bytes`](DedupLayer::max_cached_body_bytes)); when its body ends the
//!   record is completed for the window. On any failure (non-2xx, `Err`,
//!   panic, body error) it releases the claim so that the next retry runs
//!   again. Failures are never cached.
//! - **completed**: replays the stored status, headers, body and trailers with
//!   `idempotent-replayed: true`, or answers 422 if the fingerprint differs.
//! - **in flight**: waits (up to `wait`) on one shared watch per key, then looks
//!   again: replays, takes over if the first failed, or answers 409 with
//!   `Retry-After` when the wait runs out.
//!
//! If the caller hangs up while the inner service runs, the call is finished
//! in the background so its result is recorded (on by default,
//! [`DedupLayer::finish_on_disconnect`]); a guard releases the claim on every
//! other exit path, panics included. Two clocks bound a call: past the
//! [reply deadline](DedupLayer::reply_timeout) the caller gets the retryable
//! failure while the call goes on and records its success; past the
//! [run limit](DedupLayer::max_run) the call is cancelled and its claim
//! released. The run limit bounds the call, not the caller's reading: a
//! caller that stops reading a streamed success is let go at the limit, and
//! the call goes on (once more the limit) to record its success.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::dedup::DedupLayer;
//! use tower_idempotency::key::{Field, FingerprintSpec, KeyLayer, KeySpec};
//! use tower_idempotency::store::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let runs = Arc::new(AtomicUsize::new(0));
//! let counter = runs.clone();
//! let svc = ServiceBuilder::new()
//!     .layer(KeyLayer::new(KeySpec::new(
//!         [Field::header(http::HeaderName::from_static("idempotency-key"))],
//!         FingerprintSpec::Request,
//!     )))
//!     .layer(DedupLayer::new(MemoryStore::new()))
//!     .service(service_fn(move |_req: Request<Full<Bytes>>| {
//!         let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
//!         async move { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("order {n}"))))) }
//!     }));
//!
//! for _ in 0..3 {
//!     let req = Request::post("/orders")
//!         .header("idempotency-key", "abc")
//!         .body(Full::new(Bytes::from_static(b"{}")))
//!         .unwrap();
//!     let res = svc.clone().oneshot(req).await.unwrap();
//!     assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "order 1");
//! }
//! assert_eq!(runs.load(Ordering::SeqCst), 1);
//! # }
//! ```

mod capture;
mod clock;
mod config;
mod guard;
mod layer;
mod owner;
mod reply;
mod run;
mod service;
mod store_call;

pub use config::{
    OnStoreError, DEFAULT_LEASE, DEFAULT_MAX_CACHED_BODY, DEFAULT_MAX_RUN, DEFAULT_STORE_TIMEOUT,
    DEFAULT_TOKEN_TTL, DEFAULT_WAIT, DEFAULT_WINDOW, MAX_SETTING, MIN_LEASE,
};
pub use layer::DedupLayer;
pub use service::{Dedup, ResponseFuture};

/// What the other payload of a reused key was doing, in the extensions of
/// the dedup layer's 422 (outcome [`Outcome::Mismatch`](crate::Outcome::Mismatch)).
///
/// A key found **completed** with another payload stays so for the whole
/// window: no later copy of this payload can succeed. A key found **in
/// flight** with another payload (perhaps on another instance sharing the
/// store) may yet fail and be released: a later copy can succeed, so a
/// queue's deliverer tries it again instead of giving it up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mismatched {
    /// The other payload's call still runs.
    InFlight,
    /// The other payload's call is done: its record holds the key.
    Completed,
}

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");

/// The header that marks a replay whose body was too large to keep.
pub const BODY_OMITTED_HEADER: http::HeaderName =
    http::HeaderName::from_static("idempotent-body-omitted");
