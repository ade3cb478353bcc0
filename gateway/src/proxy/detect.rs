//! `auto` detection: which channel sent a request.

use http::HeaderMap;
use tower_idempotency::__private::parse_form;
use tower_idempotency::Preset;

/// The preset (its name in [`Preset::builtin_names`]) that `headers` and `body`
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
/// use idempotency_gateway::proxy::detect;
///
/// let none = HeaderMap::new();
/// assert_eq!(detect(&none, b"notify_id=1&trade_no=2"), Some("alipay"));
/// assert_eq!(detect(&none, b"<xml><transaction_id>4</transaction_id></xml>"), Some("wechatpay-v2"));
/// assert_eq!(detect(&none, b"hello"), None);
/// ```
pub fn detect(headers: &HeaderMap, body: &[u8]) -> Option<&'static str> {
    Preset::builtin_names()
        .iter()
        .copied()
        .find(|name| looks_like(name, headers, body))
}

/// Whether `headers` and `body` look like the preset `name` by the table
/// of [`detect`] (whatever comes before it in the table). The gateway asks
/// this of every preset that another route verifies, so that no request
/// looking like one of them is guarded unverified.
pub(crate) fn looks_like(name: &str, headers: &HeaderMap, body: &[u8]) -> bool {
    let trimmed = trim_start(body);
    match name {
        "wechatpay-v3" => headers.contains_key("wechatpay-signature"),
        "wechatpay-v2" => trimmed.first() == Some(&b'<') && contains(trimmed, b"<transaction_id>"),
        "alipay" => {
            !matches!(trimmed.first(), Some(b'<' | b'{' | b'['))
                && !parse_form(body, &["notify_id"]).is_empty()
        }
        "stripe" => headers.contains_key("stripe-signature"),
        "paypal" => headers.contains_key("paypal-transmission-id"),
        "adyen" => {
            trimmed.first() == Some(&b'{')
                && serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
                    .is_ok_and(|obj| obj.contains_key("notificationItems"))
        }
        "standard-webhooks" => headers.contains_key("webhook-id"),
        "idempotency-key" => headers.contains_key("idempotency-key"),
        _ => false,
    }
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
