//! Configured presets and HMAC schemes: GitHub, Shopify, Slack, Paddle and
//! Square, each signed as the sender's documentation describes, through the
//! verify layer alone and through the whole stack.

use base64::Engine;
use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use ring::hmac;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};
use test_support::verify_support::through;
use tower::{service_fn, ServiceExt};
use tower_idempotency::key::{Field, FingerprintSpec};
use tower_idempotency::normalize::FixedReply;
use tower_idempotency::verify::{
    BodyShape, HmacAlgorithm, HmacScheme, SecretEncoding, SignatureEncoding, Verifier, VerifyError,
    VerifyLayer,
};
use tower_idempotency::{IdempotencyLayer, Outcome, Preset, WithoutKey};

const NOW: u64 = 1_700_000_000;

fn hex_mac(alg: hmac::Algorithm, secret: &[u8], msg: &[u8]) -> String {
    hex::encode(hmac::sign(&hmac::Key::new(alg, secret), msg))
}

fn b64_mac(alg: hmac::Algorithm, secret: &[u8], msg: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(hmac::sign(&hmac::Key::new(alg, secret), msg))
}

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn github(secrets: &[&str]) -> HmacScheme {
    let mut b = HmacScheme::builder("github", HmacAlgorithm::Sha256, "x-hub-signature-256")
        .prefix("sha256=");
    for s in secrets {
        b = b.secret(s);
    }
    b.build().unwrap()
}

/// GitHub's documented example: secret "It's a Secret to Everybody", body
/// "Hello, World!", `sha256=757107ea…`.
#[tokio::test]
async fn github_documented_example_verifies_and_forgeries_do_not() {
    let body = b"Hello, World!".to_vec();
    let sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    assert_eq!(
        &sig[7..],
        hex_mac(hmac::HMAC_SHA256, b"It's a Secret to Everybody", &body)
    );
    let keys = || VerifyLayer::new(github(&["It's a Secret to Everybody"]));
    let ok = through(
        keys(),
        NOW,
        &h(&[("x-hub-signature-256", sig)]),
        body.clone(),
    )
    .await;
    assert_eq!(ok, (StatusCode::OK, None, true));
    // Tampered body, forged signature, no prefix, other secret, unsigned.
    let refused = [
        (
            h(&[("x-hub-signature-256", sig)]),
            b"Hello, World?".to_vec(),
        ),
        (
            h(&[("x-hub-signature-256", &format!("sha256={}", "0".repeat(64)))]),
            body.clone(),
        ),
        (h(&[("x-hub-signature-256", &sig[7..])]), body.clone()),
        (
            h(&[(
                "x-hub-signature-256",
                &format!("sha256={}", hex_mac(hmac::HMAC_SHA256, b"other", &body)),
            )]),
            body.clone(),
        ),
        (Vec::new(), body.clone()),
    ];
    for (headers, body) in refused {
        let got = through(keys(), NOW, &headers, body).await;
        assert_eq!(
            got,
            (StatusCode::UNAUTHORIZED, Some(Outcome::Unverified), false),
            "{headers:?}"
        );
    }
    // The old secret still verifies during a rotation.
    let rotated = VerifyLayer::new(github(&["new secret", "It's a Secret to Everybody"]));
    let ok = through(rotated, NOW, &h(&[("x-hub-signature-256", sig)]), body).await;
    assert_eq!(ok, (StatusCode::OK, None, true));
}

/// A repeated signature header, or more than 16 signatures, is refused.
#[tokio::test]
async fn repeated_headers_and_long_lists_are_refused() {
    let body = b"Hello, World!".to_vec();
    let sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    let keys = || VerifyLayer::new(github(&["It's a Secret to Everybody"]));
    let twice = h(&[("x-hub-signature-256", sig), ("x-hub-signature-256", sig)]);
    let got = through(keys(), NOW, &twice, body.clone()).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
    let long = vec![sig; 17].join(" ");
    let got = through(
        keys(),
        NOW,
        &h(&[("x-hub-signature-256", &long)]),
        body.clone(),
    )
    .await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
    let sixteen = vec![sig; 16].join(" ");
    let got = through(keys(), NOW, &h(&[("x-hub-signature-256", &sixteen)]), body).await;
    assert_eq!(got.0, StatusCode::OK);
}

