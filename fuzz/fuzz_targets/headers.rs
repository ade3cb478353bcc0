//! Header lines (`name: value`, up to a blank line) and a body: the header
//! presets, and a composite key of a header, a JSON value and a form field.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::{Field, FingerprintSpec, KeySpec};
use tower_idempotency::Preset;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let (head, body) = common::split(data, b"\n\n");
    let parts = common::parts_with_headers(head);
    let body = Bytes::copy_from_slice(body);
    for preset in [
        Preset::standard_webhooks(),
        Preset::idempotency_key(),
        Preset::client_token(),
    ] {
        common::check(&**preset.extractor(), &parts, &body);
    }
    let composite = KeySpec::new(
        [
            Field::header(http::HeaderName::from_static("webhook-id")),
            Field::header(http::HeaderName::from_static("x-part")),
        ],
        FingerprintSpec::Fields(vec![Field::header(http::HeaderName::from_static("x-part"))]),
    );
    common::check(&composite, &parts, &body);
    let mixed = KeySpec::new(
        [
            Field::header(http::HeaderName::from_static("x-part")),
            Field::json("/id"),
        ],
        FingerprintSpec::Request,
    );
    common::check(&mixed, &parts, &body);
});
