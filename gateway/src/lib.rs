//! The pieces of `idempotency-gateway`, a reverse proxy that makes
//! payment-channel callbacks and client submissions idempotent for a
//! service written in any language: a retry storm of WeChat Pay, Alipay or
//! Stripe notifications, or a triple-clicked "submit order", reaches the
//! upstream once, every copy gets the channel's proper reply, and nothing
//! is lost.
//!
//! The `idempotency-gateway` binary of this package is a command-line
//! program on these pieces (flags, a config file, TLS, metrics, traces,
//! the admin API, drain); install it with `cargo install
//! idempotency-gateway`. This library is for a program that embeds the
//! gateway, or parts of it, in its own process:
//!
//! - [`proxy`]: forwarding to an HTTP(S) upstream, routing by path prefix
//!   to a channel preset, acknowledge-then-deliver routes in front of a
//!   durable queue;
//! - [`shed`]: keeping the upstream standing under a backlog (a cap on the
//!   calls in flight, fixed or adaptive);
//! - [`journal`]: one record per notification key (its copies, what each
//!   got, what the upstream answered), written off the request path.
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
pub mod shed;

// Every Rust block of the README is a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}
