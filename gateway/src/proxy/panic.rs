//! Panics caught at the gateway's service boundary: the caller gets a 500 on
//! a connection that stays open, and the panic is counted and logged.

use super::gateway::GatewayResponse;
use super::plain;
use futures_util::FutureExt;
use http::StatusCode;
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tower_idempotency::Outcome;
use tower_idempotency::ResponseBody;

/// Runs `fut`; a panic becomes a 500 counted as `outcome="panicked"` under
/// `preset`.
///
/// Not an `async fn`: one would hold `fut` twice (as its argument, and as
/// the future it awaits), and this boundary wraps a request's whole future.
pub(super) fn catching<P, F>(preset: P, fut: F) -> impl Future<Output = GatewayResponse>
where
    P: AsRef<str>,
    F: Future<Output = GatewayResponse>,
{
    AssertUnwindSafe(fut)
        .catch_unwind()
        .map(move |caught| match caught {
            Ok(res) => res,
            Err(payload) => panicked(preset.as_ref(), payload.as_ref()),
        })
}

fn panicked(preset: &str, payload: &(dyn Any + Send)) -> GatewayResponse {
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    tracing::warn!(preset, panic = message, "a request panicked: answered 500");
    let _ = message;
    Outcome::Panicked.count(&Arc::from(preset));
    // Senders retry a 500; the panic message stays in the log.
    let mut res =
        plain(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").map(ResponseBody::stream);
    res.extensions_mut().insert(Outcome::Panicked);
    res
}
