//! Cost of verifying one notification, per channel: the verify layer alone
//! (buffering, signature check, decryption where configured) over a trivial
//! inner service, with the recorded vectors of `tests/fixtures/` and their keys.
//!
//! The hostile-header cases time one verification at the 64 KiB body limit
//! with a 400 KB signature list (refused: more than 16 candidates) and with
//! the longest list accepted (16 candidates, the genuine one last); the
//! budget is 100 µs per verification whatever the header.
//!
//! The hostile-body cases time the refusal of a 64 KiB body made of as many
//! fields as fit, for every channel, with the vector's headers: Alipay with
//! about 9,500 parameters, WeChat Pay v2 with about 8,300 empty elements,
//! Adyen, PayPal, Stripe, Standard Webhooks and WeChat Pay v3 with about
//! 6,700 JSON members; the budget is 1 ms per refusal (the duplicate checks
//! were quadratic: Alipay's took 160 ms).
//!
//! `cargo bench -p idempotency-bench --bench verify`

use test_support::verify_support;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use std::convert::Infallible;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::verify::{
    StandardWebhooksKeys, StripeKeys, VerifyBody, VerifyLayer, WechatPayV3Keys,
};
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
    // The vector must verify (or be refused where the case says so), or the
    // bench would time something else.
    let expected = if name.contains("refused") {
        StatusCode::UNAUTHORIZED
    } else {
        StatusCode::OK
    };
    let res = rt.block_on(svc.clone().oneshot(request(case))).unwrap();
    assert_eq!(res.status(), expected, "{name}");
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
            // Transmission ids are single-use: after the first, every
            // iteration checks the signature and is then refused as replayed.
            "paypal" => "paypal (signature checked, later copies replays)",
            other => other,
        };
        bench_case(c, &rt, name, case.keys.clone(), &case);
    }
    hostile_headers(c, &rt);
    hostile_bodies(c, &rt);
    configured(c, &rt);
}

/// The configured HMAC schemes ([`HmacScheme`]) at the 64 KiB body limit:
/// GitHub (`sha256=` hex over the body), Slack (`v0:{timestamp}:{body}`),
/// Square (`{url}{body}`, base64), Paddle (`ts`/`h1` pairs) with 16
/// candidates and with a 400 KB header (refused), and a signed body of
/// about 6,700 JSON members repeating one (refused: one parse).
fn configured(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    use base64::Engine;
    use tower_idempotency::verify::{BodyShape, HmacAlgorithm, HmacScheme, SignatureEncoding};
    let b64 = base64::engine::general_purpose::STANDARD;
    let now = 1_700_000_000u64;
    let t = now.to_string();
    let body = body_at_limit();
    let secret = b"configured secret";
    let hexed = |mac: Vec<u8>| mac.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let case = |body: Vec<u8>, headers: Vec<(&str, String)>| Case {
        name: "configured",
        keys: VerifyLayer::off(),
        body,
        headers: headers
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        now,
        tamper: ("", ""),
        header_tamper: None,
        tolerance: None,
    };
    let scheme = |name: &str, header: &str| {
        HmacScheme::builder(name.to_owned(), HmacAlgorithm::Sha256, header).secret(secret)
    };

    let github = scheme("github", "x-hub-signature-256").prefix("sha256=");
    let sig = format!("sha256={}", hexed(hmac(secret, &[&body])));
    let github_case = case(body.clone(), vec![("x-hub-signature-256", sig)]);
    let layer = VerifyLayer::new(github.clone().build().unwrap());
    bench_case(c, rt, "configured github 64 KiB", layer, &github_case);

    let slack = scheme("slack", "x-slack-signature")
        .prefix("v0=")
        .signed("v0:{timestamp}:{body}".parse().unwrap())
        .timestamp_header("x-slack-request-timestamp");
    let sig = format!(
        "v0={}",
        hexed(hmac(secret, &[b"v0:", t.as_bytes(), b":", &body]))
    );
    let slack_case = case(
        body.clone(),
        vec![
            ("x-slack-signature", sig),
            ("x-slack-request-timestamp", t.clone()),
        ],
    );
    let layer = VerifyLayer::new(slack.build().unwrap());
    bench_case(c, rt, "configured slack 64 KiB", layer, &slack_case);

    let url = "https://example.com/hooks/square";
    let square = scheme("square", "x-square-hmacsha256-signature")
        .encoding(SignatureEncoding::Base64)
        .signed("{url}{body}".parse().unwrap())
        .url(url, "/notify");
    let sig = b64.encode(hmac(secret, &[url.as_bytes(), &body]));
    let square_case = case(body.clone(), vec![("x-square-hmacsha256-signature", sig)]);
    let layer = VerifyLayer::new(square.build().unwrap());
    bench_case(c, rt, "configured square 64 KiB", layer, &square_case);

    let paddle = || {
        let scheme = scheme("paddle", "paddle-signature")
            .signature_field("h1")
            .timestamp_field("ts")
            .signed("{timestamp}:{body}".parse().unwrap());
        VerifyLayer::new(scheme.build().unwrap())
    };
    let genuine = hexed(hmac(secret, &[t.as_bytes(), b":", &body]));
    let sixteen = format!("ts={t};{}h1={genuine}", "h1=00;".repeat(15));
    let mut long = format!("ts={t};");
    while long.len() < 400 * 1024 {
        long.push_str("h1=;");
    }
    for (name, header) in [
        ("configured paddle 64 KiB, 16 candidates", sixteen),
        ("configured paddle 64 KiB, 400 KB header, refused", long),
    ] {
        let case = case(body.clone(), vec![("paddle-signature", header)]);
        bench_case(c, rt, name, paddle(), &case);
    }

    // The last member repeats the first.
    let (members, _) = fields_at_limit("{", r#","id":"b"}"#, |i| {
        if i == 0 {
            r#""id":"a""#.to_owned()
        } else {
            format!(r#","f{i}":1"#)
        }
    });
    let sig = format!("sha256={}", hexed(hmac(secret, &[&members])));
    let dup_case = case(members, vec![("x-hub-signature-256", sig)]);
    let layer = VerifyLayer::new(github.body_shape(BodyShape::Json).build().unwrap());
    bench_case(
        c,
        rt,
        "configured github 64 KiB of JSON members, repeated member refused",
        layer,
        &dup_case,
    );
}

