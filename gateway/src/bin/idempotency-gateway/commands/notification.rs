//! The notification `send` builds for a preset: a body shaped as the
//! channel sends it (a paid order or a succeeded payment, with a fresh id),
//! sealed as the channel seals it (WeChat Pay v3's encrypted `resource`,
//! WeChat Pay v2's and Alipay's `sign`, Adyen's `hmacSignature`), and each
//! copy's signature headers, fresh per copy as a channel's retries are.

use crate::commands::signing::{base64, hex, hmac, random_hex, RsaSigner};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM};
use ring::hmac as ring_hmac;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use tower_idempotency::verify::{HmacAlgorithm, SecretEncoding, SignatureEncoding, SignedTemplate};

/// A preset `send` can build a notification for.
pub(crate) enum Channel {
    WechatPayV3,
    WechatPayV2,
    Alipay,
    Stripe,
    PayPal,
    Adyen,
    StandardWebhooks,
    IdempotencyKey,
    ClientToken,
    /// A `[[preset]]` of the config file.
    Configured(Box<ConfiguredPreset>),
}

/// What the channel signs with, read from `--secret` (and beside it).
#[derive(Default)]
pub(crate) struct Keys {
    /// An HMAC channel's secret (text, as the `verify` table reads it).
    pub(crate) secret: Option<String>,
    /// An RSA channel's private key.
    pub(crate) rsa: Option<RsaSigner>,
    /// WeChat Pay v3's APIv3 key, which encrypts `resource`.
    pub(crate) api_v3_key: Option<Vec<u8>>,
    /// PayPal's webhook id, which its signature covers.
    pub(crate) webhook_id: Option<String>,
}

