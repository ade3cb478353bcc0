//! The verify layer: every verifiable vector verifies with its key, and every
//! tampering is refused before the store is touched.

use test_support::common;
use test_support::verify_support;

use bytes::Bytes;
use common::faults::{FaultStore, Faults, Op};
use common::{all_at_once, client, post, read, serve, Counter};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::StoreError;
use tower_idempotency::verify::{DecryptedResource, StripeKeys, VerifyLayer, WechatPayV3Keys};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, Outcome};
use verify_support::{at, cases, fixture, meta, through, wechatpay_v3, wechatpay_v3_keys, Case};

fn replace_once(body: &[u8], (from, to): (&str, &str)) -> Vec<u8> {
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.contains(from), "tamper target {from:?} not in body");
    assert_eq!(from.len(), to.len());
    text.replacen(from, to, 1).into_bytes()
}

fn with_header(headers: &[(String, String)], name: &str, value: &str) -> Vec<(String, String)> {
    let mut out: Vec<_> = headers
        .iter()
        .filter(|(k, _)| !k.eq_ignore_ascii_case(name))
        .cloned()
        .collect();
    out.push((name.to_owned(), value.to_owned()));
    out
}

async fn refused(case: &Case, now: u64, headers: &[(String, String)], body: Vec<u8>, what: &str) {
    let (status, outcome, ran) = through(case.keys.clone(), now, headers, body).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "{}: {what} passed",
        case.name
    );
    assert_eq!(outcome, Some(Outcome::Unverified), "{}: {what}", case.name);
    assert!(!ran, "{}: {what} reached the handler", case.name);
}

