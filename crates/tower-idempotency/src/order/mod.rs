//! The state only moves forward: an [`Order`] places each notification in
//! the life of the object it is about, and the [`OrderLayer`] serves an
//! object's events one at a time, in order.
//!
//! Dedup makes each *event* run once. A payment has several events
//! (created, processing, succeeded, refunded), and the channels do not
//! deliver them in order: Stripe, PayPal and Adyen say so, and after an
//! outage Alipay's retries interleave. A handler that receives
//! `payment_intent.processing` after `payment_intent.succeeded` moves the
//! payment back. An order says, for a notification:
//!
//! - the **object** it is about (a payment intent's id, a trade number);
//! - its **version** (optional): a number, or an RFC 3339 time;
//! - its **state** (optional), ranked by a list from first to last.
//!
//! Its [`Position`] is `(version, rank)`: the version first, the rank
//! breaking ties (Stripe's `created` has a resolution of one second);
//! without a version, the rank alone. What an order cannot place (no
//! object, a state it does not list, a version that is neither a number nor
//! a time) is [`Placement::Unplaced`]: the layer forwards it as if there
//! were no order, and counts it.
//!
//! ```
//! use http::Request;
//! use bytes::Bytes;
//! use tower_idempotency::key::Field;
//! use tower_idempotency::order::{Order, Placement};
//! use tower_idempotency::store::Position;
//!
//! let shipments = Order::builder("shipments")
//!     .object(Field::json("/order_id"))
//!     .version(Field::json("/seq"))
//!     .state(Field::json("/status"), ["created", "paid", "shipped"])
//!     .build()
//!     .unwrap();
//! let (parts, _) = Request::post("/").body(()).unwrap().into_parts();
//! let body = Bytes::from_static(br#"{"order_id":"o-1","seq":7,"status":"paid"}"#);
//! assert_eq!(
//!     shipments.place(&parts, &body),
//!     Placement::Placed { object: "o-1".into(), position: Position::new(7, 1) }
//! );
//! let body = Bytes::from_static(br#"{"order_id":"o-1","seq":7,"status":"lost"}"#);
//! assert!(matches!(shipments.place(&parts, &body), Placement::Unplaced(_)));
//! ```
//!
//! Built in, named as the presets: [`Order::stripe`], [`Order::alipay`],
//! [`Order::paypal`] and, with the `verify` feature, `Order::wechatpay_v3`
//! (from the resource the verify layer decrypted); [`Order::builtin`] by
//! name.
//!
//! [`Position`]: crate::store::Position

mod alipay;
mod builder;
mod layer;
mod paypal;
mod place;
mod service;
mod stripe;
#[cfg(feature = "verify")]
mod wechatpay_v3;

pub use builder::{OrderBuilder, OrderError};
pub use layer::OrderLayer;
pub use place::{Order, Placement, Unplaced};
pub use service::{Ordered, OrderedEvent, Stale, STALE_HEADER};
