//! The gateway binary as a real process in front of
//! the recording upstream (`tests/common/upstream.rs`), with every preset's
//! vectors from the shared table (`tests/common/vectors.rs`): explicit
//! routes and `auto` detection, 7 copies at once, one upstream call, the
//! channel's exact reply bytes; unrecognized requests pass through every
//! time; body limits, principals, windows, client tokens, HTTP/2; two
//! serving threads sharing one store.
//! Forwarding, upstream failures, signals and Redis are in
//! `gateway_upstream.rs`; flags and metrics in `gateway_flags.rs`.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::vectors::{ALIPAY_VECTORS, FORM, STRIPE_VECTORS, WECHATPAY_V3_VECTORS};
use common::{all_at_once, client, Answer, HttpClient};
use gateway_support::storm::{
    assert_success, headers_with, presets, send, send_vector, storm, vectors, Headers, K,
};
use gateway_support::Gateway;
use http::Request;
use http_body_util::Full;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_routes_run_each_vector_once_and_answer_the_channel_reply() {
    let up = Upstream::start().await;
    // A route per vector: a route's records are shared by every path under
    // it, and some vectors of one channel carry the same key.
    let mut routes: Vec<String> = presets()
        .flat_map(|p| ["--route".to_owned(), format!("/p/{p}={p}")])
        .collect();
    for (i, v) in vectors().enumerate() {
        let p = v.channel.name;
        routes.extend(["--route".to_owned(), format!("/p/{p}/{i}={p}")]);
    }
    let args: Vec<&str> = routes.iter().map(String::as_str).collect();
    let gw = Gateway::start(&up.url(), &args);
    let client = client();
    for (i, v) in vectors().enumerate() {
        storm(&client, &gw, &up, v, &format!("/p/{}/{i}", v.channel.name)).await;
    }
    // Longest prefix wins: `/p/stripe/...` is not `auto` nor another preset;
    // a path under no route passes through untouched.
    let stripe = &STRIPE_VECTORS[0];
    for _ in 0..2 {
        let a = send_vector(&client, &gw.url("/elsewhere"), stripe).await;
        assert!(a.text().starts_with("upstream call"), "{}", a.text());
    }
    assert_eq!(up.calls("/elsewhere"), 2);
    assert!(gw.more_stdout().is_empty(), "one stdout line only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_detects_every_channel_and_passes_the_rest_through() {
    let up = Upstream::start().await;
    // An `auto` route per vector (some vectors of one channel carry the same
    // key, and every path under a route shares its records), and `/=auto`.
    let mut routes = vec!["--route".to_owned(), "/=auto".to_owned()];
    for i in 0..vectors().count() {
        routes.extend(["--route".to_owned(), format!("/hooks/{i}=auto")]);
    }
    let args: Vec<&str> = routes.iter().map(String::as_str).collect();
    let gw = Gateway::start(&up.url(), &args);
    let client = client();
    for (i, v) in vectors().enumerate() {
        storm(&client, &gw, &up, v, &format!("/hooks/{i}")).await;
    }

    // Nothing to recognize: every copy reaches the upstream, untouched.
    let plain: Vec<(&str, Headers, &str)> = vec![
        (
            "/plain/json",
            vec![("content-type".into(), "application/json".into())],
            r#"{"id":"evt_1","type":"charge.succeeded"}"#,
        ),
        (
            "/plain/xml",
            vec![("content-type".into(), "text/xml".into())],
            "<xml><out_trade_no>1</out_trade_no></xml>",
        ),
        (
            "/plain/form",
            vec![("content-type".into(), FORM.1.into())],
            "out_trade_no=1&trade_status=TRADE_SUCCESS",
        ),
        ("/plain/text", vec![], "hello"),
    ];
    for (path, headers, body) in plain {
        let answers = all_at_once(3, |_| {
            let (client, url, headers) = (client.clone(), gw.url(path), headers.clone());
            async move { send(&client, &url, &headers, body).await }
        })
        .await;
        let mut texts: Vec<String> = answers.iter().map(Answer::text).collect();
        texts.sort();
        let want: Vec<String> = (1..=3)
            .map(|n| format!("upstream call {n} for {path}"))
            .collect();
        assert_eq!(texts, want, "{path}");
        assert!(answers.iter().all(|a| a.status == 200 && !a.replayed()));
        assert_eq!(up.calls(path), 3, "{path}");
        assert_eq!(up.last(path).body, body.as_bytes(), "{path}");
    }
    // A GET passes too, with its query.
    let res = client
        .request(
            Request::get(gw.url("/plain/get?a=1&b=two"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let a = common::read(res).await;
    assert_eq!(a.text(), "upstream call 1 for /plain/get");
    assert_eq!(up.last("/plain/get").uri, "/plain/get?a=1&b=two");
    assert_eq!(up.last("/plain/get").method, "GET");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_limits_get_413_and_never_reach_the_upstream() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &[]);
    let client = client();
    // An Alipay notification padded past the channel limit (64 KiB): `auto`
    // detects it, the alipay stack refuses it.
    let v = &ALIPAY_VECTORS[0];
    let mut padded = v.base().body.to_vec();
    padded.extend_from_slice(b"&pad=");
    padded.resize(65 * 1024, b'x');
    let a = send(&client, &gw.url("/big/alipay"), &v.base().headers, padded).await;
    assert_eq!(a.status, 413, "{}", a.text());
    // Anything past the largest limit (1 MiB) is refused before detection.
    let a = send(
        &client,
        &gw.url("/big/plain"),
        &[],
        vec![b'x'; (1 << 20) + 1],
    )
    .await;
    assert_eq!(a.status, 413, "{}", a.text());
    assert_eq!(up.calls("/big/alipay") + up.calls("/big/plain"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principal_header_max_body_and_window_shape_the_stack() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/t=idempotency-key",
            "--principal-header",
            "x-tenant",
            "--max-body",
            "2KiB",
            "--window",
            "1s",
        ],
    );
    let client = client();
    let headers = |tenant: &str| -> Headers {
        vec![
            ("idempotency-key".into(), "order-1".into()),
            ("x-tenant".into(), tenant.into()),
        ]
    };
    let body = r#"{"sku":"tea"}"#;
    // One key, two tenants: two records.
    let a = send(&client, &gw.url("/t"), &headers("a"), body).await;
    assert_eq!(a.text(), "upstream call 1 for /t");
    let b = send(&client, &gw.url("/t"), &headers("b"), body).await;
    assert_eq!(b.text(), "upstream call 2 for /t");
    let again = send(&client, &gw.url("/t"), &headers("a"), body).await;
    assert_eq!(again.text(), "upstream call 1 for /t");
    assert!(again.replayed());
    // 2 KiB limit.
    let big = send(&client, &gw.url("/t"), &headers("c"), vec![b'x'; 3 * 1024]).await;
    assert_eq!(big.status, 413);
    assert_eq!(up.calls("/t"), 2);
    // After the 1 s window the key runs again.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let later = send(&client, &gw.url("/t"), &headers("a"), body).await;
    assert_eq!(later.text(), "upstream call 3 for /t");
    assert!(!later.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_token_route_issues_tokens_and_runs_each_once() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &["--route", "/orders=client-token"]);
    let client = client();
    let auth = ("authorization".to_owned(), "Bearer user-1".to_owned());
    let res = client
        .request(
            Request::get(gw.url("/orders/idempotency-token"))
                .header("authorization", "Bearer user-1")
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let issued = common::read(res).await;
    assert_eq!(issued.status, 200, "{}", issued.text());
    let json: serde_json::Value = serde_json::from_slice(&issued.body).unwrap();
    let token = json["token"].as_str().unwrap().to_owned();
    assert_eq!(up.calls("/orders/idempotency-token"), 0);

    let headers: Headers = vec![auth.clone(), ("idempotency-token".into(), token)];
    let answers = all_at_once(K, |_| {
        let (client, url, headers) = (client.clone(), gw.url("/orders"), headers.clone());
        async move { send(&client, &url, &headers, r#"{"sku":"tea"}"#).await }
    })
    .await;
    for a in &answers {
        assert_eq!(
            (a.status, a.text().as_str()),
            (200, "upstream call 1 for /orders")
        );
    }
    assert_eq!(up.calls("/orders"), 1);
    // A token nobody issued is refused before the upstream.
    let forged: Headers = vec![auth, ("idempotency-token".into(), "00ff".repeat(8))];
    let a = send(&client, &gw.url("/orders"), &forged, r#"{"sku":"tea"}"#).await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(up.calls("/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served_too() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &[]);
    // h2c with prior knowledge: every copy on one multiplexed connection.
    let h2: HttpClient = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let v = &STRIPE_VECTORS[0];
    let answers = all_at_once(K, |_| {
        let (client, url, headers, body) =
            (h2.clone(), gw.url("/h2"), v.base().headers, v.base().body);
        async move { send(&client, &url, &headers, body).await }
    })
    .await;
    for a in &answers {
        assert_success(v, a, "/h2", "h2");
    }
    assert_eq!(up.calls("/h2"), 1);
}

/// `--workers 2`: 32 connections at once, 8 copies each of 4 notifications
/// (one per route; the upstream takes 300 ms, so copies wait for the
/// first), spread by the kernel over both serving threads. Every copy gets
/// the success reply and each notification reaches the upstream once: the
/// threads share one store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_serving_threads_run_each_notification_once() {
    const NOTES: usize = 4;
    const COPIES: usize = 8;
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/wx/0=wechatpay-v3,/wx/1=wechatpay-v3,/wx/2=wechatpay-v3,/wx/3=wechatpay-v3",
            "--workers",
            "2",
        ],
    );
    let v = &WECHATPAY_V3_VECTORS[0];
    let headers: Headers = headers_with(v, &[("x-delay-ms", "300")]);
    let answers = all_at_once(NOTES * COPIES, |i| {
        let (url, headers, body) = (
            gw.url(&format!("/wx/{}", i % NOTES)),
            headers.clone(),
            v.base().body,
        );
        // A client of its own: one connection per copy.
        async move { send(&client(), &url, &headers, body).await }
    })
    .await;
    for (i, a) in answers.iter().enumerate() {
        assert_success(v, a, "/wx", &format!("copy {i} of /wx/{}", i % NOTES));
    }
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, NOTES * (COPIES - 1), "replayed copies");
    for n in 0..NOTES {
        assert_eq!(
            up.calls(&format!("/wx/{n}")),
            1,
            "upstream calls of /wx/{n}"
        );
    }
    assert_eq!(up.total(), NOTES);
}
