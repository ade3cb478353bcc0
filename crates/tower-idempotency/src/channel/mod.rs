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
//! re-timestamped. Channel defaults: wait 4 s, lease 30 s, body limit 64 KiB,
//! and a window (how long a success is replayed) longer than the channel
//! keeps retrying, by its published schedule:
//!
//! | preset | the channel retries for | default window |
//! |---|---|---|
//! | `wechatpay-v3`, `wechatpay-v2` | 24 h 4 min (15 times) | 25 h |
//! | `alipay` | about 25 h (8 times) | 26 h |
//! | `standard-webhooks` | about 28 h (Svix's schedule) | 30 h |
//! | `stripe` | up to 3 days | 4 days |
//! | `paypal` | 3 days (up to 25 times) | 4 days |
//! | `adyen` | up to 30 days (its retry queue) | 31 days |
//!
//! A retry after the window runs the handler again. On the memory store a
//! window costs memory for as long as it lasts: see
//! [`MemoryStore`](crate::store::MemoryStore) for the sizing. Client-key
//! defaults: window 24 h, body limit 1 MiB, keys scoped to a hash of
//! `Authorization`.
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
mod configured;
mod idempotency_key;
mod paypal;
mod standard_webhooks;
mod stripe;
mod wechatpay_v2;
mod wechatpay_v3;

pub use client_token::TOKEN_HEADER;
pub use configured::{PresetBuilder, PresetError, WithoutKey};

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
    /// Whether a request without its key gets the failure reply (else it
    /// is forwarded unguarded).
    key_required: bool,
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

/// The names of the built-in presets, in a fixed order
/// ([`Preset::builtin_names`]).
pub(crate) const PRESET_NAMES: &[&str] = &[
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

/// The window of a channel preset that does not set its own.
const CHANNEL_WINDOW: Duration = hours(25);
const CLIENT_WINDOW: Duration = Duration::from_secs(24 * 3600);
const CHANNEL_MAX_BODY: usize = 64 * 1024;
const CLIENT_MAX_BODY: usize = 1024 * 1024;
const DEFAULT_WAIT: Duration = Duration::from_secs(4);

/// `n` hours.
const fn hours(n: u64) -> Duration {
    Duration::from_secs(n * 3600)
}

impl Preset {
    /// A channel preset from a key spec and a reply format, with the channel
    /// defaults (window 25 h, wait 4 s, body limit 64 KiB). Set a window
    /// longer than the channel keeps retrying with
    /// [`with_window`](Self::with_window).
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
            key_required: true,
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
            key_required: true,
        }
    }

    /// The names of the built-in presets, each of which
    /// [`from_name`](Self::from_name) knows: `wechatpay-v3`, `wechatpay-v2`,
    /// `alipay`, `stripe`, `paypal`, `adyen`, `standard-webhooks`,
    /// `idempotency-key` and `client-token`, always in this order (so a
    /// program can keep something per built-in preset at its index, or list
    /// them in an error message).
    ///
    /// ```
    /// use tower_idempotency::Preset;
    ///
    /// for name in Preset::builtin_names() {
    ///     assert_eq!(Preset::from_name(name).unwrap().name(), *name);
    /// }
    /// assert_eq!(Preset::builtin_names()[0], "wechatpay-v3");
    /// assert!(Preset::from_name("custom").is_none());
    /// ```
    pub const fn builtin_names() -> &'static [&'static str] {
        PRESET_NAMES
    }

    /// A built-in preset by its name (one of
    /// [`builtin_names`](Self::builtin_names)).
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
    ///
    /// WeChat Pay retries a notification 15 times over 24 h 4 min (15 s, 15 s,
    /// 30 s, 3 min, 10 min, 20 min, 30 min, 30 min, 30 min, 60 min, 3 h, 3 h,
    /// 3 h, 6 h, 6 h:
    /// <https://pay.weixin.qq.com/wiki/doc/apiv3/apis/chapter3_1_5.shtml>): the
    /// window is 25 h.
    pub fn wechatpay_v3() -> Self {
        wechatpay_v3::preset()
    }

    /// WeChat Pay API v2 (XML) notifications.
    ///
    /// WeChat Pay retries a notification 15 times over 24 h 4 min
    /// (<https://pay.weixin.qq.com/wiki/doc/api/jsapi.php?chapter=9_7>): the
    /// window is 25 h.
    pub fn wechatpay_v2() -> Self {
        wechatpay_v2::preset()
    }

    /// Alipay asynchronous notifications (form-encoded).
    ///
    /// Alipay retries an asynchronous notification 8 times over about 25 h
    /// (4 min, 10 min, 10 min, 1 h, 2 h, 6 h, 15 h:
    /// <https://opendocs.alipay.com/open/270/105902>): the window is 26 h.
    pub fn alipay() -> Self {
        alipay::preset()
    }

    /// Stripe webhooks.
    ///
    /// Stripe retries an event for up to three days in live mode, with an
    /// exponential back-off (<https://docs.stripe.com/webhooks#retries>): the
    /// window is 4 days.
    pub fn stripe() -> Self {
        stripe::preset()
    }

    /// PayPal webhooks.
    ///
    /// PayPal retries a webhook up to 25 times over three days
    /// (<https://developer.paypal.com/api/rest/webhooks/>): the window is 4
    /// days.
    pub fn paypal() -> Self {
        paypal::preset()
    }

    /// Adyen standard (JSON) notifications.
    ///
    /// Adyen puts a webhook that was not accepted into its retry queue and
    /// retries it for up to 30 days
    /// (<https://docs.adyen.com/development-resources/webhooks/>): the window
    /// is 31 days.
    pub fn adyen() -> Self {
        adyen::preset()
    }

    /// Any [Standard Webhooks](https://www.standardwebhooks.com/) sender.
    ///
    /// Standard Webhooks leaves the schedule to the sender; Svix's (the
    /// reference implementation) retries after 5 s, 5 min, 30 min, 2 h, 5 h,
    /// 10 h and 10 h, about 28 h in all (<https://docs.svix.com/retries>): the
    /// window is 30 h.
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

    /// The default window: how long a success is replayed.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The same preset with the default window `window`: make it longer
    /// than the sender keeps retrying, or a late retry runs again.
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// The default wait.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The largest request body of this preset's routes, in bytes, unless
    /// a route sets its own.
    pub fn max_body_bytes(&self) -> usize {
        self.max_body
    }

    /// Whether this preset serves client APIs (keys scoped to the principal).
    pub fn is_client_api(&self) -> bool {
        self.client_api
    }

    /// Whether a request without its key is refused with the failure reply
    /// (`true`, every built-in preset) or forwarded unguarded (a configured
    /// preset with [`WithoutKey::Pass`]).
    pub fn key_required(&self) -> bool {
        self.key_required
    }

    /// Whether `name` is a built-in preset's name.
    pub fn is_builtin_name(name: &str) -> bool {
        PRESET_NAMES.contains(&name)
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