/// A `[[preset]]` table: the parts `send` needs (its key sources and its
/// signature); the other keys are the gateway's.
#[derive(Debug, Deserialize)]
pub(crate) struct ConfiguredPreset {
    pub(crate) name: String,
    key: Sources,
    signature: Option<ConfiguredSignature>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Sources {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct ConfiguredSignature {
    scheme: String,
    header: String,
    prefix: Option<String>,
    encoding: Option<String>,
    signed: Option<String>,
    timestamp_header: Option<String>,
    signature_field: Option<String>,
    timestamp_field: Option<String>,
    secret_encoding: Option<String>,
}

impl Channel {
    /// A built-in preset by name.
    pub(crate) fn builtin(name: &str) -> Option<Self> {
        Some(match name {
            "wechatpay-v3" => Self::WechatPayV3,
            "wechatpay-v2" => Self::WechatPayV2,
            "alipay" => Self::Alipay,
            "stripe" => Self::Stripe,
            "paypal" => Self::PayPal,
            "adyen" => Self::Adyen,
            "standard-webhooks" => Self::StandardWebhooks,
            "idempotency-key" => Self::IdempotencyKey,
            "client-token" => Self::ClientToken,
            _ => return None,
        })
    }

    /// Whether `--secret` names an RSA private key (else a secret).
    pub(crate) fn signs_with_rsa(&self) -> bool {
        matches!(self, Self::WechatPayV3 | Self::Alipay | Self::PayPal)
    }

    /// Whether the channel signs at all (`--secret` is needed).
    pub(crate) fn signs(&self) -> bool {
        match self {
            Self::IdempotencyKey | Self::ClientToken => false,
            Self::Configured(c) => c.signature.is_some(),
            _ => true,
        }
    }
}

/// A notification, sealed; each copy gets [`sign_copy`]'s headers.
pub(crate) struct Notification {
    pub(crate) content_type: &'static str,
    pub(crate) body: Vec<u8>,
    /// Headers every copy carries (a key in a header).
    pub(crate) headers: Vec<(String, String)>,
    /// A query parameter every copy carries (a key in the query).
    pub(crate) query: Option<(String, String)>,
}

/// A `--field`: `NAME=TEXT` sets a text, `NAME:=JSON` a JSON value (a
/// number, an object); a JSON `NAME` may be a pointer (`/amount/total`).
#[derive(Debug, Clone)]
pub(crate) struct FieldArg {
    name: String,
    value: Value,
}

impl FieldArg {
    /// Its name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Its value as text (a JSON value as JSON).
    pub(crate) fn text(self) -> String {
        match self.value {
            Value::String(s) => s,
            other => other.to_string(),
        }
    }
}

/// Parses a `--field`.
pub(crate) fn field(s: &str) -> Result<FieldArg, String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected NAME=VALUE (or NAME:=JSON)"))?;
    let (name, value) = match name.strip_suffix(':') {
        Some(name) => (
            name,
            serde_json::from_str(value).map_err(|e| format!("`{s}`: not JSON after `:=`: {e}"))?,
        ),
        None => (name, Value::String(value.to_owned())),
    };
    if name.is_empty() {
        return Err(format!("`{s}`: the field has no name"));
    }
    Ok(FieldArg {
        name: name.to_owned(),
        value,
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn rfc3339_now() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// The id of a new notification in the channel's own form.
pub(crate) fn new_id(channel: &Channel) -> String {
    let digits = || {
        random_hex(12)
            .bytes()
            .map(|b| char::from(b'0' + b % 10))
            .collect::<String>()
    };
    match channel {
        Channel::WechatPayV3 => format!("EV-{}", digits()),
        Channel::WechatPayV2 => format!("42000{}", digits()),
        Channel::Alipay => format!("2026{}", digits()),
        Channel::Stripe => format!("evt_test_{}", random_hex(12)),
        Channel::PayPal => format!("WH-TEST-{}", random_hex(10).to_uppercase()),
        Channel::Adyen => random_hex(8).to_uppercase(),
        Channel::StandardWebhooks => format!("msg_{}", random_hex(12)),
        Channel::IdempotencyKey | Channel::ClientToken | Channel::Configured(_) => {
            format!("test-{}", random_hex(12))
        }
    }
}

/// Sets `name` (a member, or a JSON pointer) of `v` to `value`, creating
/// the objects on the way.
fn set_json(v: &mut Value, name: &str, value: Value) -> Result<(), String> {
    let path: Vec<String> = match name.strip_prefix('/') {
        Some(p) => p
            .split('/')
            .map(|s| s.replace("~1", "/").replace("~0", "~"))
            .collect(),
        None => vec![name.to_owned()],
    };
    let mut at = v;
    for (i, part) in path.iter().enumerate() {
        let Value::Object(map) = at else {
            return Err(format!("--field {name}: `{part}` is not inside an object"));
        };
        if i + 1 == path.len() {
            map.insert(part.clone(), value);
            return Ok(());
        }
        at = map.entry(part.clone()).or_insert_with(|| json!({}));
    }
    Ok(())
}

/// Sets `name` of a form or XML body's fields to `value` (text).
fn set_pair(pairs: &mut Vec<(String, String)>, name: &str, value: &Value) {
    let text = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    match pairs.iter_mut().find(|(k, _)| k == name) {
        Some(pair) => pair.1 = text,
        None => pairs.push((name.to_owned(), text)),
    }
}

fn json_with(mut v: Value, fields: &[FieldArg]) -> Result<Vec<u8>, String> {
    for f in fields {
        set_json(&mut v, &f.name, f.value.clone())?;
    }
    Ok(v.to_string().into_bytes())
}

/// Builds and seals the notification with key `id`.
pub(crate) fn build(
    channel: &Channel,
    id: &str,
    fields: &[FieldArg],
    keys: &Keys,
) -> Result<Notification, String> {
    let order = format!("ORDER-{}", &random_hex(6));
    let plain = |content_type, body| Notification {
        content_type,
        body,
        headers: Vec::new(),
        query: None,
    };
    Ok(match channel {
        Channel::WechatPayV3 => {
            let transaction = json!({
                "mchid": "1230000109", "appid": "wxd678efh567hg6787", "out_trade_no": order,
                "transaction_id": format!("42000{}", &id.trim_start_matches("EV-")),
                "trade_type": "JSAPI", "trade_state": "SUCCESS", "trade_state_desc": "支付成功",
                "bank_type": "CMC", "attach": "", "success_time": rfc3339_now(),
                "payer": { "openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o" },
                "amount": { "total": 100, "payer_total": 100, "currency": "CNY", "payer_currency": "CNY" }
            });
            let nonce = random_hex(6);
            let ciphertext = match &keys.api_v3_key {
                Some(key) => encrypt(key, &nonce, transaction.to_string().as_bytes())?,
                // Without the APIv3 key `resource` cannot be encrypted: a
                // route that decrypts refuses it.
                None => base64(transaction.to_string().as_bytes()),
            };
            let v = json!({
                "id": id, "create_time": rfc3339_now(), "resource_type": "encrypt-resource",
                "event_type": "TRANSACTION.SUCCESS", "summary": "支付成功",
                "resource": {
                    "original_type": "transaction", "algorithm": "AEAD_AES_256_GCM",
                    "ciphertext": ciphertext, "associated_data": "transaction", "nonce": nonce
                }
            });
            plain("application/json", json_with(v, fields)?)
        }
        Channel::WechatPayV2 => {
            let mut pairs: Vec<(String, String)> = [
                ("appid", "wx2421b1c4370ec43b"),
                ("bank_type", "CMC"),
                ("cash_fee", "100"),
                ("fee_type", "CNY"),
                ("is_subscribe", "N"),
                ("mch_id", "10000100"),
                ("openid", "oUpF8uMEb4qRXf22hE3X68TekukE"),
                ("result_code", "SUCCESS"),
                ("return_code", "SUCCESS"),
                ("sign_type", "HMAC-SHA256"),
                ("time_end", "20261207190000"),
                ("total_fee", "100"),
                ("trade_type", "JSAPI"),
            ]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            pairs.push(("nonce_str".into(), random_hex(16)));
            pairs.push(("out_trade_no".into(), order));
            pairs.push(("transaction_id".into(), id.to_owned()));
            for f in fields {
                set_pair(&mut pairs, &f.name, &f.value);
            }
            let key = need_secret(keys)?;
            let mut signed: Vec<&(String, String)> = pairs
                .iter()
                .filter(|(k, v)| k != "sign" && !v.is_empty())
                .collect();
            signed.sort();
            let mut content = String::new();
            for (k, v) in signed {
                content += &format!("{k}={v}&");
            }
            content += &format!("key={key}");
            let sign = hex(&hmac(
                ring_hmac::HMAC_SHA256,
                key.as_bytes(),
                content.as_bytes(),
            ));
            pairs.push(("sign".into(), sign.to_uppercase()));
            let mut xml = String::from("<xml>");
            for (k, v) in &pairs {
                xml += &format!("<{k}><![CDATA[{v}]]></{k}>");
            }
            xml += "</xml>";
            plain("text/xml", xml.into_bytes())
        }
        Channel::Alipay => {
            let mut pairs: Vec<(String, String)> = [
                ("app_id", "2021000000000000"),
                ("auth_app_id", "2021000000000000"),
                ("buyer_id", "2088102177846880"),
                ("buyer_pay_amount", "0.10"),
                ("charset", "utf-8"),
                ("invoice_amount", "0.10"),
                ("notify_type", "trade_status_sync"),
                ("receipt_amount", "0.10"),
                ("seller_id", "2088101117955611"),
                ("subject", "测试订单"),
                ("total_amount", "0.10"),
                ("trade_status", "TRADE_SUCCESS"),
                ("version", "1.0"),
            ]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            let now = humantime::format_rfc3339_seconds(SystemTime::now())
                .to_string()
                .replace('T', " ")
                .replace('Z', "");
            pairs.push(("gmt_create".into(), now.clone()));
            pairs.push(("gmt_payment".into(), now.clone()));
            pairs.push(("notify_time".into(), now));
            pairs.push(("notify_id".into(), id.to_owned()));
            pairs.push(("out_trade_no".into(), order));
            pairs.push(("trade_no".into(), format!("2026{}", random_hex(10))));
            for f in fields {
                set_pair(&mut pairs, &f.name, &f.value);
            }
            let mut signed: Vec<&(String, String)> = pairs
                .iter()
                .filter(|(k, _)| k != "sign" && k != "sign_type")
                .collect();
            signed.sort();
            let content: Vec<String> = signed.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let sign = need_rsa(keys)?.sign_base64(content.join("&").as_bytes())?;
            pairs.push(("sign".into(), sign));
            pairs.push(("sign_type".into(), "RSA2".into()));
            let mut form = form_urlencoded::Serializer::new(String::new());
            for (k, v) in &pairs {
                form.append_pair(k, v);
            }
            plain(
                "application/x-www-form-urlencoded; charset=utf-8",
                form.finish().into_bytes(),
            )
        }
        Channel::Stripe => {
            let v = json!({
                "id": id, "object": "event", "api_version": "2024-06-20", "created": now_secs(),
                "data": { "object": {
                    "id": format!("pi_test_{}", random_hex(8)), "object": "payment_intent",
                    "amount": 2000, "currency": "usd", "status": "succeeded",
                    "metadata": { "order_id": order }
                }},
                "livemode": false, "pending_webhooks": 1,
                "request": { "id": null, "idempotency_key": null },
                "type": "payment_intent.succeeded"
            });
            plain("application/json", json_with(v, fields)?)
        }
        Channel::PayPal => {
            let v = json!({
                "id": id, "event_version": "1.0", "create_time": rfc3339_now(),
                "resource_type": "capture", "event_type": "PAYMENT.CAPTURE.COMPLETED",
                "summary": "Payment completed for $ 10.00 USD",
                "resource": {
                    "id": random_hex(8).to_uppercase(), "status": "COMPLETED",
                    "amount": { "currency_code": "USD", "value": "10.00" },
                    "invoice_id": order, "final_capture": true
                }
            });
            plain("application/json", json_with(v, fields)?)
        }
        Channel::Adyen => {
            let mut item = json!({
                "additionalData": {}, "amount": { "currency": "EUR", "value": 1000 },
                "eventCode": "AUTHORISATION", "eventDate": rfc3339_now(),
                "merchantAccountCode": "TestMerchant", "merchantReference": order,
                "paymentMethod": "visa", "pspReference": id, "reason": "test", "success": "true"
            });
            for f in fields {
                set_json(&mut item, &f.name, f.value.clone())?;
            }
            let text = |p: &str| match item.pointer(p) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            let signing = [
                "/pspReference",
                "/originalReference",
                "/merchantAccountCode",
                "/merchantReference",
                "/amount/value",
                "/amount/currency",
                "/eventCode",
                "/success",
            ]
            .map(text)
            .join(":");
            let key = hex_key(&need_secret(keys)?)?;
            let sig = base64(&hmac(ring_hmac::HMAC_SHA256, &key, signing.as_bytes()));
            item["additionalData"]["hmacSignature"] = Value::String(sig);
            let v = json!({ "live": "false", "notificationItems": [{ "NotificationRequestItem": item }] });
            plain("application/json", v.to_string().into_bytes())
        }
        Channel::StandardWebhooks => {
            let v = json!({
                "type": "invoice.paid", "timestamp": rfc3339_now(),
                "data": { "invoice_id": order, "amount": 1000, "currency": "USD" }
            });
            let mut n = plain("application/json", json_with(v, fields)?);
            n.headers.push(("webhook-id".into(), id.to_owned()));
            n
        }
        Channel::IdempotencyKey | Channel::ClientToken => {
            let v = json!({ "order_id": order, "amount": 1000, "currency": "CNY" });
            let mut n = plain("application/json", json_with(v, fields)?);
            if matches!(channel, Channel::IdempotencyKey) {
                n.headers.push(("idempotency-key".into(), id.to_owned()));
            }
            n
        }
        Channel::Configured(c) => configured(c, id, &order, fields)?,
    })
}

/// A configured preset's notification: a JSON event (or a form or XML body
/// when the key is read from one) with `id` wherever the key is read.
fn configured(
    c: &ConfiguredPreset,
    id: &str,
    order: &str,
    fields: &[FieldArg],
) -> Result<Notification, String> {
    let sources: Vec<&str> = match &c.key {
        Sources::One(s) => vec![s.as_str()],
        Sources::Many(m) => m.iter().map(String::as_str).collect(),
    };
    let kind = |k: &str| sources.iter().any(|s| s.starts_with(k));
    let mut headers = Vec::new();
    let mut query = None;
    let mut pairs = vec![
        ("event".to_owned(), "test.event".to_owned()),
        ("order_id".to_owned(), order.to_owned()),
    ];
    let mut v = json!({ "id": id, "type": "test.event", "created": now_secs(), "data": { "order_id": order } });
    for s in &sources {
        let (k, rest) = s.split_once(':').unwrap_or((s, ""));
        match k {
            "json" => set_json(&mut v, rest, Value::String(id.to_owned()))?,
            "form" | "xml" => set_pair(&mut pairs, rest, &Value::String(id.to_owned())),
            "header" => headers.push((rest.to_ascii_lowercase(), id.to_owned())),
            "query" => query = Some((rest.to_owned(), id.to_owned())),
            _ => {
                return Err(format!(
                    "preset `{}`: key source `{s}` is not one `send` knows",
                    c.name
                ))
            }
        }
    }
    let (content_type, body) = if kind("form:") {
        for f in fields {
            set_pair(&mut pairs, &f.name, &f.value);
        }
        let mut form = form_urlencoded::Serializer::new(String::new());
        for (k, v) in &pairs {
            form.append_pair(k, v);
        }
        (
            "application/x-www-form-urlencoded",
            form.finish().into_bytes(),
        )
    } else if kind("xml:") {
        for f in fields {
            set_pair(&mut pairs, &f.name, &f.value);
        }
        let mut xml = String::from("<xml>");
        for (k, v) in &pairs {
            xml += &format!("<{k}>{v}</{k}>");
        }
        ("application/xml", (xml + "</xml>").into_bytes())
    } else {
        ("application/json", json_with(v, fields)?)
    };
    Ok(Notification {
        content_type,
        body,
        headers,
        query,
    })
}

/// The headers of one copy: the channel's signature over `n`, with a fresh
/// timestamp (and nonce, and transmission id) as the channel's retries have.
pub(crate) fn sign_copy(
    channel: &Channel,
    n: &Notification,
    keys: &Keys,
    url: &str,
) -> Result<Vec<(String, String)>, String> {
    let ts = now_secs().to_string();
    let body = &n.body;
    let joined = |parts: &[&[u8]], sep: u8, trailing: bool| {
        let mut m = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                m.push(sep);
            }
            m.extend_from_slice(p);
        }
        if trailing {
            m.push(sep);
        }
        m
    };
    Ok(match channel {
        Channel::WechatPayV3 => {
            let key = need_rsa(keys)?;
            let nonce = random_hex(16).to_uppercase();
            let message = joined(&[ts.as_bytes(), nonce.as_bytes(), body], b'\n', true);
            vec![
                ("wechatpay-serial".into(), key.serial()),
                ("wechatpay-timestamp".into(), ts),
                ("wechatpay-nonce".into(), nonce),
                ("wechatpay-signature".into(), key.sign_base64(&message)?),
                (
                    "wechatpay-signature-type".into(),
                    "WECHATPAY2-SHA256-RSA2048".into(),
                ),
            ]
        }
        Channel::Stripe => {
            let secret = need_secret(keys)?;
            let message = joined(&[ts.as_bytes(), body], b'.', false);
            let sig = hex(&hmac(ring_hmac::HMAC_SHA256, secret.as_bytes(), &message));
            vec![("stripe-signature".into(), format!("t={ts},v1={sig}"))]
        }
        Channel::PayPal => {
            let key = need_rsa(keys)?;
            let webhook_id = keys.webhook_id.as_deref().ok_or(
                "paypal: no webhook id (the file paypal-webhook-id beside --secret, as test-keys writes it)",
            )?;
            let id = random_hex(16);
            let time = rfc3339_now();
            let message = format!("{id}|{time}|{webhook_id}|{}", crc32fast::hash(body));
            vec![
                ("paypal-transmission-id".into(), id),
                ("paypal-transmission-time".into(), time),
                (
                    "paypal-transmission-sig".into(),
                    key.sign_base64(message.as_bytes())?,
                ),
                ("paypal-auth-algo".into(), "SHA256withRSA".into()),
                (
                    "paypal-cert-url".into(),
                    "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-TEST".into(),
                ),
            ]
        }
        Channel::StandardWebhooks => {
            let secret = need_secret(keys)?;
            let raw = secret.strip_prefix("whsec_").unwrap_or(&secret);
            let key = base64_key(raw)?;
            let id = n
                .headers
                .iter()
                .find(|(k, _)| k == "webhook-id")
                .map_or("", |(_, v)| v.as_str());
            let message = joined(&[id.as_bytes(), ts.as_bytes(), body], b'.', false);
            let sig = base64(&hmac(ring_hmac::HMAC_SHA256, &key, &message));
            vec![
                ("webhook-timestamp".into(), ts),
                ("webhook-signature".into(), format!("v1,{sig}")),
            ]
        }
        Channel::Configured(c) => match &c.signature {
            Some(s) => configured_signature(&c.name, s, n, keys, url, &ts)?,
            None => Vec::new(),
        },
        // Signed in the body, or not signed.
        Channel::WechatPayV2
        | Channel::Alipay
        | Channel::Adyen
        | Channel::IdempotencyKey
        | Channel::ClientToken => Vec::new(),
    })
}

fn configured_signature(
    preset: &str,
    s: &ConfiguredSignature,
    n: &Notification,
    keys: &Keys,
    url: &str,
    ts: &str,
) -> Result<Vec<(String, String)>, String> {
    let bad = |what: &str| format!("preset `{preset}`: `signature.{what}` is not one `send` knows");
    let algorithm = match HmacAlgorithm::from_name(&s.scheme).ok_or_else(|| bad("scheme"))? {
        HmacAlgorithm::Sha1 => ring_hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY,
        HmacAlgorithm::Sha512 => ring_hmac::HMAC_SHA512,
        _ => ring_hmac::HMAC_SHA256,
    };
    let encoding = match &s.encoding {
        Some(e) => SignatureEncoding::from_name(e).ok_or_else(|| bad("encoding"))?,
        None => SignatureEncoding::Hex,
    };
    let secret = need_secret(keys)?;
    let key = match &s.secret_encoding {
        Some(e)
            if matches!(
                SecretEncoding::from_name(e).ok_or_else(|| bad("secret_encoding"))?,
                SecretEncoding::Base64
            ) =>
        {
            base64_key(secret.strip_prefix("whsec_").unwrap_or(&secret))?
        }
        _ => secret.into_bytes(),
    };
    let template = s.signed.as_deref().unwrap_or("{body}");
    // The library's own parser says whether the template is one it reads.
    template
        .parse::<SignedTemplate>()
        .map_err(|e| format!("preset `{preset}`: `signature.signed`: {e}"))?;
    let mut headers: Vec<(String, String)> = Vec::new();
    if let Some(h) = &s.timestamp_header {
        headers.push((h.to_ascii_lowercase(), ts.to_owned()));
    }
    let header_value = |name: &str| {
        let name = name.to_ascii_lowercase();
        n.headers
            .iter()
            .chain(&headers)
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| format!("preset `{preset}`: `{{header:{name}}}` is signed but `send` sends no such header"))
    };
    let mut message = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        message.extend_from_slice(&rest.as_bytes()[..open]);
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c);
        match &rest[open + 1..close] {
            "body" => message.extend_from_slice(&n.body),
            "timestamp" => message.extend_from_slice(ts.as_bytes()),
            "url" => message.extend_from_slice(url.as_bytes()),
            other => {
                let name = other.strip_prefix("header:").unwrap_or(other);
                message.extend_from_slice(header_value(name)?.as_bytes());
            }
        }
        rest = &rest[(close + 1).min(rest.len())..];
    }
    message.extend_from_slice(rest.as_bytes());
    let mac = hmac(algorithm, &key, &message);
    let sig = match encoding {
        SignatureEncoding::Base64 => base64(&mac),
        _ => hex(&mac),
    };
    let prefix = s.prefix.as_deref().unwrap_or("");
    let value = match (&s.signature_field, &s.timestamp_field) {
        (Some(sf), Some(tf)) => format!("{tf}={ts},{sf}={prefix}{sig}"),
        (Some(sf), None) => format!("{sf}={prefix}{sig}"),
        _ => format!("{prefix}{sig}"),
    };
    headers.push((s.header.to_ascii_lowercase(), value));
    Ok(headers)
}

