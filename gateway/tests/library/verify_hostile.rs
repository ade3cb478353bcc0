//! The verify layer and the library's gateway against a hostile sender:
//! panics, signature lists, bodies read two ways, stale PayPal
//! transmissions, Alipay charsets.

use test_support::common;
use test_support::verify_support;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idempotency_gateway::proxy::{Forward, Gateway, RouteOptions, Target};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::time::SystemTime;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::verify::{Verified, Verifier, VerifyError};
use tower_idempotency::{Outcome, Preset};

/// A verifier with a bug: it panics.
struct Panics;

impl Verifier for Panics {
    fn verify(
        &self,
        _parts: &mut http::request::Parts,
        _body: &Bytes,
        _now: SystemTime,
    ) -> Result<Verified, VerifyError> {
        panic!("a verifier bug");
    }

    fn channel(&self) -> &str {
        "panics"
    }
}

#[test]
fn a_panic_below_the_gateway_answers_500_and_is_counted_as_panicked() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (status, outcome) = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let forward = Forward::new("http://127.0.0.1:1".parse().unwrap());
            let gateway = Gateway::builder(forward, MemoryStore::new())
                .route_with(
                    "/notify/stripe",
                    Target::Preset(Preset::stripe()),
                    RouteOptions::new().verify(Panics),
                )
                .build()
                .unwrap();
            let req = Request::post("/notify/stripe")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(br#"{"id":"evt_1"}"#)))
                .unwrap();
            let res = gateway.oneshot(req).await.unwrap();
            (res.status(), res.extensions().get::<Outcome>().copied())
        })
    });
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(outcome, Some(Outcome::Panicked));
    let mut panicked = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        if let ("idempotency_requests_total", DebugValue::Counter(n)) = (key.name(), value)
            && labels.contains(&("outcome".into(), "panicked".into()))
        {
            assert!(
                labels.contains(&("preset".into(), "stripe".into())),
                "{labels:?}"
            );
            panicked += n;
        }
    }
    assert_eq!(panicked, 1, "counted once as outcome=\"panicked\"");
    assert_eq!(Outcome::Panicked.as_str(), "panicked");
}

/// The PayPal Java SDK's 2019 delivery through the verify layer at `now`
/// (`None`: the system clock); the status.
async fn paypal_at(keys: tower_idempotency::verify::PayPalKeys, now: Option<u64>) -> StatusCode {
    use tower_idempotency::verify::VerifyLayer;
    let m = verify_support::meta("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.meta.json");
    let mut layer = VerifyLayer::new(keys);
    if let Some(now) = now {
        layer = layer.clock(move || verify_support::at(now));
    }
    let svc = tower::Layer::layer(
        &layer,
        tower::service_fn(|_req: Request<_>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::<Bytes>::default()))
        }),
    );
    let mut req = Request::post("/notify/paypal");
    for (k, v) in m["headers"].as_object().unwrap() {
        req = req.header(k.as_str(), v.as_str().unwrap());
    }
    let body = verify_support::fixture("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.json");
    let res = svc
        .oneshot(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    res.status()
}

fn paypal_keys() -> tower_idempotency::verify::PayPalKeys {
    tower_idempotency::verify::PayPalKeys::new("0FV983392A0531201")
        .certificate(verify_support::fixture("paypal_cert_ValidateCertTest.pem"))
        .unwrap()
}

/// 2019-08-29T10:49:33Z, the vector's PAYPAL-TRANSMISSION-TIME.
const PAYPAL_SENT: u64 = 1_567_075_773;

