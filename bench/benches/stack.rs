//! Cost of the full stack per request, per preset: a first request (unique
//! key), a replay (same key), and the bare handler for comparison.
//!
//! `cargo bench --bench stack`

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::IdempotencyLayer;

/// The presets measured.
const PRESETS: [&str; 5] = [
    "wechatpay-v3",
    "wechatpay-v2",
    "alipay",
    "stripe",
    "idempotency-key",
];

/// A body and headers per preset; `{id}` is replaced by a unique id.
fn sample(preset: &str) -> (&'static str, Vec<(&'static str, &'static str)>) {
    match preset {
        "wechatpay-v3" => (
            r#"{"id":"{id}","create_time":"2021-06-24T16:37:26+08:00","resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","summary":"支付成功","resource":{"original_type":"transaction","algorithm":"AEAD_AES_256_GCM","ciphertext":"WKL1uWy9VDw3Bt6F3IQe5SnURsR5c+Rr66bVcvdHtUJgRhUJqiCMW7gM9mIAiKKmeQ5f9y+OTG5X+4+yCkGHw3zUVLoH8HPvv2q6ZAoxbb6qjzRAfJrK0bWGvPGkgdm0M8mPXW/kOiStIN02lGbAH06vUm7hKbBRrwzeK1bIxjf5CyHPEa0wEXOUkGLx0TNBhDn5nL+BvCyg0aaWwANNLuJw5TwkIZdw2Ddnu3UTqV2zKzYqL4dUsR0WzzHfQewnGxCSS25YAg8+lZmghSUS3Ak6rbHo","associated_data":"","nonce":"wTxLtByoX5fY"}}"#,
            vec![("content-type", "application/json"), ("wechatpay-signature", "sig"), ("wechatpay-timestamp", "1624523846")],
        ),
        "wechatpay-v2" => (
            "<xml><appid><![CDATA[wx2421b1c4370ec43b]]></appid><attach><![CDATA[支付测试]]></attach><bank_type><![CDATA[CFT]]></bank_type><fee_type><![CDATA[CNY]]></fee_type><is_subscribe><![CDATA[Y]]></is_subscribe><mch_id><![CDATA[10000100]]></mch_id><nonce_str><![CDATA[5d2b6c2a8db53831f7eda20af46e531c]]></nonce_str><openid><![CDATA[oUpF8uMEb4qRXf22hE3X68TekukE]]></openid><out_trade_no><![CDATA[1409811653]]></out_trade_no><result_code><![CDATA[SUCCESS]]></result_code><return_code><![CDATA[SUCCESS]]></return_code><sign><![CDATA[B552ED6B279343CB493C5DD0D78AB241]]></sign><time_end><![CDATA[20140903131540]]></time_end><total_fee>1</total_fee><trade_type><![CDATA[JSAPI]]></trade_type><transaction_id><![CDATA[{id}]]></transaction_id></xml>",
            vec![("content-type", "text/xml")],
        ),
        "alipay" => (
            "gmt_create=2019-08-15+15%3A56%3A22&charset=utf-8&seller_email=z97-yuquerevenue%40service.aliyun.com&subject=%E8%AF%AD%E9%9B%80&sign=QfTb8tqE1BMhS5qAnXtvsF3%2FjBkEvu9q9en0pdbBUDDjvKycZhQb7h8GDs4FKfi049PynaNuatxSgLb&buyer_id=2088102534368455&invoice_amount=0.10&notify_id={id}&notify_type=trade_status_sync&trade_status=TRADE_SUCCESS&receipt_amount=0.10&sign_type=RSA2&app_id=2019073166072302&out_trade_no=20190815155618536-564-57&total_amount=0.10&trade_no=2019081522001468450512505578",
            vec![("content-type", "application/x-www-form-urlencoded")],
        ),
        "stripe" => (
            r#"{"id":"{id}","object":"event","api_version":"2024-06-20","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#,
            vec![("content-type", "application/json"), ("stripe-signature", "t=1700000000,v1=c488")],
        ),
        "idempotency-key" => (r#"{"sku":"tea","qty":2}"#, vec![("content-type", "application/json"), ("idempotency-key", "{id}")]),
        other => panic!("no sample for {other}"),
    }
}

fn build(preset: &str, template: &str, headers: &[(&str, &str)], id: u64) -> Request<Full<Bytes>> {
    let id = format!("bench-{id}");
    let mut req = Request::post("/notify");
    for (k, v) in headers {
        req = req.header(*k, v.replace("{id}", &id));
    }
    req.body(Full::new(Bytes::from(template.replace("{id}", &id))))
        .unwrap_or_else(|_| panic!("{preset}"))
}

async fn handler(_req: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(
        b"{\"order\":\"paid\"}",
    ))))
}