fn need_secret(keys: &Keys) -> Result<String, String> {
    keys.secret
        .clone()
        .ok_or_else(|| "this preset signs: give its secret with --secret FILE".to_owned())
}

fn need_rsa(keys: &Keys) -> Result<&RsaSigner, String> {
    keys.rsa.as_ref().ok_or_else(|| {
        "this preset signs with RSA: give the private key with --secret FILE \
         (`idempotency-gateway test-keys DIR` writes a test one)"
            .to_owned()
    })
}

fn base64_key(text: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|_| "the secret is not base64".to_owned())
}

/// An Adyen HMAC key: hex digits.
fn hex_key(text: &str) -> Result<Vec<u8>, String> {
    let text = text.trim();
    let digit = |b: u8| char::from(b).to_digit(16);
    if !text.len().is_multiple_of(2) {
        return Err("the Adyen HMAC key is not hex digits".into());
    }
    text.as_bytes()
        .chunks(2)
        .map(|p| match (digit(p[0]), digit(p[1])) {
            (Some(h), Some(l)) => Ok((h * 16 + l) as u8),
            _ => Err("the Adyen HMAC key is not hex digits".to_owned()),
        })
        .collect()
}

/// WeChat Pay v3's `resource`: AES-GCM under the APIv3 key, `transaction`
/// as associated data, base64 of the ciphertext and tag.
fn encrypt(key: &[u8], nonce: &str, plain: &[u8]) -> Result<String, String> {
    let algorithm = if key.len() == 16 {
        &AES_128_GCM
    } else {
        &AES_256_GCM
    };
    let key =
        UnboundKey::new(algorithm, key).map_err(|_| "the APIv3 key must be 32 bytes".to_owned())?;
    let nonce = Nonce::try_assume_unique_for_key(nonce.as_bytes())
        .map_err(|_| "the resource nonce must be 12 bytes".to_owned())?;
    let mut in_out = plain.to_vec();
    LessSafeKey::new(key)
        .seal_in_place_append_tag(nonce, Aad::from(b"transaction"), &mut in_out)
        .map_err(|_| "cannot encrypt the resource".to_owned())?;
    Ok(base64(&in_out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_preset_is_one_send_builds() {
        for name in tower_idempotency::Preset::builtin_names() {
            assert!(Channel::builtin(name).is_some(), "{name}");
        }
    }

    #[test]
    fn fields_set_text_json_and_pointers() {
        let f = |s: &str| field(s).unwrap();
        let mut v = json!({ "data": { "object": {} } });
        for arg in [
            "note=a b",
            "count:=3",
            "/data/object/amount:=5000",
            "/x/y=z",
        ] {
            let a = f(arg);
            set_json(&mut v, &a.name, a.value).unwrap();
        }
        assert_eq!(
            v,
            json!({ "note": "a b", "count": 3, "data": { "object": { "amount": 5000 } }, "x": { "y": "z" } })
        );
        assert!(field("novalue").is_err());
        assert!(field("=x").is_err());
        assert!(field("n:={").is_err());
    }
}