#[tokio::test]
async fn the_2019_paypal_delivery_is_stale_today_and_fresh_at_its_time() {
    assert_eq!(
        paypal_at(paypal_keys(), None).await,
        StatusCode::UNAUTHORIZED,
        "a 2019 transmission is refused by default"
    );
    assert_eq!(
        paypal_at(paypal_keys(), Some(PAYPAL_SENT + 300)).await,
        StatusCode::OK
    );
    assert_eq!(
        paypal_at(paypal_keys(), Some(PAYPAL_SENT + 301)).await,
        StatusCode::UNAUTHORIZED,
        "one second past the 5 minute default"
    );
    let wide = paypal_keys().tolerance(std::time::Duration::from_secs(3600));
    assert_eq!(
        paypal_at(wide, Some(PAYPAL_SENT + 3000)).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_paypal_transmission_id_is_single_use_within_the_window() {
    let keys = paypal_keys();
    assert_eq!(
        paypal_at(keys.clone(), Some(PAYPAL_SENT)).await,
        StatusCode::OK
    );
    assert_eq!(
        paypal_at(keys.clone(), Some(PAYPAL_SENT + 10)).await,
        StatusCode::UNAUTHORIZED,
        "the same transmission again is a replay"
    );
    // Other keys (another process) have not seen it.
    assert_eq!(
        paypal_at(paypal_keys(), Some(PAYPAL_SENT)).await,
        StatusCode::OK
    );
}

#[test]
fn a_paypal_verify_table_reads_tolerance() {
    let config: idempotency_gateway::config::VerifyConfig = serde_json::from_str(
        r#"{ "webhook_id": "0FV983392A0531201", "certificates": ["tests/fixtures/paypal_cert_ValidateCertTest.pem"], "tolerance": "10m" }"#,
    )
    .unwrap();
    assert!(config
        .layer(
            "paypal",
            &test_support::common::vectors::fixtures_dir().join("../..")
        )
        .is_ok());
}

/// An ack-then-deliver PayPal route whose verifier reads `clock` (Unix
/// seconds), the queue and the upstream.
async fn paypal_ack_route(
    clock: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> (
    Gateway<MemoryStore>,
    tower_idempotency_queue::MemoryQueue,
    common::upstream::Upstream,
) {
    use tower_idempotency::verify::VerifyLayer;
    let up = common::upstream::Upstream::start().await;
    let queue = tower_idempotency_queue::MemoryQueue::new();
    let verify = VerifyLayer::new(paypal_keys())
        .clock(move || verify_support::at(clock.load(std::sync::atomic::Ordering::SeqCst)));
    let gateway = Gateway::builder(Forward::new(up.url().parse().unwrap()), MemoryStore::new())
        .queue(queue.clone())
        .route_with(
            "/notify/paypal",
            Target::Preset(Preset::paypal()),
            RouteOptions::new().ack_then_deliver(true).verify(verify),
        )
        .build()
        .unwrap();
    (gateway, queue, up)
}

#[tokio::test]
async fn a_queued_paypal_notification_is_delivered_though_its_transmission_was_used_and_is_stale() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower_idempotency_queue::Queue;
    let clock = std::sync::Arc::new(AtomicU64::new(PAYPAL_SENT));
    let (gateway, queue, up) = paypal_ack_route(clock.clone()).await;
    let m = verify_support::meta("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.meta.json");
    let mut req = Request::post("/notify/paypal").header("content-type", "application/json");
    for (k, v) in m["headers"].as_object().unwrap() {
        req = req.header(k.as_str(), v.as_str().unwrap());
    }
    let body = verify_support::fixture("paypal_webhook_PayPal-Java-SDK_ValidateCertTest.json");
    let res = gateway
        .clone()
        .oneshot(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK, "verified and queued");
    let message = queue.fetch(1, std::time::Duration::ZERO).await.unwrap()[0]
        .message
        .clone();
    // Delivered an hour later: the transmission id was used at ingest and
    // its time is past the tolerance; it was verified before it was queued.
    clock.store(PAYPAL_SENT + 3600, Ordering::SeqCst);
    gateway.deliver(message).await.unwrap();
    assert_eq!(
        up.total(),
        1,
        "the queued notification reached the upstream"
    );
}

/// A real notification has about 30 fields: a signed body of more than
/// 256 (form parameters, XML elements, members of one JSON object) is
/// refused before its signature is checked, however it is signed.
#[test]
fn a_signed_body_of_more_than_256_fields_is_refused() {
    use tower_idempotency::key::MAX_FIELDS;
    use verify_support::signed::*;
    assert_eq!(MAX_FIELDS, 256);
    assert_eq!(tower_idempotency::verify::MAX_FIELDS, MAX_FIELDS);
    let names: Vec<String> = (0..MAX_FIELDS).map(|i| format!("x{i:03}")).collect();
    // Alipay: 9 fields, `sign` and `sign_type`, and the extra ones.
    for (extra, ok) in [(MAX_FIELDS - 11, true), (MAX_FIELDS - 10, false)] {
        let mut fields = trade("utf-8", "order");
        fields.extend(names[..extra].iter().map(|n| (n.as_str(), "")));
        let body = alipay_body(&fields, encoding_rs::UTF_8);
        assert_eq!(body.split('&').count(), extra + 11);
        let got = verify(&alipay(), FORM, body.as_bytes());
        if ok {
            assert!(got.is_ok(), "alipay, {} fields: {got:?}", extra + 11);
        } else {
            let err = got.unwrap_err();
            assert!(
                matches!(&err, VerifyError::Malformed(m) if m.contains("256")),
                "alipay, {} fields: {err}",
                extra + 11
            );
        }
    }
    // WeChat Pay v2: the fields and `sign`.
    for (count, ok) in [(MAX_FIELDS - 1, true), (MAX_FIELDS, false)] {
        let mut fields: Vec<(String, String)> = names[..count]
            .iter()
            .map(|n| (n.clone(), "1".to_owned()))
            .collect();
        let sign = wechat_sign(&fields);
        fields.push(("sign".into(), sign));
        let got = verify(&wechat(), "text/xml", xml(&fields).as_bytes());
        if ok {
            assert!(got.is_ok(), "wechat, {} fields: {got:?}", count + 1);
        } else {
            let err = got.unwrap_err();
            assert!(
                matches!(&err, VerifyError::Malformed(m) if m.contains("256")),
                "wechat, {} fields: {err}",
                count + 1
            );
        }
    }
    // Adyen: a genuine item, in an envelope of `live`, `notificationItems`
    // and the extra members.
    let item = adyen_item("PSP1", 100, "AUTHORISATION");
    for (extra, ok) in [(MAX_FIELDS - 2, true), (MAX_FIELDS - 1, false)] {
        let members: String = names[..extra]
            .iter()
            .map(|n| format!(",\"{n}\":0"))
            .collect();
        let body = format!(r#"{{"live":"false","notificationItems":[{item}]{members}}}"#);
        let got = verify(&adyen(), "application/json", body.as_bytes());
        if ok {
            assert!(got.is_ok(), "adyen, {} members: {got:?}", extra + 2);
        } else {
            let err = got.unwrap_err();
            assert!(
                matches!(&err, VerifyError::Malformed(m) if m.contains("256")),
                "adyen, {} members: {err}",
                extra + 2
            );
        }
    }
}
