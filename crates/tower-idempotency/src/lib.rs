//! Tower layers that make payment-channel callbacks and client submissions
//! idempotent.
//!
//! A retry storm of WeChat Pay, Alipay or Stripe notifications, or a
//! triple-clicked "submit order", runs the business logic exactly once; every
//! copy gets the channel's proper reply, and nothing is lost.
//!
//! # Quick start
//!
//! A WeChat Pay v3 notification route that checks the signature, decrypts
//! the resource for its handler and runs it once per notification, and a
//! client API keyed by `Idempotency-Key`:
//!
//! ```
//! use axum::{http::StatusCode, routing::post, Router};
//! use tower_idempotency::verify::{DecryptedResource, WechatPayV3Keys};
//! use tower_idempotency::IdempotencyLayer;
//!
//! async fn on_wechat_paid(DecryptedResource(tx): DecryptedResource) -> StatusCode {
//!     // `tx` is the decrypted transaction JSON: mark it paid…
//!     StatusCode::OK // any 2xx is success
//! }
//! async fn create_order(body: String) -> String { format!("created from {body}") }
//!
//! // The platform certificate under its `Wechatpay-Serial`, and the APIv3 key
//! // (here wechatpay-go's test keys).
//! let pem = std::fs::read("tests/fixtures/wechatpay_v3_platform_cert.pem").unwrap();
//! let keys = WechatPayV3Keys::new()
//!     .platform_key("D7CE59D1F522D701", pem).unwrap()
//!     .api_v3_key("testMchAPIv3Key0").unwrap();
//! let app: Router = Router::new()
//!     .route("/notify/wechat", post(on_wechat_paid).layer(IdempotencyLayer::wechatpay_v3().verify(keys)))
//!     .route("/orders", post(create_order).layer(IdempotencyLayer::idempotency_key()));
//! ```
//!
//! A channel route without [`verify`](IdempotencyLayer::verify) accepts
//! notifications nobody signed; with `tracing` its layer warns once.
//!
//! # The stack
//!
//! ```text
//! request ─▶ Normalize ─▶ Verify ─▶ Key ─▶ Dedup ─▶ inner service
//! response ◀─ channel reply ◀──── replay / record ◀────
//! ```
//!
//! - [`key`]: buffers the body (413 past the limit), reads the key and the
//!   fingerprint, scopes the key.
//! - [`dedup`]: claims the key in a [`store`], runs the inner service once,
//!   replays the first success, makes duplicates wait.
//! - [`verify`]: checks the channel's signature before the
//!   key is claimed; off unless keys are configured.
//! - [`normalize`]: writes the channel's exact success and failure replies.
//! - [`IdempotencyLayer`]: all three for one [`Preset`].
//! - [`order`]: an object's events one at a time and in order, behind the
//!   dedup layer (`OrderLayer`): an event older than the object's state is
//!   answered as a success without reaching the handler.
//! - [`consumer`]: the same once-per-key guarantee for any message handler
//!   (`Consumer::once`, `ConsumerLayer`).
//!
//! Beside this crate: `tower-idempotency-queue` acknowledges after a
//! durable write and delivers later (embedded, Redis Streams, RabbitMQ, NATS
//! JetStream), with retries and dead letters; `idempotency-gateway` is a
//! reverse proxy with these layers for a service written in any language.
//!
//! # Promises
//!
//! - The inner service runs at most once per key within the window.
//! - No success reply is sent before the inner service succeeded.
//! - A failure releases the claim and is never cached: the next retry runs.
//! - A replay is faithful (status, headers, body, trailers) and says
//!   `idempotent-replayed: true`.
//! - Another payload under the same key is never replayed: it gets 422 (or
//!   the channel's failure reply).
//! - Bodies, keys, the store and every store call are bounded.
//! - A store outage is handled by the policy you choose ([`OnStoreError`]).
//!
//! The crate's tests check each of these.
//!
//! # Presets
//!
//! | preset | key | success reply |
//! |---|---|---|
//! | `wechatpay-v3` | JSON `/id` | 200 `{"code":"SUCCESS","message":"成功"}` |
//! | `wechatpay-v2` | XML `transaction_id` | 200 XML `SUCCESS` / `OK` |
//! | `alipay` | form `notify_id` | 200 `success` |
//! | `stripe` | JSON `/id` | 200 `{"received":true}` |
//! | `paypal` | JSON `/id` | 200 |
//! | `adyen` | `pspReference:eventCode:success` | 200 `[accepted]` |
//! | `standard-webhooks` | header `webhook-id` | 204 |
//! | `idempotency-key` | header `Idempotency-Key` | the inner response |
//! | `client-token` | header `Idempotency-Token`, issued by [`token::IssueToken`] and consumed once | the inner response |
//!
//! See [`channel`] for fingerprints and failure replies.
//!
//! # Many instances
//!
//! Instances that share a Redis store (`tower-idempotency-redis`) share their records: a copy
//! that reaches instance B while instance A runs the first waits and replays
//! A's response, or takes over if A fails or dies (its lease runs out). Give
//! every instance the same scope: the route part of keys defaults to the
//! route axum matched or the normalised request path, so instances mounted
//! under different paths (proxy prefixes) must set
//! [`IdempotencyLayer::route`] to one name. A claim
//! survives a store outage only as long as its lease: keep the lease longer
//! than the outages you expect while a handler runs.
//!
//! # What no layer can close
//!
//! An instance that dies after handing a request to a remote upstream cannot
//! know whether the upstream acted: after the lease runs out, the retry is
//! forwarded again. Keep a unique index in the business database (for
//! example on the channel's transaction id) as the backstop. Keep the lease
//! short enough for retries and long enough for the handler: renewal every
//! `lease/3` makes both possible.
//!
//! # Feature flags
//!
//! | feature | what it adds |
//! |---|---|
//! | `axum` | [`IdempotencyKey`] (and `Option<IdempotencyKey>`) as an axum extractor, and with `verify` the decrypted WeChat Pay v3 resource (`verify::DecryptedResource`); the layers themselves work with axum without it |
//! | `metrics` | `idempotency_requests_total{preset,outcome}` and `idempotency_store_seconds` through the `metrics` facade |
//! | `tracing` | warnings on mismatches, store failures, lost leases and panics, and a span per request (`idempotency`, with `verify`, `claim`, `upstream` and `replay` under it), carrying the preset, the key's hash and the outcome |
//! | `otel` | with `tracing`, [`trace`]: W3C `traceparent` / `tracestate` in and out of headers, for a proxy that passes the trace on to its upstream, and the crate's spans as OpenTelemetry spans through `tracing-opentelemetry` |
//! | `verify` | [`verify`]: the sender's signature checked before the claim, for every channel |
//! | `testing` | `store::testing`: the conformance suite every store passes, for the tests of a store of your own |
//!
//! With `tracing`, a channel route without verification (no `.verify(..)`)
//! says so once, with a warning, when its layer is applied.
// Links to items of features that are off go to docs.rs, not nowhere.
#![cfg_attr(
    not(feature = "otel"),
    doc = "\n\n[`trace`]: https://docs.rs/tower-idempotency/latest/tower_idempotency/trace/index.html"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod body;