/// Shopify: `X-Shopify-Hmac-Sha256`, base64 of the HMAC-SHA256 of the body.
#[tokio::test]
async fn shopify_base64_body_signature() {
    let secret = b"shpss_0123456789abcdef";
    let body = br#"{"id":820982911946154508,"email":"jon@example.com"}"#.to_vec();
    let sig = b64_mac(hmac::HMAC_SHA256, secret, &body);
    let keys = || {
        VerifyLayer::new(
            HmacScheme::builder("shopify", HmacAlgorithm::Sha256, "x-shopify-hmac-sha256")
                .encoding(SignatureEncoding::Base64)
                .body_shape(BodyShape::Json)
                .secret(secret)
                .build()
                .unwrap(),
        )
    };
    let ok = through(
        keys(),
        NOW,
        &h(&[("x-shopify-hmac-sha256", &sig)]),
        body.clone(),
    )
    .await;
    assert_eq!(ok.0, StatusCode::OK);
    let hexed = hex_mac(hmac::HMAC_SHA256, secret, &body);
    let got = through(keys(), NOW, &h(&[("x-shopify-hmac-sha256", &hexed)]), body).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
    // A signed body that repeats a member is refused (one parse).
    let dup = br#"{"id":1,"id":2}"#.to_vec();
    let sig = b64_mac(hmac::HMAC_SHA256, secret, &dup);
    let got = through(keys(), NOW, &h(&[("x-shopify-hmac-sha256", &sig)]), dup).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
}

fn slack() -> VerifyLayer {
    VerifyLayer::new(
        HmacScheme::builder("slack", HmacAlgorithm::Sha256, "x-slack-signature")
            .prefix("v0=")
            .signed("v0:{timestamp}:{body}".parse().unwrap())
            .timestamp_header("x-slack-request-timestamp")
            .secret("8f742231b10e8888abcd99yyyzzz85a5")
            .build()
            .unwrap(),
    )
}

/// Slack's documented example (signing secret `8f742231…`, timestamp
/// 1531420618, `v0=a2114d57…`), and a stale copy.
#[tokio::test]
async fn slack_documented_example_and_staleness() {
    let body = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c".to_vec();
    let headers = h(&[
        ("x-slack-request-timestamp", "1531420618"),
        (
            "x-slack-signature",
            "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
        ),
    ]);
    let ok = through(slack(), 1_531_420_618 + 60, &headers, body.clone()).await;
    assert_eq!(ok, (StatusCode::OK, None, true));
    let stale = through(slack(), 1_531_420_618 + 301, &headers, body.clone()).await;
    assert_eq!(stale.0, StatusCode::UNAUTHORIZED);
    // Another timestamp under the same signature does not verify.
    let mut moved = headers.clone();
    moved[0].1 = "1531420619".into();
    let got = through(slack(), 1_531_420_618, &moved, body.clone()).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
    // A timestamp the clock cannot hold is malformed, not a panic.
    let mut huge = headers.clone();
    huge[0].1 = u64::MAX.to_string();
    let got = through(slack(), 1_531_420_618, &huge, body).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
}

fn paddle(secrets: &[&str]) -> VerifyLayer {
    let mut b = HmacScheme::builder("paddle", HmacAlgorithm::Sha256, "paddle-signature")
        .signature_field("h1")
        .timestamp_field("ts")
        .signed("{timestamp}:{body}".parse().unwrap());
    for s in secrets {
        b = b.secret(s);
    }
    VerifyLayer::new(b.build().unwrap())
}

