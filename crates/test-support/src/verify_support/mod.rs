//! The verification vectors of `tests/fixtures/`, as cases with their keys.

pub mod signed;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::verify::{
    AdyenKeys, AlipayKeys, PayPalKeys, StandardWebhooksKeys, StripeKeys, Verified, VerifyBody,
    VerifyLayer, WechatPayV2Keys, WechatPayV3Keys,
};
use tower_idempotency::Outcome;

pub fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(crate::common::vectors::fixtures_dir().join(name)).unwrap()
}

pub fn meta(name: &str) -> Value {
    serde_json::from_slice(&fixture(name)).unwrap()
}

pub fn at(unix: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix)
}

/// One verifiable vector.
pub struct Case {
    pub name: &'static str,
    pub keys: VerifyLayer,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// The vector's signing time, for the clock.
    pub now: u64,
    /// A substring of the body and a replacement that differs in one byte.
    pub tamper: (&'static str, &'static str),
    /// A header whose value is signed, with another value.
    pub header_tamper: Option<(&'static str, String)>,
    /// The shipped tolerance, for channels that sign a timestamp.
    pub tolerance: Option<u64>,
}

fn headers_of(meta: &Value) -> Vec<(String, String)> {
    meta["headers"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect()
}

pub fn wechatpay_v3_keys() -> WechatPayV3Keys {
    let m = meta("wechatpay_v3_notify_wechatpay-go.meta.json");
    WechatPayV3Keys::new()
        .platform_key(
            "D7CE59D1F522D701",
            fixture("wechatpay_v3_platform_cert.pem"),
        )
        .unwrap()
        .api_v3_key(m["apiv3_key"].as_str().unwrap())
        .unwrap()
}

pub fn wechatpay_v3() -> Case {
    let m = meta("wechatpay_v3_notify_wechatpay-go.meta.json");
    Case {
        name: "wechatpay-v3",
        keys: VerifyLayer::new(wechatpay_v3_keys()),
        body: fixture("wechatpay_v3_notify_wechatpay-go.json"),
        headers: headers_of(&m),
        now: m["now_unix"].as_u64().unwrap(),
        tamper: ("\"summary\":\"签约成功\"", "\"summary\":\"签约成函\""),
        header_tamper: Some(("Wechatpay-Nonce", "EcZ9Cmy4Xyx1i6RlJQzLcCyEqDa26NBZ".into())),
        tolerance: Some(300),
    }
}

fn wechatpay_v2(name: &'static str, file: &str) -> Case {
    let m = meta("wechatpay_v2_notify_SYNTHESIZED.meta.json");
    let keys = WechatPayV2Keys::new()
        .api_key(m["api_v2_key"].as_str().unwrap())
        .unwrap();
    Case {
        name,
        keys: VerifyLayer::new(keys),
        body: fixture(file),
        headers: vec![],
        now: 1_700_000_000,
        tamper: ("<total_fee>1</total_fee>", "<total_fee>2</total_fee>"),
        header_tamper: None,
        tolerance: None,
    }
}

fn alipay(name: &'static str, stem: &str, key: &str, tamper: (&'static str, &'static str)) -> Case {
    let keys = AlipayKeys::new().public_key(fixture(key)).unwrap();
    Case {
        name,
        keys: VerifyLayer::new(keys),
        body: fixture(&format!("{stem}.form")),
        headers: vec![(
            "content-type".into(),
            "application/x-www-form-urlencoded".into(),
        )],
        now: 1_700_000_000,
        tamper,
        header_tamper: None,
        tolerance: None,
    }
}

fn stripe() -> Case {
    let m = meta("stripe_webhook_SYNTHESIZED_stripe-go_testPayload.meta.json");
    let sig = m["headers"]["Stripe-Signature"].as_str().unwrap();
    Case {
        name: "stripe",
        keys: VerifyLayer::new(
            StripeKeys::new()
                .secret(m["secret"].as_str().unwrap())
                .unwrap(),
        ),
        body: fixture("stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json"),
        headers: headers_of(&m),
        now: m["now_unix"].as_u64().unwrap(),
        tamper: ("evt_test_webhook", "evt_test_webhooc"),
        header_tamper: Some((
            "Stripe-Signature",
            sig.replace("t=1700000000", "t=1700000001"),
        )),
        tolerance: Some(300),
    }
}

fn standard_webhooks(name: &'static str, n: &str, tamper: (&'static str, &'static str)) -> Case {
    let m = meta(&format!(
        "standard_webhooks_standard-webhooks_{n}_test.meta.json"
    ));
    let keys = StandardWebhooksKeys::new()
        .secret(m["secret"].as_str().unwrap())
        .unwrap();
    let id = m["headers"]["webhook-id"].as_str().unwrap();
    Case {
        name,
        keys: VerifyLayer::new(keys),
        body: fixture(&format!(
            "standard_webhooks_standard-webhooks_{n}_test.json"
        )),
        headers: headers_of(&m),
        now: m["now_unix_for_test"].as_u64().unwrap(),
        tamper,
        header_tamper: Some(("webhook-id", format!("{id}x"))),
        tolerance: Some(300),
    }
}

fn adyen(name: &'static str, item: &str, tamper: (&'static str, &'static str)) -> Case {
    let m = meta("adyen_notify_adyen-python_items.meta.json");
    let keys = AdyenKeys::new()
        .hmac_key(m["hmac_key_hex"].as_str().unwrap())
        .unwrap();
    Case {
        name,
        keys: VerifyLayer::new(keys),
        body: fixture(&format!("adyen_notify_adyen-python_{item}_ENVELOPED.json")),
        headers: vec![],
        now: 1_700_000_000,
        tamper,
        header_tamper: None,
        tolerance: None,
    }
}

fn adyen_platform() -> Case {
    let m = meta("adyen_platform_webhook_payload_hmac_adyen-python.meta.json");
    let keys = AdyenKeys::new()
        .hmac_key(m["hmac_key_hex"].as_str().unwrap())
        .unwrap();
    let sig = m["expected_hmac"].as_str().unwrap().to_owned();
    Case {
        name: "adyen platform webhook",
        keys: VerifyLayer::new(keys),
        body: fixture("adyen_platform_webhook_payload_hmac_adyen-python.json"),
        headers: vec![("HmacSignature".into(), sig.clone())],
        now: 1_700_000_000,
        tamper: ("merchant.created", "merchant.creates"),
        header_tamper: Some(("HmacSignature", format!("g{}", &sig[1..]))),
        tolerance: None,
    }
}

fn paypal() -> Case {
    let m = meta("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.meta.json");
    let keys = PayPalKeys::new(m["webhook_id"].as_str().unwrap())
        .certificate(fixture("paypal_cert_ValidateCertTest.pem"))
        .unwrap();
    Case {
        name: "paypal",
        keys: VerifyLayer::new(keys),
        body: fixture("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.json"),
        headers: headers_of(&m),
        // PAYPAL-TRANSMISSION-TIME of the vector, 2019-08-29T10:49:33Z: the
        // transmission is checked against the clock (default tolerance 5 min).
        now: 1_567_075_773,
        tamper: ("PAYMENTS.PAYMENT.CREATED", "PAYMENTS.PAYMENT.CREATEX"),
        header_tamper: Some((
            "PAYPAL-TRANSMISSION-ID",
            "afa30d40-ca4a-11e9-ab68-7d4e2605c70d".into(),
        )),
        tolerance: Some(300),
    }
}

/// Every verifiable vector of `tests/fixtures/`.
pub fn cases() -> Vec<Case> {
    vec![
        wechatpay_v3(),
        wechatpay_v2(
            "wechatpay-v2 md5",
            "wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml",
        ),
        wechatpay_v2(
            "wechatpay-v2 hmac-sha256",
            "wechatpay_v2_notify_SYNTHESIZED_hmacsha256_doc_key.xml",
        ),
        alipay(
            "alipay trade_status_sync (without sign_type)",
            "alipay_notify_trade_status_sync_alipay-sdk-nodejs-all",
            "alipay_public_key_trade_status_sync.pem",
            ("total_amount=0.10", "total_amount=0.11"),
        ),
        alipay(
            "alipay servicemarket (keeps sign_type)",
            "alipay_notify_servicemarket_order_notify_alipay-sdk-nodejs-all",
            "alipay_public_key_servicemarket.pem",
            ("total_price=0.00", "total_price=1.00"),
        ),
        stripe(),
        standard_webhooks("standard-webhooks go", "go", ("2432232314", "2432232315")),
        standard_webhooks("standard-webhooks rust", "rust", ("test_user", "test_usex")),
        adyen(
            "adyen backslash",
            "backslash",
            ("T7FD4VM4D3RZNN82", "T7FD4VM4D3RZNN83"),
        ),
        adyen(
            "adyen colon",
            "colon",
            ("M8NB66SBZSGLNK82", "M8NB66SBZSGLNK83"),
        ),
        adyen(
            "adyen forwardslash",
            "forwardslash",
            ("X3GWNS6KJ8NKGK82", "X3GWNS6KJ8NKGK83"),
        ),
        adyen(
            "adyen mixed",
            "mixed",
            ("ZVWN7D3WSMK2WN82", "ZVWN7D3WSMK2WN83"),
        ),
        adyen_platform(),
        paypal(),
    ]
}

/// Sends one request through the verify layer alone; returns the status, the
/// outcome and whether the handler saw a `Verified` marker.
pub async fn through(
    keys: VerifyLayer,
    now: u64,
    headers: &[(String, String)],
    body: Vec<u8>,
) -> (http::StatusCode, Option<Outcome>, bool) {
    let seen = crate::common::Counter::default();
    let handler = {
        let seen = seen.clone();
        service_fn(move |req: http::Request<VerifyBody<Full<Bytes>>>| {
            let seen = seen.clone();
            async move {
                if req.extensions().get::<Verified>().is_some() {
                    seen.bump();
                }
                let _ = req.into_body().collect().await;
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::<Bytes>::default()))
            }
        })
    };
    let svc = keys.clock(move || at(now)).layer(handler);
    let mut req = http::Request::post("/notify");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let res = svc
        .oneshot(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    (
        res.status(),
        res.extensions().get::<Outcome>().copied(),
        seen.get() == 1,
    )
}
