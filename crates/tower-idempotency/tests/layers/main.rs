//! The layers in axum, hyper and tonic stacks: channels, keys, verification, promises, pressure, tokens, metrics, the README's example; orders; the memory store against the store conformance suite.

mod axum_example;
mod channels;
mod channels_client;
mod channels_webhooks;
mod fault_injection;
mod key_proptest;
mod keys;
mod metrics;
mod order;
mod pressure;
mod promises;
mod readme;
mod store_conformance;
mod tokens;
mod tonic_example;
mod verify;
mod verify_configured;
mod verify_one_parse;
