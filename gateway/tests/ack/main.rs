//! The gateway binary's ack-then-deliver routes: every queue backend, pacing, outages of the queue and the upstream.

mod gateway_ack;
mod gateway_ack_copies;
mod gateway_ack_destinations;
mod gateway_ack_promise;
mod gateway_ack_sealed;
mod gateway_ack_upstreams;
mod gateway_dead_api;
mod gateway_outage;
mod gateway_pace;
mod gateway_pause;
#[path = "../gateway_support/mod.rs"]
mod gateway_support;
