//! Keep the upstream standing: at most N calls in flight, a short wait for
//! a slot, then the retryable failure at once.
//!
//! A backlog (the storm after an outage: thousands of distinct
//! notifications at once) must not reach the upstream faster than it can
//! bear. [`InFlightLimitLayer`] caps the calls in flight to the service it
//! wraps, as tower's `ConcurrencyLimit` does, but a call that finds every
//! slot taken waits at most the queue wait (50 ms unless set) and is then
//! answered, not queued and not failed with an `Err` (as tower's
//! `LoadShed` would): `503 Service Unavailable` with `Retry-After: 1`,
//! marked [`Outcome::Shed`](tower_idempotency::Outcome::Shed).
//!
//! Put it *inside* the [`IdempotencyLayer`](tower_idempotency::IdempotencyLayer), in
//! front of the handler or the upstream client: copies of a notification
//! in flight then wait for their first copy at the dedup layer without
//! taking a slot, and a shed call releases its claim, is counted as
//! `idempotency_requests_total{outcome="shed"}`, and reaches the sender as
//! its channel's retryable failure reply (a client API's caller gets the
//! 503 and its `Retry-After`). The channel comes back on its schedule:
//! nothing is lost, nothing runs twice.
//!
//! How many: the upstream's throughput times its latency (Little's law). An
//! upstream that serves 400 calls a second at 50 ms each has about 20 in
//! progress at its best; more only queue inside it.
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tokio::sync::Semaphore;
//! use tower::{ServiceBuilder, ServiceExt};
//! use idempotency_gateway::shed::InFlightLimitLayer;
//! use tower_idempotency::{IdempotencyLayer, Outcome};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let gate = Arc::new(Semaphore::new(0));
//! let limit = InFlightLimitLayer::new(1).queue_wait(Duration::from_millis(10));
//! let slots = limit.slots().clone();
//! let handler = {
//!     let gate = gate.clone();
//!     move |_req: http::Request<Full<Bytes>>| {
//!         let gate = gate.clone();
//!         async move {
//!             let _open = gate.acquire().await.unwrap();
//!             Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
//!         }
//!     }
//! };
//! let svc = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::stripe())
//!     .layer(limit)
//!     .service_fn(handler);
//! let event = |id: &str| {
//!     let body = format!(r#"{{"id":"{id}","type":"charge.succeeded"}}"#);
//!     http::Request::post("/webhooks/stripe")
//!         .header("content-type", "application/json")
//!         .body(Full::new(Bytes::from(body)))
//!         .unwrap()
//! };
//!
//! // The first event takes the only slot and waits in the handler.
//! let first = tokio::spawn(svc.clone().oneshot(event("evt_1")));
//! while slots.in_flight() == 0 {
//!     tokio::task::yield_now().await;
//! }
//! // The second waits 10 ms for a slot, then gets Stripe's retryable failure.
//! let shed = svc.clone().oneshot(event("evt_2")).await.unwrap();
//! assert!(shed.status().is_server_error());
//! assert_eq!(shed.extensions().get::<Outcome>(), Some(&Outcome::Shed));
//!
//! gate.add_permits(2);
//! assert_eq!(first.await.unwrap().unwrap().status(), 200);
//! // Nothing was claimed for the shed event: its retry runs.
//! assert_eq!(svc.oneshot(event("evt_2")).await.unwrap().status(), 200);
//! # }
//! ```

mod adaptive;
mod service;
mod share;
mod slots;

pub use adaptive::{AimdLimit, InvalidAimdLimit};
pub use service::{InFlightBody, InFlightLimit, InFlightLimitLayer, ResponseFuture};
pub(crate) use share::Shares;
pub(crate) use slots::{failed, Gauge, Slot};
pub use slots::{Slots, DEFAULT_QUEUE_WAIT};
