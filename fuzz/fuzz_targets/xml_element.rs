//! An XML element (first line) read out of a body (the rest), and the WeChat
//! Pay v2 preset on the body.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::{Field, FingerprintSpec, KeySpec};
use tower_idempotency::Preset;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let (name, body) = common::split(data, b"\n");
    let name = String::from_utf8_lossy(name).into_owned();
    let body = Bytes::copy_from_slice(body);
    let parts = common::parts_with_headers(b"");
    let spec = KeySpec::new(
        [Field::xml(name.clone())],
        FingerprintSpec::Fields(vec![Field::xml(name), Field::xml("total_fee")]),
    );
    common::check(&spec, &parts, &body);
    common::check(&**Preset::wechatpay_v2().extractor(), &parts, &body);
});
