//! The pieces of `idempotency-gateway`, a reverse proxy that makes
//! payment-channel callbacks and client submissions idempotent for a
//! service written in any language: a retry storm of WeChat Pay, Alipay or
//! Stripe notifications, or a triple-clicked "submit order", reaches the
//! upstream once, every copy gets the channel's proper reply, and nothing
//! is lost.
//!
//! A gateway in front of an upstream on port 9000, serving on 8080: Stripe
//! webhooks and an `Idempotency-Key` API run the upstream once per key,
//! the rest is forwarded as it is (add `tower-idempotency`, `tokio` with
//! `full` and `hyper-util` with `server-auto,service,tokio`):
//!
//! ```no_run
//! use hyper_util::rt::{TokioExecutor, TokioIo};
//! use hyper_util::server::conn::auto;
//! use hyper_util::service::TowerToHyperService;
//! use idempotency_gateway::proxy::{Forward, Gateway, Target};
//! use tower_idempotency::store::MemoryStore;
//! use tower_idempotency::Preset;
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     let forward = Forward::new("http://127.0.0.1:9000".parse()?);
//!     let gateway = Gateway::builder(forward, MemoryStore::new())
//!         .route("/notify/stripe", Target::Preset(Preset::stripe()))
//!         .route("/api", Target::Preset(Preset::idempotency_key()))
//!         .build()?;
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//!     loop {
//!         let (tcp, _) = listener.accept().await?;
//!         let service = TowerToHyperService::new(gateway.clone());
//!         tokio::spawn(async move {
//!             let _ = auto::Builder::new(TokioExecutor::new())
//!                 .serve_connection(TokioIo::new(tcp), service)
//!                 .await;
//!         });
//!     }
//! }
//! ```
//!
//! (A verified route takes the channel's keys: `RouteOptions::verify`, or
//! a `verify` table read with [`config::VerifyConfig`].)
//!
//! The `idempotency-gateway` binary of this package is a command-line
//! program on these pieces (flags, a config file, TLS, metrics, traces,
//! the admin API, drain); install it from a clone of the repository with
//! `cargo install --locked --path gateway` (the crates are not on crates.io
//! yet). This library is for a program that embeds the gateway, or parts
//! of it, in its own process:
//!
//! - [`proxy`]: forwarding to an HTTP(S) upstream, routing by path prefix
//!   to a channel preset, acknowledge-then-deliver routes in front of a
//!   durable queue;
//! - [`shed`]: keeping the upstream standing under a backlog (a cap on the
//!   calls in flight, fixed or adaptive);
//! - [`journal`]: one record per notification key (its copies, what each
//!   got, what the upstream answered), written off the request path;
//! - [`reconcile`]: a channel's bill against the journal (never ran, ran
//!   more than once, another amount);
//! - [`config`]: the parts of the configuration file a program embedding
//!   the gateway can read the same way (a route's `verify` table).
//!
//! The layers themselves (keys, dedup, verification, the stores) are the
//! [`tower_idempotency`] crate's.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod config;
pub mod journal;
pub mod proxy;
pub mod reconcile;
pub mod shed;

// Every Rust block of the README and of the pages of `docs/` is a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/configuration.md")]
mod configuration_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/channels.md")]
mod channels_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/operating.md")]
mod operating_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/queues.md")]
mod queues_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/security.md")]
mod security_doctests {}
#[cfg(doctest)]
#[doc = include_str!("../docs/reference.md")]
mod reference_doctests {}