#[tokio::test]
async fn every_vector_verifies_with_its_key() {
    for case in cases() {
        let (status, outcome, ran) = through(
            case.keys.clone(),
            case.now,
            &case.headers,
            case.body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{} was refused", case.name);
        assert_eq!(outcome, None, "{}", case.name);
        assert!(ran, "{}: the handler did not see Verified", case.name);
    }
}

#[tokio::test]
async fn one_changed_body_byte_is_refused() {
    for case in cases() {
        let body = replace_once(&case.body, case.tamper);
        refused(&case, case.now, &case.headers, body, "a changed body byte").await;
    }
}

#[tokio::test]
async fn a_changed_signed_header_is_refused() {
    for case in cases() {
        let Some((name, value)) = &case.header_tamper else {
            continue;
        };
        let headers = with_header(&case.headers, name, value);
        refused(
            &case,
            case.now,
            &headers,
            case.body.clone(),
            "a changed header",
        )
        .await;
    }
}

#[tokio::test]
async fn a_missing_signature_is_refused() {
    for case in cases() {
        let headers: Vec<_> = case
            .headers
            .iter()
            .filter(|(k, _)| {
                let k = k.to_ascii_lowercase();
                !(k.contains("signature") || k.contains("-sig"))
            })
            .cloned()
            .collect();
        let body = if headers.len() == case.headers.len() {
            // The signature is in the body: drop it.
            let text = String::from_utf8(case.body.clone()).unwrap();
            text.replace("<sign>", "<signx>")
                .replace("</sign>", "</signx>")
                .replace("&sign=", "&nosign=")
                .replace("\"hmacSignature\"", "\"hmacSignaturX\"")
                .into_bytes()
        } else {
            case.body.clone()
        };
        refused(&case, case.now, &headers, body, "no signature").await;
    }
}

#[tokio::test]
async fn timestamps_outside_the_shipped_tolerance_are_refused() {
    for case in cases() {
        let Some(tolerance) = case.tolerance else {
            continue;
        };
        // At the edge of the window the vector still verifies… (with fresh
        // keys each time: PayPal transmission ids are single-use)
        for now in [case.now + tolerance, case.now - tolerance] {
            let keys = cases()
                .into_iter()
                .find(|c| c.name == case.name)
                .unwrap()
                .keys;
            let (status, _, _) = through(keys, now, &case.headers, case.body.clone()).await;
            assert_eq!(status, StatusCode::OK, "{} at {now}", case.name);
        }
        // …one second past it (either way) it is refused.
        for now in [case.now + tolerance + 1, case.now - tolerance - 1] {
            refused(
                &case,
                now,
                &case.headers,
                case.body.clone(),
                "a stale timestamp",
            )
            .await;
        }
    }
}

#[tokio::test]
async fn an_unknown_key_is_refused() {
    // WeChat Pay v3 names its key: an unknown serial is refused.
    let case = wechatpay_v3();
    let headers = with_header(
        &case.headers,
        "Wechatpay-Serial",
        "5157F09EFDC096DE15EBE81A47057A72",
    );
    refused(
        &case,
        case.now,
        &headers,
        case.body.clone(),
        "an unknown serial",
    )
    .await;
    // The other channels: a key that is not the signer's.
    let other = StripeKeys::new().secret("whsec_not_the_signer").unwrap();
    let stripe = cases().into_iter().find(|c| c.name == "stripe").unwrap();
    let (status, outcome, _) = through(
        VerifyLayer::new(other),
        stripe.now,
        &stripe.headers,
        stripe.body.clone(),
    )
    .await;
    assert_eq!(
        (status, outcome),
        (StatusCode::UNAUTHORIZED, Some(Outcome::Unverified))
    );
}

#[tokio::test]
async fn keys_rotate_with_two_keys_configured() {
    let case = wechatpay_v3();
    // The signer's key next to another (the Alipay test key under an old serial).
    let keys = wechatpay_v3_keys()
        .platform_key(
            "OLD-SERIAL",
            fixture("alipay_public_key_trade_status_sync.pem"),
        )
        .unwrap();
    let (status, _, ran) = through(
        VerifyLayer::new(keys.clone()),
        case.now,
        &case.headers,
        case.body.clone(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(ran);
    // The signature made by one key never verifies under the other serial.
    let headers = with_header(&case.headers, "Wechatpay-Serial", "OLD-SERIAL");
    let (status, _, _) = through(
        VerifyLayer::new(keys),
        case.now,
        &headers,
        case.body.clone(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // Secrets without ids: the old and the new one, in either order.
    let stripe = cases().into_iter().find(|c| c.name == "stripe").unwrap();
    let secret = meta("stripe_webhook_SYNTHESIZED_stripe-go_testPayload.meta.json")["secret"]
        .as_str()
        .unwrap()
        .to_owned();
    for keys in [
        StripeKeys::new()
            .secret("whsec_old")
            .unwrap()
            .secret(&secret)
            .unwrap(),
        StripeKeys::new()
            .secret(&secret)
            .unwrap()
            .secret("whsec_old")
            .unwrap(),
    ] {
        let (status, _, ran) = through(
            VerifyLayer::new(keys),
            stripe.now,
            &stripe.headers,
            stripe.body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(ran);
    }
}

#[tokio::test]
async fn the_decrypted_resource_reaches_the_handler_and_joins_the_fingerprint() {
    let case = wechatpay_v3();
    let expected = meta("wechatpay_v3_notify_wechatpay-go.meta.json")["expected"]
        ["resource_plaintext"]
        .as_str()
        .unwrap()
        .to_owned();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut fingerprints = Vec::new();
    for keys in [
        wechatpay_v3_keys(),
        WechatPayV3Keys::new()
            .platform_key(
                "D7CE59D1F522D701",
                fixture("wechatpay_v3_platform_cert.pem"),
            )
            .unwrap(),
    ] {
        let log = seen.clone();
        let handler = service_fn(move |req: Request<Full<Bytes>>| {
            let seen = log.clone();
            async move {
                let key = req.extensions().get::<IdempotencyKey>().unwrap();
                let plain = req
                    .extensions()
                    .get::<DecryptedResource>()
                    .map(|d| d.0.clone());
                seen.lock().unwrap().push((key.fingerprint(), plain));
                Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
            }
        });
        let now = case.now;
        let svc = IdempotencyLayer::wechatpay_v3()
            .verify(VerifyLayer::new(keys).clock(move || at(now)))
            .layer(handler);
        let res = svc
            .oneshot(common::request(
                "/notify/wechat",
                &pairs(&case.headers),
                case.body.clone(),
            ))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        fingerprints.push(seen.lock().unwrap().last().unwrap().0);
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0].1.as_deref(), Some(expected.as_bytes()));
    assert_eq!(seen[1].1, None);
    assert_ne!(
        fingerprints[0], fingerprints[1],
        "decrypted fields did not join the fingerprint"
    );
}

fn pairs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// Counts the claims the memory store is asked for.
#[derive(Clone, Default)]
struct ClaimCount {
    claims: Arc<AtomicUsize>,
}

impl Faults for ClaimCount {
    async fn before(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        if op == Op::Claim {
            self.claims.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

type CountingStore = FaultStore<ClaimCount>;

/// A WeChat Pay v3 route on a real hyper server whose handler never finishes
/// for the forged copy (a forged copy that got through would hold the claim).
async fn wechat_server(verify: bool, store: CountingStore, runs: Counter) -> std::net::SocketAddr {
    let handler = service_fn(move |req: Request<Full<Bytes>>| {
        let runs = runs.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            if String::from_utf8_lossy(&body).contains("签约成函") {
                std::future::pending::<()>().await;
            }
            runs.bump();
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
        }
    });
    let mut layer = IdempotencyLayer::wechatpay_v3()
        .with_store(store)
        .wait(Duration::from_millis(300));
    if verify {
        let now = wechatpay_v3().now;
        layer = layer.verify(VerifyLayer::new(wechatpay_v3_keys()).clock(move || at(now)));
    }
    serve(layer.layer(handler)).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_copy_racing_the_genuine_one_never_delays_it() {
    let case = wechatpay_v3();
    let store = CountingStore::default();
    let runs = Counter::default();
    let addr = wechat_server(true, store.clone(), runs.clone()).await;
    let forged = replace_once(&case.body, case.tamper);
    let client = client();
    let headers = case.headers.clone();
    let answers = all_at_once(8, |i| {
        let (client, headers) = (client.clone(), headers.clone());
        let body = if i == 7 {
            case.body.clone()
        } else {
            forged.clone()
        };
        async move {
            (
                i,
                post(&client, addr, "/notify/wechat", &pairs(&headers), body).await,
            )
        }
    })
    .await;
    for (i, a) in &answers {
        if *i == 7 {
            assert_eq!(
                a.status,
                200,
                "the genuine copy was not served at once: {}",
                a.text()
            );
            assert_eq!(a.text(), r#"{"code":"SUCCESS","message":"成功"}"#);
            assert!(!a.replayed());
        } else {
            assert_eq!(a.status, 401);
            assert_eq!(a.text(), r#"{"code":"FAIL","message":"失败"}"#);
        }
    }
    assert_eq!(runs.get(), 1, "the genuine copy ran once");
    assert_eq!(
        store.claims.load(Ordering::SeqCst),
        1,
        "only the genuine copy claimed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_verification_a_forged_copy_holds_the_claim() {
    // The race the verify layer closes: the forged copy claims first, and the
    // genuine one cannot be served while it holds the claim.
    let case = wechatpay_v3();
    let store = CountingStore::default();
    let runs = Counter::default();
    let addr = wechat_server(false, store.clone(), runs.clone()).await;
    let forged = replace_once(&case.body, case.tamper);
    let client = client();
    let pending = {
        let (client, headers) = (client.clone(), case.headers.clone());
        tokio::spawn(async move {
            post(&client, addr, "/notify/wechat", &pairs(&headers), forged).await
        })
    };
    while store.claims.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let genuine = post(
        &client,
        addr,
        "/notify/wechat",
        &pairs(&case.headers),
        case.body.clone(),
    )
    .await;
    assert_ne!(
        genuine.status, 200,
        "the genuine copy was served although a forged one held the claim"
    );
    assert_eq!(runs.get(), 0);
    pending.abort();
}

#[tokio::test]
async fn a_refused_request_never_touches_the_store() {
    let case = wechatpay_v3();
    let store = CountingStore::default();
    let now = case.now;
    let svc = IdempotencyLayer::wechatpay_v3()
        .with_store(store.clone())
        .verify(VerifyLayer::new(wechatpay_v3_keys()).clock(move || at(now + 301)))
        .layer(service_fn(|_req: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
        }));
    let res = svc
        .oneshot(common::request(
            "/notify/wechat",
            &pairs(&case.headers),
            case.body.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(
        res.extensions().get::<Outcome>(),
        Some(&Outcome::Unverified)
    );
    let answer = read(res).await;
    assert_eq!(answer.status, 401);
    assert_eq!(answer.text(), r#"{"code":"FAIL","message":"失败"}"#);
    assert_eq!(store.claims.load(Ordering::SeqCst), 0);
    assert_eq!(store.inner.len(), 0);
}

#[tokio::test]
async fn standard_webhooks_v1a_ed25519_verifies_and_rejects_tampering() {
    use base64::Engine;
    use ring::signature::{Ed25519KeyPair, KeyPair};
    use tower_idempotency::verify::StandardWebhooksKeys;
    let b64 = base64::engine::general_purpose::STANDARD;
    // A key pair made here: no published v1a vector exists.
    let pkcs8 = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
    let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
    let public = format!("whpk_{}", b64.encode(pair.public_key().as_ref()));
    let body = br#"{"type":"invoice.paid","id":"in_1"}"#.to_vec();
    let signed = [b"msg_1.1700000000.".as_slice(), &body].concat();
    let sig = format!(
        "v1,bm90LWEtc2lnbmF0dXJl v1a,{}",
        b64.encode(pair.sign(&signed))
    );
    let headers = vec![
        ("webhook-id".to_owned(), "msg_1".to_owned()),
        ("webhook-timestamp".to_owned(), "1700000000".to_owned()),
        ("webhook-signature".to_owned(), sig),
    ];
    let keys = StandardWebhooksKeys::new().public_key(&public).unwrap();
    let (status, _, ran) = through(
        VerifyLayer::new(keys.clone()),
        1_700_000_000,
        &headers,
        body.clone(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(ran);
    let forged = replace_once(&body, ("in_1", "in_2"));
    let (status, outcome, _) =
        through(VerifyLayer::new(keys), 1_700_000_000, &headers, forged).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::UNAUTHORIZED, Some(Outcome::Unverified))
    );
}
