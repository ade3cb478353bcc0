//! Signed notifications made for the one-parse tests: WeChat Pay v2 (MD5
//! with the documentation's key), Alipay (RSA2 with the test key of
//! `tests/fixtures/alipay_gbk_test_*`, in any charset), Adyen (HMAC with the
//! adyen-python test key), and the verifier and key extractor run on them.

use super::fixture;
use base64::Engine;
use bytes::Bytes;
use http::request::Parts;
use http::Request;
use md5::{Digest, Md5};
use ring::{hmac, rand, signature};
use std::time::SystemTime;
use tower_idempotency::key::Extracted;
use tower_idempotency::verify::{AdyenKeys, AlipayKeys, Verifier, VerifyError, WechatPayV2Keys};
use tower_idempotency::Preset;

pub const WECHAT_KEY: &str = "192006250b4c09247ec02edce69f6a2d";
pub const ADYEN_KEY: &str = "74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174";

pub fn parts(content_type: &str) -> Parts {
    Request::post("/notify")
        .header("content-type", content_type)
        .body(())
        .unwrap()
        .into_parts()
        .0
}

pub fn verify(v: &dyn Verifier, content_type: &str, body: &[u8]) -> Result<(), VerifyError> {
    v.verify(
        &mut parts(content_type),
        &Bytes::copy_from_slice(body),
        SystemTime::now(),
    )
    .map(|_| ())
}

pub fn extract(preset: &Preset, content_type: &str, body: &[u8]) -> Option<Extracted> {
    preset
        .extractor()
        .extract(&parts(content_type), &Bytes::copy_from_slice(body))
        .ok()
        .flatten()
}

// ---- WeChat Pay v2 -------------------------------------------------------

pub fn wechat() -> WechatPayV2Keys {
    WechatPayV2Keys::new().api_key(WECHAT_KEY).unwrap()
}

/// The MD5 `sign` of `fields` as WeChat Pay computes it: non-empty fields but
/// `sign`, sorted, `k=v&…&key=KEY`, upper-case hex.
pub fn wechat_sign(fields: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = fields
        .iter()
        .filter(|(k, v)| k != "sign" && !v.is_empty())
        .collect();
    sorted.sort();
    let mut s = String::new();
    for (k, v) in sorted {
        s.push_str(&format!("{k}={v}&"));
    }
    s.push_str(&format!("key={WECHAT_KEY}"));
    hex::encode_upper(Md5::digest(s.as_bytes()))
}

pub fn xml(fields: &[(String, String)]) -> String {
    let mut out = String::from("<xml>");
    for (k, v) in fields {
        out.push_str(&format!("<{k}><![CDATA[{v}]]></{k}>"));
    }
    out.push_str("</xml>");
    out
}

// ---- Alipay --------------------------------------------------------------

pub fn alipay_key() -> signature::RsaKeyPair {
    signature::RsaKeyPair::from_pkcs8(&fixture("alipay_gbk_test_app_key.pk8")).unwrap()
}

pub fn alipay() -> AlipayKeys {
    AlipayKeys::new()
        .public_key(fixture("alipay_gbk_test_public_key.pem"))
        .unwrap()
}

/// Percent-encodes every byte but the unreserved ones.
pub fn pct(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Signs `fields` (name, value text) as Alipay does: every field but `sign`
/// and `sign_type`, empty ones included, sorted, `k=v&…`, in the bytes of
/// `charset`; returns the form body (names percent-encoded, values
/// percent-encoded in `charset`) with `sign` and `sign_type=RSA2`.
pub fn alipay_body(fields: &[(&str, &str)], charset: &'static encoding_rs::Encoding) -> String {
    let enc = |s: &str| charset.encode(s).0.into_owned();
    let mut sorted: Vec<&(&str, &str)> = fields.iter().collect();
    sorted.sort();
    let mut content = Vec::new();
    for (i, (k, v)) in sorted.iter().enumerate() {
        if i > 0 {
            content.push(b'&');
        }
        content.extend_from_slice(k.as_bytes());
        content.push(b'=');
        content.extend_from_slice(&enc(v));
    }
    let key = alipay_key();
    let mut sig = vec![0; key.public().modulus_len()];
    key.sign(
        &signature::RSA_PKCS1_SHA256,
        &rand::SystemRandom::new(),
        &content,
        &mut sig,
    )
    .unwrap();
    let mut body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}={}", pct(k.as_bytes()), pct(&enc(v))))
        .collect();
    body.push(format!(
        "sign={}",
        pct(base64::engine::general_purpose::STANDARD
            .encode(sig)
            .as_bytes())
    ));
    body.push("sign_type=RSA2".into());
    body.join("&")
}

