//! The `idempotency-key` preset (a client API) against its vector, and
//! keys scoped to the principal.
//!
//! The vectors (bodies in `tests/fixtures/`, headers, expected replies) are
//! the shared table in `tests/common/vectors.rs`; the scenarios each one runs
//! through `IdempotencyLayer::<preset>()` around a `service_fn` are in
//! `tests/common/scenarios.rs`.

use test_support::common;

use common::scenarios::{send, Handler};
use common::vectors::*;
use test_support::channel_tests;

channel_tests! {
    idempotency_key: IDEMPOTENCY_KEY_VECTORS;
}

/// Client-API keys are scoped to the principal: another user's request with
/// the same key runs on its own and never gets the first user's response.
#[tokio::test]
async fn idempotency_key_is_scoped_to_the_principal() {
    let v = &IDEMPOTENCY_KEY_VECTORS[0];
    let handler = Handler::answering(201);
    let svc = handler.stack(v.channel);
    let alice = v.base();
    let bob = Edit {
        set: &[("Authorization", "Bearer bob")],
        ..NO_EDIT
    }
    .apply(&alice);
    assert!(!send(&svc, v.channel.path, &alice).await.replayed());
    assert!(!send(&svc, v.channel.path, &bob).await.replayed());
    assert_eq!(handler.calls(), 2);
    assert!(send(&svc, v.channel.path, &alice).await.replayed());
    assert!(send(&svc, v.channel.path, &bob).await.replayed());
    assert_eq!(handler.calls(), 2);
}