/// Paddle Billing: `Paddle-Signature: ts=…;h1=…`, HMAC-SHA256 of
/// `ts:body`; several `h1` while a secret rotates.
#[tokio::test]
async fn paddle_pairs_with_rotation() {
    let secret = "pdl_ntfset_01gkpjp8bkm3tm53kdgkx6sms7_6h3qd3uFSi9YCD3OLYAShQI90XTI5vEI";
    let body =
        br#"{"event_id":"evt_01h8bzakzx3hm2fmen703n5q45","event_type":"transaction.completed"}"#
            .to_vec();
    let ts = NOW.to_string();
    let mut msg = format!("{ts}:").into_bytes();
    msg.extend_from_slice(&body);
    let good = hex_mac(hmac::HMAC_SHA256, secret.as_bytes(), &msg);
    let other = hex_mac(hmac::HMAC_SHA256, b"old", &msg);
    let header = format!("ts={ts};h1={other};h1={good}");
    let ok = through(
        paddle(&[secret]),
        NOW,
        &h(&[("paddle-signature", &header)]),
        body.clone(),
    )
    .await;
    assert_eq!(ok.0, StatusCode::OK);
    // The Stripe shape (`,` between pairs) reads the same.
    let comma = format!("ts={ts},h1={good}");
    let ok = through(
        paddle(&[secret]),
        NOW,
        &h(&[("paddle-signature", &comma)]),
        body.clone(),
    )
    .await;
    assert_eq!(ok.0, StatusCode::OK);
    let only_old = format!("ts={ts};h1={other}");
    let got = through(
        paddle(&[secret]),
        NOW,
        &h(&[("paddle-signature", &only_old)]),
        body.clone(),
    )
    .await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
    let ok = through(
        paddle(&["new", "old"]),
        NOW,
        &h(&[("paddle-signature", &only_old)]),
        body.clone(),
    )
    .await;
    assert_eq!(ok.0, StatusCode::OK);
    for bad in [
        format!("h1={good}"),
        format!("ts={ts};ts={ts};h1={good}"),
        format!("ts={};h1={good}", NOW - 600),
        format!("ts={ts}"),
    ] {
        let got = through(
            paddle(&[secret]),
            NOW,
            &h(&[("paddle-signature", &bad)]),
            body.clone(),
        )
        .await;
        assert_eq!(got.0, StatusCode::UNAUTHORIZED, "{bad}");
    }
}

/// Square: `x-square-hmacsha256-signature`, base64 of the HMAC-SHA256 of
/// the notification URL followed by the body.
#[tokio::test]
async fn square_url_and_body() {
    let url = "https://example.com/hooks/square";
    let secret = "asdf1234";
    let body = br#"{"merchant_id":"6SSW7HV8K2ST5","type":"payment.created","event_id":"13b867cf-db3d-4b1c-90b6-2f32a9d78124"}"#.to_vec();
    let mut msg = url.as_bytes().to_vec();
    msg.extend_from_slice(&body);
    let sig = b64_mac(hmac::HMAC_SHA256, secret.as_bytes(), &msg);
    let keys = |url: &str| {
        VerifyLayer::new(
            HmacScheme::builder(
                "square",
                HmacAlgorithm::Sha256,
                "x-square-hmacsha256-signature",
            )
            .encoding(SignatureEncoding::Base64)
            .signed("{url}{body}".parse().unwrap())
            .url(url, "/notify")
            .secret(secret)
            .build()
            .unwrap(),
        )
    };
    let headers = h(&[("x-square-hmacsha256-signature", &sig)]);
    let ok = through(keys(url), NOW, &headers, body.clone()).await;
    assert_eq!(ok.0, StatusCode::OK);
    // Signed for another URL: refused.
    let got = through(keys("https://example.com/other"), NOW, &headers, body).await;
    assert_eq!(got.0, StatusCode::UNAUTHORIZED);
}