pub const FORM: &str = "application/x-www-form-urlencoded";

pub fn trade(charset: &'static str, subject: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("app_id", "2019073166072302"),
        ("charset", charset),
        ("notify_id", "2019081500222155624068450559358070"),
        ("notify_type", "trade_status_sync"),
        ("out_trade_no", "20190815155618536-564-57"),
        ("subject", subject),
        ("total_amount", "0.10"),
        ("trade_no", "2019081522001468450512505578"),
        ("trade_status", "TRADE_SUCCESS"),
    ]
}

// ---- Adyen ---------------------------------------------------------------

pub fn adyen() -> AdyenKeys {
    AdyenKeys::new().hmac_key(ADYEN_KEY).unwrap()
}

/// An Adyen item with `psp` and `value`, signed with the test key.
pub fn adyen_item(psp: &str, value: i64, event: &str) -> String {
    let signed = format!("{psp}::TestMerchant:ref-{psp}:{value}:EUR:{event}:true");
    let key = hmac::Key::new(hmac::HMAC_SHA256, &hex::decode(ADYEN_KEY).unwrap());
    let sig = base64::engine::general_purpose::STANDARD.encode(hmac::sign(&key, signed.as_bytes()));
    format!(
        r#"{{"NotificationRequestItem":{{"additionalData":{{"hmacSignature":"{sig}"}},"amount":{{"currency":"EUR","value":{value}}},"eventCode":"{event}","merchantAccountCode":"TestMerchant","merchantReference":"ref-{psp}","pspReference":"{psp}","success":"true"}}}}"#
    )
}

/// The serial of a test WeChat Pay v3 route whose platform key is the
/// public half of [`alipay_key`] (`alipay_gbk_test_public_key.pem`).
pub const WECHAT_V3_SERIAL: &str = "PUB_KEY_ID_0114232134912410000000000000";
/// The APIv3 key of that route.
pub const WECHAT_V3_KEY: &str = "0123456789abcdef0123456789abcdef";

/// A WeChat Pay v3 notification `event` of a transaction: `resource` (its
/// plaintext JSON) encrypted with AES-256-GCM under [`WECHAT_V3_KEY`], the
/// body signed by [`alipay_key`] (RSA-SHA256 over
/// `timestamp\nnonce\nbody\n`) now. The headers and the body.
pub fn wechat_v3(event: &str, resource: &str) -> (Vec<(String, String)>, String) {
    use ring::aead;
    let b64 = base64::engine::general_purpose::STANDARD;
    let nonce = "fdasflkja484";
    let key = aead::LessSafeKey::new(
        aead::UnboundKey::new(&aead::AES_256_GCM, WECHAT_V3_KEY.as_bytes()).unwrap(),
    );
    let mut sealed = resource.as_bytes().to_vec();
    let n = aead::Nonce::try_assume_unique_for_key(nonce.as_bytes()).unwrap();
    key.seal_in_place_append_tag(n, aead::Aad::from(b"transaction"), &mut sealed)
        .unwrap();
    let body = format!(
        r#"{{"id":"{event}","create_time":"2015-05-20T13:29:35+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{{"original_type":"transaction","algorithm":"AEAD_AES_256_GCM","ciphertext":"{}","associated_data":"transaction","nonce":"{nonce}"}}}}"#,
        b64.encode(&sealed)
    );
    let timestamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .to_string();
    let header_nonce = "5K8264ILTKCH16CQ2502SI8ZNMTM67VS";
    let message = format!("{timestamp}\n{header_nonce}\n{body}\n");
    let signer = alipay_key();
    let mut sig = vec![0; signer.public().modulus_len()];
    signer
        .sign(
            &signature::RSA_PKCS1_SHA256,
            &rand::SystemRandom::new(),
            message.as_bytes(),
            &mut sig,
        )
        .unwrap();
    let headers = vec![
        ("content-type".to_owned(), "application/json".to_owned()),
        ("wechatpay-serial".to_owned(), WECHAT_V3_SERIAL.to_owned()),
        ("wechatpay-timestamp".to_owned(), timestamp),
        ("wechatpay-nonce".to_owned(), header_nonce.to_owned()),
        ("wechatpay-signature".to_owned(), b64.encode(&sig)),
    ];
    (headers, body)
}
