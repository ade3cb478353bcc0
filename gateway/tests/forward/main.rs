//! The gateway binary in front of real upstreams over TCP: forwarding, answers, flags, limits, paths, TLS, verification, hostile senders.

mod gateway;
mod gateway_answers;
mod gateway_client_api;
mod gateway_deadline;
mod gateway_flags;
mod gateway_limits;
mod gateway_order;
mod gateway_paths;
mod gateway_pool_hygiene;
mod gateway_presets;
mod gateway_readme;
mod gateway_stream;
#[path = "../gateway_support/mod.rs"]
mod gateway_support;
mod gateway_tls;
mod gateway_unverified;
mod gateway_upstream;
mod gateway_upstreams;
mod gateway_values;
mod gateway_verify;
mod gateway_verify_hostile;
