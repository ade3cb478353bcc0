//! Cost of verifying one notification, per channel: the verify layer alone
//! (buffering, signature check, decryption where configured) over a trivial
//! inner service, with the recorded vectors of `tests/fixtures/` and their keys.
//!
//! `cargo bench --features verify --bench verify`

#[path = "../tests/verify_support/mod.rs"]
mod verify_support;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::convert::Infallible;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::verify::{VerifyBody, VerifyLayer, WechatPayV3Keys};
use verify_support::{at, cases, fixture, wechatpay_v3, Case};

fn request(case: &Case) -> Request<Full<Bytes>> {
    let mut req = Request::post("/notify");
    for (k, v) in &case.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    req.body(Full::new(Bytes::from(case.body.clone()))).unwrap()
}

fn bench_case(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    name: &str,
    keys: VerifyLayer,
    case: &Case,
) {
    let now = case.now;
    let svc = keys.clock(move || at(now)).layer(service_fn(
        |_req: Request<VerifyBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
        },
    ));
    // The vector must verify, or the bench would time a refusal.
    let res = rt.block_on(svc.clone().oneshot(request(case))).unwrap();
    assert_eq!(res.status(), StatusCode::OK, "{name} did not verify");
    c.bench_with_input(BenchmarkId::new("verify", name), case, |b, case| {
        b.to_async(rt).iter(|| svc.clone().oneshot(request(case)));
    });
}

fn verify(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let v3 = wechatpay_v3();
    let signature_only = WechatPayV3Keys::new()
        .platform_key(
            "D7CE59D1F522D701",
            fixture("wechatpay_v3_platform_cert.pem"),
        )
        .unwrap();
    bench_case(
        c,
        &rt,
        "wechatpay-v3 signature only",
        VerifyLayer::new(signature_only),
        &v3,
    );
    for case in cases() {
        let name = match case.name {
            "wechatpay-v3" => "wechatpay-v3 signature + AES-GCM decryption",
            other => other,
        };
        bench_case(c, &rt, name, case.keys.clone(), &case);
    }
}

criterion_group!(benches, verify);
criterion_main!(benches);
