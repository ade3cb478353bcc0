//! Stripe, PayPal, Adyen and Standard Webhooks against real notification
//! bodies.
//!
//! The vectors (bodies in `tests/fixtures/`, headers, expected replies) are
//! the shared table in `tests/common/vectors.rs`; the scenarios each one runs
//! through `IdempotencyLayer::<preset>()` around a `service_fn` are in
//! `tests/common/scenarios.rs`.

use test_support::common;

use common::vectors::*;
use test_support::channel_tests;

channel_tests! {
    stripe: STRIPE_VECTORS;
    paypal: PAYPAL_VECTORS;
    adyen: ADYEN_VECTORS;
    standard_webhooks: STANDARD_WEBHOOKS_VECTORS;
}

/// Every channel preset keeps a success longer than its channel keeps
/// retrying (the published schedules), so that a late retry is replayed,
/// not run again.
#[test]
fn preset_windows_outlast_each_channels_retries() {
    use std::time::Duration;
    let h = |n: u64| Duration::from_secs(n * 3600);
    let horizons = [
        ("wechatpay-v3", h(24) + Duration::from_secs(4 * 60)),
        ("wechatpay-v2", h(24) + Duration::from_secs(4 * 60)),
        ("alipay", h(25)),
        ("standard-webhooks", h(28)),
        ("stripe", h(72)),
        ("paypal", h(72)),
        ("adyen", h(30 * 24)),
    ];
    for (name, retries) in horizons {
        let window = tower_idempotency::Preset::from_name(name).unwrap().window();
        assert!(
            window > retries,
            "{name}: window {window:?} is shorter than its retries ({retries:?})"
        );
    }
}
