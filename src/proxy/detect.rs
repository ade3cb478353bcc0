//! `auto` detection: which channel sent a request.

use crate::channel::PRESET_NAMES;
use crate::key::parse_form;
use http::HeaderMap;

/// The preset (its name in [`PRESET_NAMES`]) that `headers` and `body`
/// look like, checked in this order; `None` for anything else.
///
/// | the request has | preset |
/// |---|---|
/// | header `Wechatpay-Signature` | `wechatpay-v3` |
/// | an XML body with `<transaction_id>` | `wechatpay-v2` |
/// | a form body with a `notify_id` field | `alipay` |
/// | header `Stripe-Signature` | `stripe` |
/// | header `PAYPAL-TRANSMISSION-ID` | `paypal` |
/// | a JSON object body with `notificationItems` | `adyen` |
/// | header `webhook-id` | `standard-webhooks` |
/// | header `Idempotency-Key` | `idempotency-key` |
///
/// ```
/// use http::HeaderMap;
/// use tower_idempotency::proxy::detect;
///
/// let none = HeaderMap::new();
/// assert_eq!(detect(&none, b"notify_id=1&trade_no=2"), Some("alipay"));
/// assert_eq!(detect(&none, b"<xml><transaction_id>4</transaction_id></xml>"), Some("wechatpay-v2"));
/// assert_eq!(detect(&none, b"hello"), None);
/// ```
pub fn detect(headers: &HeaderMap, body: &[u8]) -> Option<&'static str> {
    let name = |name: &str| PRESET_NAMES.iter().copied().find(|n| *n == name);
    let trimmed = trim_start(body);
    if headers.contains_key("wechatpay-signature") {
        return name("wechatpay-v3");
    }
    if trimmed.first() == Some(&b'<') && contains(trimmed, b"<transaction_id>") {
        return name("wechatpay-v2");
    }
    if !matches!(trimmed.first(), Some(b'<' | b'{' | b'['))
        && !parse_form(body, &["notify_id"]).is_empty()
    {
        return name("alipay");
    }
    if headers.contains_key("stripe-signature") {
        return name("stripe");
    }
    if headers.contains_key("paypal-transmission-id") {
        return name("paypal");
    }
    if trimmed.first() == Some(&b'{')
        && serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
            .is_ok_and(|obj| obj.contains_key("notificationItems"))
    {
        return name("adyen");
    }
    if headers.contains_key("webhook-id") {
        return name("standard-webhooks");
    }
    if headers.contains_key("idempotency-key") {
        return name("idempotency-key");
    }
    None
}

/// `body` without a BOM and leading whitespace.
fn trim_start(body: &[u8]) -> &[u8] {
    let body = body.strip_prefix("\u{feff}".as_bytes()).unwrap_or(body);
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(body.len());
    &body[start..]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
