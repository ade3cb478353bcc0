//! A whole idempotency gateway as a library: a reverse proxy that puts the
//! stack (normalize → key → dedup) in front of any HTTP(S) upstream, so an
//! existing payment-callback handler or order API runs once per
//! notification without a line of its code changing.
//!
//! - [`Forward`]: a tower service that forwards each request to an
//!   [`Upstream`] over a pooled client, bodies streamed both ways.
//! - [`Gateway`]: routes by longest path prefix ([`RouteTable`]) to a
//!   [`Target`], a preset or `auto` detection ([`detect`]), each with its
//!   own [`RouteOptions`], and forwards the rest untouched.
//! - Acknowledge-then-deliver routes ([`RouteOptions::ack_then_deliver`]):
//!   the same pipeline in front of a durable [queue](tower_idempotency_queue) given to
//!   [`GatewayBuilder::queue`] instead of the upstream; the channel's success
//!   reply only once the notification is stored; a
//!   [`Worker`](tower_idempotency_queue::Worker) over [`Gateway::deliverer`] delivers it
//!   later through the route's dedup layer.
//!
//! The `idempotency-gateway` binary of this package is a command-line
//! program on these pieces (flags, config file, TLS, metrics, drain).
//!
//! ```
//! use http::{Request, StatusCode};
//! use http_body_util::Full;
//! use bytes::Bytes;
//! use tower::ServiceExt;
//! use idempotency_gateway::proxy::{Forward, Gateway, RouteOptions, Target};
//! use tower_idempotency::store::MemoryStore;
//! use tower_idempotency::Preset;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Nothing listens on port 1: the upstream is down.
//! let forward = Forward::new("http://127.0.0.1:1".parse().unwrap());
//! let gateway = Gateway::builder(forward, MemoryStore::new())
//!     .route("/notify/wechat", Target::Preset(Preset::wechatpay_v3()))
//!     .route_with("/", Target::Auto, RouteOptions::new().max_body_bytes(1 << 20))
//!     .build()
//!     .unwrap();
//!
//! // An unguarded request is forwarded; a dead upstream is a 502.
//! let req = Request::get("/health").body(Full::new(Bytes::new())).unwrap();
//! let res = gateway.clone().oneshot(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::BAD_GATEWAY);
//!
//! // A WeChat Pay notification gets the channel's retryable failure reply.
//! let req = Request::post("/notify/wechat")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"id":"EV-1","event_type":"TRANSACTION.SUCCESS"}"#)))
//!     .unwrap();
//! let res = gateway.oneshot(req).await.unwrap();
//! assert!(res.status().is_server_error());
//! # }
//! ```

mod ack;
mod builder;
mod deadline;
mod destination;
mod detect;
mod entrance;
mod forward;
mod gateway;
mod headers;
mod ingest;
mod options;
mod order;
mod panic;
mod path;
mod pause;
mod pool;
mod route;
mod trace;
mod upstream;

pub use ack::{Deliver, Delivered, DeliveryError};
pub use builder::GatewayBuilder;
pub use destination::{destination_scope, destination_stored_key, Destination};
pub use detect::detect;
pub use forward::{Forward, ForwardBuilder, RoutePaused, UpstreamAnswer, DEFAULT_UPSTREAM_NAME};
pub use gateway::{Gateway, GatewayResponse, MatchedRoute, RoutedPreset, Target};
pub use headers::ClientConn;
pub use ingest::queued_keys;
pub use options::RouteOptions;
pub use pause::{pause_key, PauseInfo, Pauses};
pub use route::{RouteError, RouteTable};
pub use upstream::{CallLimit, Upstream, UpstreamError, DEFAULT_MAX_UPSTREAM_CALLS};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use tower::BoxError;

/// The body type [`Forward`] sends and answers: a streamed body.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A `text/plain` response of the gateway's own.
pub(crate) fn plain(status: StatusCode, msg: impl Into<Bytes>) -> Response<ProxyBody> {
    let body = Full::new(msg.into())
        .map_err(|never| match never {})
        .boxed_unsync();
    let mut res = Response::new(body);
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}