/// `field(i)` repeated from `open` to `close` until the body holds 64 KiB.
fn fields_at_limit(open: &str, close: &str, field: impl Fn(usize) -> String) -> (Vec<u8>, usize) {
    let mut body = open.as_bytes().to_vec();
    let mut n = 0;
    loop {
        let next = field(n);
        if body.len() + next.len() + close.len() > 64 * 1024 {
            break;
        }
        body.extend_from_slice(next.as_bytes());
        n += 1;
    }
    body.extend_from_slice(close.as_bytes());
    (body, n)
}

fn hostile_bodies(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let alipay = fields_at_limit("", "sign=AAAA", |i| format!("p{i}=&"));
    let wechat = fields_at_limit("<xml>", "</xml>", |i| format!("<e{i}/>"));
    let json = fields_at_limit("{", r#""z":0}"#, |i| format!(r#""m{i}":0,"#));
    for case in cases() {
        let (body, what) = match case.name {
            "alipay trade_status_sync (without sign_type)" => (&alipay, "parameters"),
            "wechatpay-v2 md5" => (&wechat, "empty elements"),
            "wechatpay-v3" | "stripe" | "standard-webhooks go" | "adyen colon" | "paypal" => {
                (&json, "JSON members")
            }
            _ => continue,
        };
        let channel = case.name.split(' ').next().unwrap_or(case.name);
        let name = format!("{channel} 64 KiB, {} {what}, refused", body.1);
        let hostile = Case {
            body: body.0.clone(),
            ..case
        };
        bench_case(c, rt, &name, hostile.keys.clone(), &hostile);
    }
}

/// A 64 KiB JSON body (the body limit).
fn body_at_limit() -> Vec<u8> {
    let mut body = br#"{"id":"evt_limit","type":"charge.succeeded","pad":""#.to_vec();
    body.resize(64 * 1024 - 2, b'x');
    body.extend_from_slice(br#""}"#);
    body
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut ctx = ring::hmac::Context::with_key(&key);
    for p in parts {
        ctx.update(p);
    }
    ctx.sign().as_ref().to_vec()
}

fn hostile_headers(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let now = 1_700_000_000u64;
    let body = body_at_limit();
    let t = now.to_string();
    let case = |headers: Vec<(String, String)>| Case {
        name: "hostile",
        keys: VerifyLayer::off(),
        body: body.clone(),
        headers,
        now,
        tamper: ("", ""),
        header_tamper: None,
        tolerance: None,
    };

    let secret = "whsec_test_secret";
    let stripe = || VerifyLayer::new(StripeKeys::new().secret(secret).unwrap());
    let genuine: String = hmac(secret.as_bytes(), &[t.as_bytes(), b".", &body])
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut long = format!("t={t},");
    while long.len() < 400 * 1024 {
        long.push_str("v1=,");
    }
    let sixteen = format!("t={t},{}v1={genuine}", "v1=00,".repeat(15));
    for (name, header) in [
        ("stripe 64 KiB, 400 KB header, refused", long),
        ("stripe 64 KiB, 16 candidates", sixteen),
    ] {
        let case = case(vec![("stripe-signature".into(), header)]);
        bench_case(c, rt, name, stripe(), &case);
    }

    let sw_secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    let raw = b64.decode(&sw_secret[6..]).unwrap();
    let sw = || VerifyLayer::new(StandardWebhooksKeys::new().secret(sw_secret).unwrap());
    let id = "msg_limit";
    let genuine = b64.encode(hmac(
        &raw,
        &[id.as_bytes(), b".", t.as_bytes(), b".", &body],
    ));
    let mut long = String::new();
    while long.len() < 400 * 1024 {
        long.push_str("v1,AAAA ");
    }
    let sixteen = format!("{}v1,{genuine}", "v1,AAAA ".repeat(15));
    for (name, header) in [
        ("standard-webhooks 64 KiB, 400 KB header, refused", long),
        ("standard-webhooks 64 KiB, 16 candidates", sixteen),
    ] {
        let case = case(vec![
            ("webhook-id".into(), id.into()),
            ("webhook-timestamp".into(), t.clone()),
            ("webhook-signature".into(), header),
        ]);
        bench_case(c, rt, name, sw(), &case);
    }
}

criterion_group!(benches, verify);
criterion_main!(benches);
