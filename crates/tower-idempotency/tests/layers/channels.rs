//! WeChat Pay v3 and v2 and Alipay against real notification bodies.
//!
//! The vectors (bodies in `tests/fixtures/`, headers, expected replies) are
//! the shared table in `tests/common/vectors.rs`; the scenarios each one runs
//! through `IdempotencyLayer::<preset>()` around a `service_fn` are in
//! `tests/common/scenarios.rs`. Stripe, PayPal, Adyen and Standard
//! Webhooks are in `channels_webhooks.rs`, client `Idempotency-Key`s in
//! `channels_client.rs`.

use test_support::common;

use common::vectors::*;
use std::path::Path;
use test_support::channel_tests;

channel_tests! {
    wechatpay_v3: WECHATPAY_V3_VECTORS;
    wechatpay_v2: WECHATPAY_V2_VECTORS;
    alipay: ALIPAY_VECTORS;
}

/// Every fixture is listed with its source in the fixtures README, and every
/// file a vector names is there.
#[test]
fn fixtures_are_documented() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            name == "README.md" || readme.contains(&format!("`{name}`")),
            "{name} is not listed in tests/fixtures/README.md"
        );
    }
    for v in ALL.iter().flat_map(|vs| vs.iter()) {
        let files = [Some(v.source), v.resent.file.map(Source::File)];
        for file in files.into_iter().flatten() {
            if let Source::File(f) = file {
                assert!(dir.join(f).is_file(), "{f} is missing");
            }
        }
    }
}