/// SHA-1, SHA-512, `{header:NAME}` and base64 (`whsec_`) secrets.
#[test]
fn other_algorithms_headers_and_secret_encodings() {
    let body = Bytes::from_static(b"{\"id\":\"1\"}");
    let raw_secret = b"0123456789abcdef";
    let whsec = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(raw_secret)
    );
    let msg = [b"msg_1." as &[u8], &body].concat();
    for (alg, ring_alg) in [
        (HmacAlgorithm::Sha1, hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY),
        (HmacAlgorithm::Sha256, hmac::HMAC_SHA256),
        (HmacAlgorithm::Sha512, hmac::HMAC_SHA512),
    ] {
        let scheme = HmacScheme::builder("internal", alg, "x-sig")
            .signed("{header:x-id}.{body}".parse().unwrap())
            .secret_encoding(SecretEncoding::Base64)
            .secret(&whsec)
            .build()
            .unwrap();
        let sig = hex_mac(ring_alg, raw_secret, &msg);
        let req = Request::post("/")
            .header("x-sig", sig.to_uppercase())
            .header("x-id", "msg_1")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        let now = UNIX_EPOCH + Duration::from_secs(NOW);
        let verified = scheme.verify(&mut parts, &body, now).unwrap();
        assert_eq!(verified.channel(), "internal");
        assert_eq!(scheme.channel(), "internal");
        parts.headers.insert("x-id", "msg_2".parse().unwrap());
        assert_eq!(
            scheme.verify(&mut parts, &body, now),
            Err(VerifyError::BadSignature)
        );
    }
}

/// A configured preset in the whole stack: copies run once, a copy with
/// another body gets the failure reply, forgeries never reach the handler,
/// a request without the key passes (`WithoutKey::Pass`) or is refused.
#[tokio::test]
async fn configured_preset_through_the_stack() {
    let secret = "It's a Secret to Everybody";
    let preset = |without: WithoutKey| {
        Preset::builder("github")
            .key([Field::header(HeaderName::from_static("x-github-delivery"))])
            .fingerprint(FingerprintSpec::Body)
            .success(FixedReply::new(
                StatusCode::OK,
                None,
                Some(Bytes::from_static(b"ok")),
            ))
            .failure(FixedReply::new(
                StatusCode::SERVICE_UNAVAILABLE,
                None,
                Some(Bytes::from_static(b"retry")),
            ))
            .without_key(without)
            .build()
            .unwrap()
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = |without| {
        let runs = runs.clone();
        let layer = IdempotencyLayer::new(preset(without)).verify(github(&[secret]));
        tower::Layer::layer(
            &layer,
            service_fn(move |_req: Request<_>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(
                        b"handled",
                    ))))
                }
            }),
        )
    };
    let send = |svc: &_, id: Option<&str>, body: &'static [u8], sign: bool| {
        let mut req = Request::post("/hooks/github");
        if let Some(id) = id {
            req = req.header("x-github-delivery", id);
        }
        if sign {
            let sig = format!(
                "sha256={}",
                hex_mac(hmac::HMAC_SHA256, secret.as_bytes(), body)
            );
            req = req.header("x-hub-signature-256", sig);
        }
        let svc: &tower_idempotency::Idempotency<_, _> = svc;
        svc.clone()
            .oneshot(req.body(Full::new(Bytes::from_static(body))).unwrap())
    };
    let refuse = svc(WithoutKey::Refuse);
    for _ in 0..3 {
        let res = send(&refuse, Some("d-1"), b"{\"a\":1}", true)
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let res = send(&refuse, Some("d-1"), b"{\"a\":2}", true)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let res = send(&refuse, Some("d-2"), b"{\"a\":1}", false)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    // Without the key: the failure reply's body, as a final 400 (a retry
    // cannot add the key).
    let res = send(&refuse, None, b"{\"a\":3}", true).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "retry");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let pass = svc(WithoutKey::Pass);
    let res = send(&pass, None, b"{\"a\":3}", true).await.unwrap();
    assert_eq!(
        res.into_body().collect().await.unwrap().to_bytes(),
        "handled"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let res = send(&pass, None, b"{\"a\":3}", false).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A key from the query string, and a key parameter sent twice refused.
#[tokio::test]
async fn query_keys_and_repeated_sources() {
    let preset = Preset::builder("internal")
        .key([Field::query("id")])
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(preset);
    let svc = {
        let runs = runs.clone();
        tower::Layer::layer(
            &layer,
            service_fn(move |_req: Request<_>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::default()))
                }
            }),
        )
    };
    for uri in ["/n?id=a%20b", "/n?x=1&id=a+b"] {
        let req = Request::post(uri).body(Full::new(Bytes::new())).unwrap();
        assert_eq!(
            svc.clone().oneshot(req).await.unwrap().status(),
            StatusCode::OK
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let req = Request::post("/n?id=a&id=b")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
