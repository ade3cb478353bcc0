//! Channel presets: the key, fingerprint, reply and defaults of each payment
//! channel, one file per channel.
//!
//! | preset | key | fingerprint | success reply | failure reply |
//! |---|---|---|---|---|
//! | `wechatpay-v3` | JSON `/id` | `event_type`, `resource.original_type` | 200 `{"code":"SUCCESS","message":"成功"}` | 500 `{"code":"FAIL","message":"失败"}` |
//! | `wechatpay-v2` | XML `transaction_id` | `out_trade_no`, `total_fee`, `result_code` | 200 XML `return_code` SUCCESS | 500 XML `return_code` FAIL |
//! | `alipay` | form `notify_id` | `out_trade_no`, `trade_no`, `trade_status`, `total_amount` | 200 `success` | 500 `fail` |
//! | `stripe` | JSON `/id` | `type` | 200 `{"received":true}` | 500 |
//! | `paypal` | JSON `/id` | `event_type` | 200 | 500 |
//! | `adyen` | `pspReference:eventCode:success` of the first item | `amount` | 200 `[accepted]` | 500 |
//! | `standard-webhooks` | header `webhook-id` | — | 204 | 500 |
//! | `idempotency-key` | header `Idempotency-Key` | method, path, body | inner response | 400 missing, 409 in flight, 422 mismatch |
//! | `client-token` | header `Idempotency-Token` (issued, consumed once) | method, path, body | inner response | 400 missing/unknown/used token, 409 in flight or strict, 422 mismatch |
//!
//! Channel fingerprints never hash the raw body: retries are re-signed and
//! re-timestamped. Channel defaults: window 25 h, wait 4 s, lease 30 s, body
//! limit 64 KiB. Client-key defaults: window 24 h, body limit 1 MiB, keys
//! scoped to a hash of `Authorization`.
//!
//! ```
//! use tower_idempotency::Preset;
//! let p = Preset::from_name("wechatpay-v3").unwrap();
//! assert_eq!(p.name(), "wechatpay-v3");
//! assert_eq!(p.reply().success().unwrap().body().unwrap(), r#"{"code":"SUCCESS","message":"成功"}"#);
//! ```

mod adyen;
mod alipay;
mod client_token;
mod idempotency_key;
mod paypal;
mod standard_webhooks;
mod stripe;
mod wechatpay_v2;
mod wechatpay_v3;

pub use client_token::TOKEN_HEADER;

use crate::key::{ExtractKey, KeySpec};
use crate::normalize::{FixedReply, Reply};
use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Everything a route needs to know about its sender.
#[derive(Clone)]
pub struct Preset {
    name: Arc<str>,
    extractor: Arc<dyn ExtractKey>,
    describe: Arc<str>,
    reply: Reply,
    window: Duration,
    wait: Duration,
    max_body: usize,
    client_api: bool,
    consume_token: bool,
}

impl fmt::Debug for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Preset")
            .field("name", &self.name)
            .field("key", &self.describe)
            .field("reply", &self.reply)
            .field("window", &self.window)
            .field("wait", &self.wait)
            .field("max_body", &self.max_body)
            .finish()
    }
}

/// The names of the built-in presets.
pub const PRESET_NAMES: &[&str] = &[
    "wechatpay-v3",
    "wechatpay-v2",
    "alipay",
    "stripe",
    "paypal",
    "adyen",
    "standard-webhooks",
    "idempotency-key",
    "client-token",
];

const CHANNEL_WINDOW: Duration = Duration::from_secs(25 * 3600);
const CLIENT_WINDOW: Duration = Duration::from_secs(24 * 3600);
const CHANNEL_MAX_BODY: usize = 64 * 1024;
const CLIENT_MAX_BODY: usize = 1024 * 1024;
const DEFAULT_WAIT: Duration = Duration::from_secs(4);

impl Preset {
    /// A channel preset from a key spec and a reply format, with the channel
    /// defaults (window 25 h, wait 4 s, body limit 64 KiB).
    pub fn channel(name: impl Into<Arc<str>>, key: KeySpec, reply: Reply) -> Self {
        let describe = Arc::from(key.describe());
        Self {
            name: name.into(),
            extractor: Arc::new(key),
            describe,
            reply,
            window: CHANNEL_WINDOW,
            wait: DEFAULT_WAIT,
            max_body: CHANNEL_MAX_BODY,
            client_api: false,
            consume_token: false,
        }
    }

