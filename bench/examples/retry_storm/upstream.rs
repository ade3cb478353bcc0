//! The upstream: an order table and the naive "check status, then act"
//! notification handler, racy on purpose.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

/// WeChat Pay v3's success reply: the only answer that stops its retries.
pub(crate) const SUCCESS_BODY: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
/// WeChat Pay v3's failure reply.
const FAIL_BODY: &str = r#"{"code":"FAIL","message":"失败"}"#;

/// A deterministic PRNG step (xorshift64*), seeded through splitmix64 so
/// that consecutive seeds give unrelated outputs.
pub(crate) fn xorshift(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut x = (z ^ (z >> 31)) | 1;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A uniform number in `[0, 1)` for `seed`.
fn unit(seed: u64) -> f64 {
    (xorshift(seed) >> 11) as f64 / (1u64 << 53) as f64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Unpaid,
    Paid,
}

#[derive(Debug)]
struct Order {
    status: Status,
    /// How many times `doAfterPay` ran for this order.
    executions: u32,
}

/// The shared state of the upstream: the order table and a request counter.
#[derive(Debug)]
pub(crate) struct Upstream {
    orders: Mutex<HashMap<String, Order>>,
    calls: AtomicU64,
    handler_ms: u64,
    failure_rate: f64,
}

impl Upstream {
    pub(crate) fn new(ids: &[String], handler_ms: u64, failure_rate: f64) -> Self {
        let orders = ids
            .iter()
            .map(|id| {
                let order = Order {
                    status: Status::Unpaid,
                    executions: 0,
                };
                (id.clone(), order)
            })
            .collect();
        Self {
            orders: Mutex::new(orders),
            calls: AtomicU64::new(0),
            handler_ms,
            failure_rate,
        }
    }

    fn status(&self, id: &str) -> Option<Status> {
        let orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        orders.get(id).map(|order| order.status)
    }

    /// `doAfterPay`: credit points, send the coupon, ship… here: count it.
    fn do_after_pay(&self, id: &str) {
        let mut orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(order) = orders.get_mut(id) {
            order.executions += 1;
            order.status = Status::Paid;
        }
    }

    pub(crate) fn executions(&self, id: &str) -> u32 {
        let orders = self.orders.lock().unwrap_or_else(PoisonError::into_inner);
        orders.get(id).map_or(0, |order| order.executions)
    }

    /// The naive notification handler: read the status, work, then act if
    /// it was unpaid. Racy on purpose.
    async fn handle(&self, body: Bytes) -> Response<Full<Bytes>> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if self.failure_rate > 0.0 && unit(call) < self.failure_rate {
            return reply(StatusCode::INTERNAL_SERVER_ERROR, FAIL_BODY);
        }
        let notification: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(_) => return reply(StatusCode::BAD_REQUEST, FAIL_BODY),
        };
        let Some(id) = notification.get("id").and_then(|id| id.as_str()) else {
            return reply(StatusCode::BAD_REQUEST, FAIL_BODY);
        };
        let Some(status) = self.status(id) else {
            return reply(StatusCode::NOT_FOUND, FAIL_BODY);
        };
        if self.handler_ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.handler_ms)).await;
        } else {
            // Keep the read-then-write window open even without work.
            tokio::task::yield_now().await;
        }
        if status == Status::Unpaid {
            self.do_after_pay(id);
        }
        reply(StatusCode::OK, SUCCESS_BODY)
    }
}

fn reply(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    res
}

/// The upstream handler as a tower service over any request body (hyper's
/// `Incoming` when alone, the key layer's buffered body behind the stack).
#[derive(Debug, Clone)]
pub(crate) struct Handler(pub(crate) Arc<Upstream>);

impl<B> tower::Service<Request<B>> for Handler
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let upstream = self.0.clone();
        Box::pin(async move {
            let body = match req.into_body().collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, FAIL_BODY)),
            };
            Ok(upstream.handle(body).await)
        })
    }
}