async fn drive<S, B>(svc: &mut S, req: Request<Full<Bytes>>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible>,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert!(res.status().is_success());
    let _ = res.into_body().collect().await.unwrap();
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("stack");
    for preset in PRESETS {
        let (template, headers) = sample(preset);
        let layer = IdempotencyLayer::new(tower_idempotency::Preset::from_name(preset).unwrap());
        let counter = AtomicU64::new(0);

        let bare = service_fn(handler);
        group.bench_function(BenchmarkId::new("bare", preset), |b| {
            b.to_async(&rt).iter(|| {
                let mut svc = bare;
                let req = build(
                    preset,
                    template,
                    &headers,
                    counter.fetch_add(1, Ordering::Relaxed),
                );
                async move { drive(&mut svc, req).await }
            })
        });

        let stack = ServiceBuilder::new()
            .layer(layer.clone())
            .service(service_fn(handler));
        group.bench_function(BenchmarkId::new("first", preset), |b| {
            b.to_async(&rt).iter(|| {
                let mut svc = stack.clone();
                let req = build(
                    preset,
                    template,
                    &headers,
                    counter.fetch_add(1, Ordering::Relaxed),
                );
                async move { drive(&mut svc, req).await }
            })
        });

        let replay_id = u64::MAX;
        rt.block_on(drive(
            &mut stack.clone(),
            build(preset, template, &headers, replay_id),
        ));
        group.bench_function(BenchmarkId::new("replay", preset), |b| {
            b.to_async(&rt).iter(|| {
                let mut svc = stack.clone();
                let req = build(preset, template, &headers, replay_id);
                async move { drive(&mut svc, req).await }
            })
        });
    }
    group.finish();
}

/// The layers one at a time: key extraction per format, the store's claim
/// (first and repeat), and writing the channel reply.
fn per_layer(c: &mut Criterion) {
    use tower_idempotency::key::ExtractKey;
    use tower_idempotency::store::{
        Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoredResponse,
    };
    let mut group = c.benchmark_group("layer");
    for preset in PRESETS {
        let (template, headers) = sample(preset);
        let (parts, body) = build(preset, template, &headers, 7).into_parts();
        let body = rt_body(body);
        let extractor = tower_idempotency::Preset::from_name(preset)
            .unwrap()
            .extractor()
            .clone();
        group.bench_function(BenchmarkId::new("extract", preset), |b| {
            b.iter(|| extractor.extract(&parts, &body).unwrap().unwrap())
        });
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let record = std::sync::Arc::new(CompletedRecord::new(
        tower_idempotency::Fingerprint::of(b"x"),
        StoredResponse::new(
            http::StatusCode::OK,
            http::HeaderMap::new(),
            Bytes::from_static(b"ok"),
        ),
    ));
    let fp = record.fingerprint;
    let counter = AtomicU64::new(0);
    group.bench_function("store/claim+complete", |b| {
        b.iter(|| {
            let key = format!("idem:bench:/n::{}", counter.fetch_add(1, Ordering::Relaxed));
            let token = OwnerToken::new();
            rt.block_on(async {
                let claim = store
                    .claim(&key, fp, token, std::time::Duration::from_secs(30))
                    .await
                    .unwrap();
                assert!(matches!(claim, Claim::Acquired(_)));
                store
                    .complete(
                        &key,
                        token,
                        record.clone(),
                        std::time::Duration::from_secs(3600),
                    )
                    .await
                    .unwrap()
            })
        })
    });
    // Its own completed record: the numbered ones above may have been evicted
    // early by the time this runs (the store keeps to its memory budget).
    const DONE: &str = "idem:bench:/n::done";
    rt.block_on(async {
        let token = OwnerToken::new();
        let claim = store.claim(DONE, fp, token, std::time::Duration::from_secs(30));
        assert!(matches!(claim.await.unwrap(), Claim::Acquired(_)));
        let ttl = std::time::Duration::from_secs(3600);
        store
            .complete(DONE, token, record.clone(), ttl)
            .await
            .unwrap();
    });
    group.bench_function("store/claim-completed", |b| {
        b.iter(|| {
            rt.block_on(async {
                let claim = store
                    .claim(
                        DONE,
                        fp,
                        OwnerToken::new(),
                        std::time::Duration::from_secs(30),
                    )
                    .await
                    .unwrap();
                assert!(matches!(claim, Claim::Completed(_)));
            })
        })
    });

    let reply = tower_idempotency::Preset::wechatpay_v3().reply().clone();
    group.bench_function("normalize/wechatpay-v3", |b| {
        b.iter(|| {
            let res = Response::new(Full::new(Bytes::from_static(b"{\"order\":\"paid\"}")));
            reply.apply(res)
        })
    });
    group.finish();
}

/// The body bytes of a request built by `build`.
fn rt_body(body: Full<Bytes>) -> Bytes {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(body.collect()).unwrap().to_bytes()
}

criterion_group!(benches, bench, per_layer);
criterion_main!(benches);