    /// A client-API preset: responses pass through, keys are scoped to a hash
    /// of `Authorization` (window 24 h, wait 4 s, body limit 1 MiB).
    pub fn client_api(
        name: impl Into<Arc<str>>,
        extractor: impl ExtractKey,
        describe: impl Into<Arc<str>>,
    ) -> Self {
        Self {
            name: name.into(),
            extractor: Arc::new(extractor),
            describe: describe.into(),
            reply: Reply::pass_through(),
            window: CLIENT_WINDOW,
            wait: DEFAULT_WAIT,
            max_body: CLIENT_MAX_BODY,
            client_api: true,
            consume_token: false,
        }
    }

    /// A built-in preset by its name (see [`PRESET_NAMES`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "wechatpay-v3" => Self::wechatpay_v3(),
            "wechatpay-v2" => Self::wechatpay_v2(),
            "alipay" => Self::alipay(),
            "stripe" => Self::stripe(),
            "paypal" => Self::paypal(),
            "adyen" => Self::adyen(),
            "standard-webhooks" => Self::standard_webhooks(),
            "idempotency-key" => Self::idempotency_key(),
            "client-token" => Self::client_token(),
            _ => return None,
        })
    }

    /// WeChat Pay API v3 notifications.
    pub fn wechatpay_v3() -> Self {
        wechatpay_v3::preset()
    }

    /// WeChat Pay API v2 (XML) notifications.
    pub fn wechatpay_v2() -> Self {
        wechatpay_v2::preset()
    }

    /// Alipay asynchronous notifications (form-encoded).
    pub fn alipay() -> Self {
        alipay::preset()
    }

    /// Stripe webhooks.
    pub fn stripe() -> Self {
        stripe::preset()
    }

    /// PayPal webhooks.
    pub fn paypal() -> Self {
        paypal::preset()
    }

    /// Adyen standard (JSON) notifications.
    pub fn adyen() -> Self {
        adyen::preset()
    }

    /// Any [Standard Webhooks](https://www.standardwebhooks.com/) sender.
    pub fn standard_webhooks() -> Self {
        standard_webhooks::preset()
    }

    /// Client APIs with the `Idempotency-Key` header (IETF draft).
    pub fn idempotency_key() -> Self {
        idempotency_key::preset()
    }

    /// Client APIs with one-time tokens in `Idempotency-Token`, issued by
    /// [`IssueToken`](crate::token::IssueToken).
    pub fn client_token() -> Self {
        client_token::preset()
    }

    /// The preset's name (the scope part of its keys and its metrics label).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How replies are written.
    pub fn reply(&self) -> &Reply {
        &self.reply
    }

    /// The key extractor.
    pub fn extractor(&self) -> &Arc<dyn ExtractKey> {
        &self.extractor
    }

    /// The default window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The default wait.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The default body limit.
    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// Whether this preset serves client APIs (keys scoped to the principal).
    pub fn is_client_api(&self) -> bool {
        self.client_api
    }

    /// Whether requests must consume a one-time client token.
    pub fn consumes_token(&self) -> bool {
        self.consume_token
    }

    pub(crate) fn describe(&self) -> &Arc<str> {
        &self.describe
    }
}

/// A fixed reply with a body.
fn fixed(status: u16, content_type: &'static str, body: &'static str) -> Option<FixedReply> {
    Some(FixedReply::new(
        StatusCode::from_u16(status).expect("valid status"),
        Some(HeaderValue::from_static(content_type)),
        Some(Bytes::from_static(body.as_bytes())),
    ))
}

/// A reply that sets the status and an empty body.
fn status_only(status: u16) -> Option<FixedReply> {
    Some(FixedReply::new(
        StatusCode::from_u16(status).expect("valid status"),
        None,
        Some(Bytes::new()),
    ))
}

/// A failure that sets the status and keeps the explanation in the body.
fn failure_status(status: u16) -> Option<FixedReply> {
    Some(FixedReply::new(
        StatusCode::from_u16(status).expect("valid status"),
        None,
        None,
    ))
}
