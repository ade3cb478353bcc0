//! Every store call, bounded by the store timeout and timed.

use crate::store::StoreError;
use std::future::Future;
use std::task::Poll;
use std::time::Duration;

/// Runs one store call, turning a timeout into a [`StoreError`]. A call
/// that answers at its first poll (the memory store's) sets no timer.
pub(super) async fn store_call<T>(
    timeout: Duration,
    op: &'static str,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    #[cfg(feature = "metrics")]
    let start = std::time::Instant::now();
    let mut fut = std::pin::pin!(fut);
    let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
    let res = match first {
        Poll::Ready(res) => res,
        // Boxed: only a store that waits (Redis, SQL) gets here, and the
        // timer would otherwise enlarge every caller's future (copied whole
        // as it is built and moved) for the memory store's calls too.
        Poll::Pending => match Box::pin(tokio::time::timeout(timeout, fut)).await {
            Ok(res) => res,
            Err(_) => Err(StoreError::timeout(op, timeout)),
        },
    };
    #[cfg(feature = "metrics")]
    crate::outcome::store_latency(op, start.elapsed().as_secs_f64());
    res
}
