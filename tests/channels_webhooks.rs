//! Stripe, PayPal, Adyen and Standard Webhooks against real notification
//! bodies.
//!
//! The vectors (bodies in `tests/fixtures/`, headers, expected replies) are
//! the shared table in `tests/common/vectors.rs`; the scenarios each one runs
//! through `IdempotencyLayer::<preset>()` around a `service_fn` are in
//! `tests/common/scenarios.rs`.

mod common;

use common::vectors::*;

channel_tests! {
    stripe: STRIPE_VECTORS;
    paypal: PAYPAL_VECTORS;
    adyen: ADYEN_VECTORS;
    standard_webhooks: STANDARD_WEBHOOKS_VECTORS;
}