pub mod channel;
pub mod consumer;
pub mod dedup;
mod headers;
pub mod key;
mod layer;
pub mod limit;
pub mod normalize;
pub mod order;
mod outcome;
mod span;
pub mod store;
pub mod token;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod trace;
pub mod verify;

pub use body::ResponseBody;

/// Not part of the API, and not covered by semver: what the
/// `idempotency-gateway` crate of this workspace shares with the layers
/// (one header, form and XML rule for both). Use the layers instead.
#[doc(hidden)]
pub mod __private {
    pub use crate::body::{text_response, text_response_owned};
    pub use crate::headers::{connection_named, is_hop_by_hop};
    pub use crate::key::form::parse_form;
    pub use crate::key::service::is_guarded_method;
    pub use crate::key::xml::flat_fields;
}
pub use channel::{Preset, PresetBuilder, PresetError, WithoutKey};
pub use dedup::OnStoreError;
pub use key::IdempotencyKey;
pub use layer::{Idempotency, IdempotencyLayer};
pub use outcome::Outcome;
pub use tower_idempotency_core::{path, Fingerprint};
// Every Rust block of the README is a doctest: `cargo test --doc` compiles
// and runs them.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}

/// Tracks the background work of the dedup layers (see
/// [`DedupLayer::task_tracker`](crate::dedup::DedupLayer::task_tracker)).
pub use tokio_util::task::TaskTracker;
