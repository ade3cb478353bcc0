//! A JSON pointer (first line) read out of a body (the rest), and every JSON
//! channel preset on the body.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::{Field, FingerprintSpec, KeySpec};
use tower_idempotency::Preset;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let (pointer, body) = common::split(data, b"\n");
    let pointer = String::from_utf8_lossy(pointer).into_owned();
    let body = Bytes::copy_from_slice(body);
    let parts = common::parts_with_headers(b"");
    let spec = KeySpec::new(
        [Field::json(pointer.clone())],
        FingerprintSpec::Fields(vec![Field::json(pointer), Field::json("/type")]),
    );
    common::check(&spec, &parts, &body);
    for preset in [
        Preset::wechatpay_v3(),
        Preset::stripe(),
        Preset::paypal(),
        Preset::adyen(),
    ] {
        common::check(&**preset.extractor(), &parts, &body);
    }
});
