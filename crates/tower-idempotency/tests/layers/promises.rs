//! One test (or more) per promise the crate makes, through the real stack:
//! `ServiceBuilder` + `oneshot` for unit-level paths, real hyper servers on
//! 127.0.0.1:0 for end-to-end ones.

use test_support::common;

use bytes::Bytes;
use common::faults::{backend_error, FaultStore, Faults, Op};
use common::{all_at_once, client, post, read, request, serve, Counter};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::store::{MemoryStore, StoreError};
use tower_idempotency::{IdempotencyLayer, OnStoreError, Outcome};

type Res = Response<Full<Bytes>>;

fn ok(body: impl Into<Bytes>) -> Result<Res, Infallible> {
    Ok(Response::new(Full::new(body.into())))
}

fn status(code: u16, body: &'static str) -> Result<Res, Infallible> {
    let mut res = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *res.status_mut() = StatusCode::from_u16(code).unwrap();
    Ok(res)
}

/// A handler that counts its runs, sleeps `ms`, and answers "order N".
fn counting(
    runs: Counter,
    ms: u64,
) -> impl Service<Request<Full<Bytes>>, Response = Res, Error = Infallible, Future = impl Send> + Clone
{
    service_fn(move |_req: Request<Full<Bytes>>| {
        let runs = runs.clone();
        async move {
            let n = runs.bump();
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            ok(format!("order {n}"))
        }
    })
}

fn key_req(key: &str, body: &'static str) -> Request<Full<Bytes>> {
    request("/orders", &[("idempotency-key", key)], body)
}

async fn text<B>(res: Response<B>) -> (u16, String, bool)
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let a = read(res).await;
    (a.status, a.text(), a.replayed())
}

// ---------------------------------------------------------------- P1 Once

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p1_hundred_simultaneous_requests_run_the_handler_once() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 50));
    let answers = all_at_once(128, |_| {
        let svc = svc.clone();
        async move { text(svc.oneshot(key_req("k-1", "{}")).await.unwrap()).await }
    })
    .await;
    assert_eq!(runs.get(), 1);
    for (status, body, _) in &answers {
        assert_eq!(*status, 200);
        assert_eq!(body, "order 1");
    }
    assert_eq!(answers.iter().filter(|a| !a.2).count(), 1, "one original");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p1_end_to_end_storm_over_tcp_runs_each_key_once() {
    let per_key: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>> = Arc::default();
    let seen = per_key.clone();
    let handler = service_fn(move |req: Request<Full<Bytes>>| {
        let seen = seen.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let id = v["id"].as_str().unwrap().to_owned();
            tokio::time::sleep(Duration::from_millis(5)).await;
            *seen.lock().unwrap().entry(id).or_default() += 1;
            ok("done")
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::wechatpay_v3())
        .service(handler);
    let (addr, _server) = serve(svc).await;
    let client = client();
    let answers = all_at_once(20 * 7, |i| {
        let client = client.clone();
        let body = format!(
            r#"{{"id":"evt-{}","event_type":"TRANSACTION.SUCCESS","resource":{{"original_type":"transaction"}}}}"#,
            i % 20
        );
        async move { post(&client, addr, "/notify", &[("content-type", "application/json")], body).await }
    })
    .await;
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.text(), r#"{"code":"SUCCESS","message":"成功"}"#);
    }
    let seen = per_key.lock().unwrap();
    assert_eq!(seen.len(), 20);
    assert!(seen.values().all(|&n| n == 1), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_handler_slower_than_three_leases_still_runs_once() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .lease(Duration::from_millis(250))
                .wait(Duration::from_secs(3)),
        )
        .service(counting(runs.clone(), 900));
    let start = tokio::time::Instant::now();
    let first = tokio::spawn(svc.clone().oneshot(key_req("slow", "{}")));
    let mut later = Vec::new();
    // Copies arrive after the first lease would have run out without renewal.
    for at in [300u64, 550, 800] {
        tokio::time::sleep_until(start + Duration::from_millis(at)).await;
        later.push(tokio::spawn(svc.clone().oneshot(key_req("slow", "{}"))));
    }
    let (s, b, _) = text(first.await.unwrap().unwrap()).await;
    assert_eq!((s, b.as_str()), (200, "order 1"));
    for t in later {
        let (s, b, replayed) = text(t.await.unwrap().unwrap()).await;
        assert_eq!((s, b.as_str(), replayed), (200, "order 1", true));
    }
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn p1_safe_methods_are_not_guarded() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 0));
    for _ in 0..3 {
        let req = Request::get("/orders")
            .header("idempotency-key", "g")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), 200);
    }
    assert_eq!(runs.get(), 3);
}

// ------------------------------------------------- P2 No false acknowledgement

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p2_waiters_never_succeed_before_the_first_and_take_over_when_it_fails() {
    let runs = Counter::default();
    let succeeded_at: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
    let (r, at) = (runs.clone(), succeeded_at.clone());
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let (r, at) = (r.clone(), at.clone());
        async move {
            let n = r.bump();
            tokio::time::sleep(Duration::from_millis(200)).await;
            if n == 1 {
                return status(500, "first attempt failed");
            }
            *at.lock().unwrap() = Some(Instant::now());
            ok(format!("order {n}"))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().wait(Duration::from_secs(3)))
        .service(handler);
    let answers = all_at_once(10, |_| {
        let svc = svc.clone();
        async move {
            let res = svc.oneshot(key_req("p2", "{}")).await.unwrap();
            let done = Instant::now();
            (text(res).await, done)
        }
    })
    .await;
    let success_time = succeeded_at.lock().unwrap().expect("a waiter took over");
    let mut failures = 0;
    for ((status, body, _), done) in answers {
        if status == 200 {
            assert_eq!(body, "order 2");
            assert!(
                done >= success_time,
                "a success was answered before the handler succeeded"
            );
        } else {
            assert_eq!(status, 500);
            failures += 1;
        }
    }
    assert_eq!(
        failures, 1,
        "only the failed attempt itself answers the failure"
    );
    assert_eq!(runs.get(), 2);
}

// ---------------------------------------------------------- P3 Nothing lost

#[tokio::test]
async fn p3_failure_is_not_cached_retry_runs_then_replays() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            if n == 1 {
                status(503, "down")
            } else {
                ok(format!("order {n}"))
            }
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let (s, _, _) = text(svc.clone().oneshot(key_req("f", "{}")).await.unwrap()).await;
    assert_eq!(s, 503);
    let (s, b, replayed) = text(svc.clone().oneshot(key_req("f", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str(), replayed), (200, "order 2", false));
    let (s, b, replayed) = text(svc.clone().oneshot(key_req("f", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str(), replayed), (200, "order 2", true));
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn p3_handler_error_releases_the_claim() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            if n == 1 {
                Err(std::io::Error::other("boom"))
            } else {
                Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from("fine"))))
            }
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    assert!(svc.clone().oneshot(key_req("e", "{}")).await.is_err());
    let res = svc.clone().oneshot(key_req("e", "{}")).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(runs.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_panicking_handler_releases_its_claim() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            if n == 1 {
                panic!("handler bug");
            }
            ok("recovered")
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let res = svc.clone().oneshot(key_req("p", "{}")).await.unwrap();
    assert_eq!(res.status(), 500);
    assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Failed));
    let (s, b, _) = text(svc.clone().oneshot(key_req("p", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str()), (200, "recovered"));
    assert_eq!(runs.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_dropped_request_still_completes_and_is_replayed() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 300));
    // The caller hangs up after 50 ms.
    let cut = tokio::time::timeout(
        Duration::from_millis(50),
        svc.clone().oneshot(key_req("d", "{}")),
    )
    .await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, b, replayed) = text(svc.clone().oneshot(key_req("d", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str(), replayed), (200, "order 1", true));
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_dropped_request_is_cancelled_and_released_when_finishing_is_off() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().finish_on_disconnect(false))
        .service(counting(runs.clone(), 300));
    let cut = tokio::time::timeout(
        Duration::from_millis(50),
        svc.clone().oneshot(key_req("d", "{}")),
    )
    .await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (s, b, replayed) = text(svc.clone().oneshot(key_req("d", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str(), replayed), (200, "order 2", false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_client_hanging_up_over_tcp_still_records_the_result() {
    use tokio::io::AsyncWriteExt;
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 300));
    let (addr, _server) = serve(svc).await;
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    raw.write_all(
        b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: tcp\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(raw); // hang up mid-handler
    tokio::time::sleep(Duration::from_millis(400)).await;
    let a = post(
        &client(),
        addr,
        "/orders",
        &[("idempotency-key", "tcp")],
        "{}",
    )
    .await;
    assert_eq!(
        (a.status, a.text().as_str(), a.replayed()),
        (200, "order 1", true)
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn p3_forged_request_answered_401_does_not_block_the_genuine_one() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |req: Request<Full<Bytes>>| {
        let r = r.clone();
        async move {
            if req
                .headers()
                .get("wechatpay-signature")
                .is_none_or(|v| v != "genuine")
            {
                return status(401, "bad signature");
            }
            r.bump();
            ok("paid")
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::wechatpay_v3())
        .service(handler);
    let body = r#"{"id":"n-1","event_type":"TRANSACTION.SUCCESS","resource":{"original_type":"transaction"}}"#;
    let forged = request("/notify", &[("wechatpay-signature", "forged")], body);
    let res = svc.clone().oneshot(forged).await.unwrap();
    assert_eq!(res.status(), 401);
    let genuine = request("/notify", &[("wechatpay-signature", "genuine")], body);
    let a = read(svc.clone().oneshot(genuine).await.unwrap()).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.text(), r#"{"code":"SUCCESS","message":"成功"}"#);
    assert_eq!(runs.get(), 1);
}

// ------------------------------------------------------ P4 Faithful replay

#[tokio::test]
async fn p4_replay_keeps_status_headers_body_and_trailers_without_hop_by_hop() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        r.bump();
        async move {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            trailers.insert("x-checksum", "abc".parse().unwrap());
            let frames = vec![
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"part1,"))),
                Ok(http_body::Frame::data(Bytes::from_static(b"part2"))),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            let res = Response::builder()
                .status(201)
                .header("content-type", "application/grpc")
                .header("x-order", "42")
                .header("connection", "x-hop")
                .header("x-hop", "secret")
                .header("keep-alive", "timeout=5")
                .body(body)
                .unwrap();
            Ok::<_, Infallible>(res)
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    let first = read(svc.clone().oneshot(key_req("t", "{}")).await.unwrap()).await;
    let again = read(svc.clone().oneshot(key_req("t", "{}")).await.unwrap()).await;
    assert_eq!(runs.get(), 1);
    assert_eq!(first.status, 201);
    assert_eq!(again.status, 201);
    assert_eq!(again.body, "part1,part2");
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["x-order"], "42");
    assert_eq!(again.headers["idempotent-replayed"], "true");
    for hop in ["connection", "x-hop", "keep-alive"] {
        assert!(again.headers.get(hop).is_none(), "{hop} replayed");
    }
    let trailers = again.trailers.expect("trailers replayed");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-checksum"], "abc");
}

#[tokio::test]
async fn p4_grpc_error_status_is_not_cached() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        let n = r.bump();
        async move {
            // Trailers-only error first, then an error in trailers, then success.
            let code = match n {
                1 => None,
                2 => Some("14"),
                _ => Some("0"),
            };
            let mut res = Response::builder()
                .status(200)
                .header("content-type", "application/grpc");
            if code.is_none() {
                res = res.header("grpc-status", "5");
            }
            let mut frames = vec![Ok::<_, Infallible>(http_body::Frame::data(
                Bytes::from_static(b"\0\0\0\0\0"),
            ))];
            if let Some(code) = code {
                let mut t = http::HeaderMap::new();
                t.insert("grpc-status", code.parse().unwrap());
                frames.push(Ok(http_body::Frame::trailers(t)));
            }
            Ok::<_, Infallible>(
                res.body(StreamBody::new(futures_util::stream::iter(frames)))
                    .unwrap(),
            )
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(handler);
    for expected_runs in 1..=3 {
        let res = svc.clone().oneshot(key_req("g", "{}")).await.unwrap();
        assert!(!common::read(res).await.replayed());
        assert_eq!(runs.get(), expected_runs);
    }
    let again = read(svc.clone().oneshot(key_req("g", "{}")).await.unwrap()).await;
    assert!(again.replayed());
    assert_eq!(again.trailers.unwrap()["grpc-status"], "0");
    assert_eq!(runs.get(), 3);
}

#[tokio::test]
async fn p4_body_over_the_cache_limit_completes_without_a_body() {
    let runs = Counter::default();
    let r = runs.clone();
    let handler = service_fn(move |_req: Request<Full<Bytes>>| {
        r.bump();
        async move { ok(vec![b'x'; 4096]) }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().max_cached_body_bytes(1024))
        .service(handler);
    let first = read(svc.clone().oneshot(key_req("big", "{}")).await.unwrap()).await;
    assert_eq!(first.body.len(), 4096);
    let again = read(svc.clone().oneshot(key_req("big", "{}")).await.unwrap()).await;
    assert_eq!(again.status, 200);
    assert!(again.replayed());
    assert_eq!(again.headers["idempotent-body-omitted"], "true");
    assert!(again.body.is_empty());
    assert_eq!(runs.get(), 1);
}

// ---------------------------------------------- P5 Same key, other payload

#[tokio::test]
async fn p5_same_key_other_payload_is_refused_422() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 0));
    let (s, _, _) = text(
        svc.clone()
            .oneshot(key_req("m", r#"{"amount":1}"#))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    let res = svc
        .clone()
        .oneshot(key_req("m", r#"{"amount":1000}"#))
        .await
        .unwrap();
    assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Mismatch));
    let (s, b, replayed) = text(res).await;
    assert_eq!(s, 422);
    assert!(!replayed);
    assert!(b.contains("different"), "{b}");
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_mismatch_while_in_flight_is_refused_at_once() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 300));
    let first = tokio::spawn(svc.clone().oneshot(key_req("mf", r#"{"a":1}"#)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    let (s, _, _) = text(
        svc.clone()
            .oneshot(key_req("mf", r#"{"a":2}"#))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 422);
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "did not wait"
    );
    first.await.unwrap().unwrap();
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn p5_channel_mismatch_gets_the_failure_reply() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::alipay())
        .service(counting(runs.clone(), 0));
    let paid =
        "notify_id=n1&out_trade_no=o1&trade_no=t1&trade_status=TRADE_SUCCESS&total_amount=0.10";
    let forged =
        "notify_id=n1&out_trade_no=o1&trade_no=t1&trade_status=TRADE_SUCCESS&total_amount=999.00";
    let a = read(
        svc.clone()
            .oneshot(request("/alipay", &[], paid))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((a.status, a.text().as_str()), (200, "success"));
    let b = read(
        svc.clone()
            .oneshot(request("/alipay", &[], forged))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((b.status, b.text().as_str()), (500, "fail"));
    assert_eq!(runs.get(), 1);
}

// ------------------------------------------------------------- P6 Bounded

#[tokio::test]
async fn p6_bounds_answer_413_and_400() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().max_body_bytes(1024))
        .service(counting(runs.clone(), 0));
    // Body over the limit (declared and streamed).
    let big = Bytes::from(vec![b'a'; 2048]);
    let (s, _, _) = text(
        svc.clone()
            .oneshot(request("/o", &[("idempotency-key", "b")], big.clone()))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 413);
    let chunks = futures_util::stream::iter(
        big.chunks(100)
            .map(|c| Ok::<_, Infallible>(http_body::Frame::data(Bytes::copy_from_slice(c))))
            .collect::<Vec<_>>(),
    );
    let streamed = Request::post("/o")
        .header("idempotency-key", "b")
        .body(StreamBody::new(chunks))
        .unwrap();
    let res = svc.clone().oneshot(streamed).await.unwrap();
    assert_eq!(res.status(), 413);
    // Missing key.
    let (s, b, _) = text(svc.clone().oneshot(request("/o", &[], "{}")).await.unwrap()).await;
    assert_eq!(s, 400);
    assert!(b.contains("Idempotency-Key"), "{b}");
    // Key too long.
    let long = "k".repeat(257);
    let (s, b, _) = text(
        svc.clone()
            .oneshot(request("/o", &[("idempotency-key", &long)], "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 400);
    assert!(b.contains("256"), "{b}");
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn p6_malformed_channel_body_gets_400_naming_what_was_expected() {
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::wechatpay_v3())
        .service(counting(Counter::default(), 0));
    let res = svc
        .clone()
        .oneshot(request("/n", &[], r#"{"id": "x""#))
        .await
        .unwrap();
    let a = read(res).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.text(), r#"{"code":"FAIL","message":"失败"}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p6_in_flight_answers_409_with_retry_after_when_waiting_is_off_or_exhausted() {
    for wait in [Duration::ZERO, Duration::from_millis(100)] {
        let runs = Counter::default();
        let svc = ServiceBuilder::new()
            .layer(IdempotencyLayer::idempotency_key().wait(wait))
            .service(counting(runs.clone(), 500));
        let first = tokio::spawn(svc.clone().oneshot(key_req("w", "{}")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let res = svc.clone().oneshot(key_req("w", "{}")).await.unwrap();
        assert_eq!(res.status(), 409);
        assert_eq!(res.headers()["retry-after"], "1");
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        assert_eq!(runs.get(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p6_in_flight_timeout_in_channel_form_is_the_failure_reply() {
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::wechatpay_v2().wait(Duration::from_millis(50)))
        .service(counting(Counter::default(), 400));
    let body = "<xml><transaction_id>t1</transaction_id><out_trade_no>o</out_trade_no><total_fee>1</total_fee><result_code>SUCCESS</result_code></xml>";
    let first = tokio::spawn(svc.clone().oneshot(request("/n", &[], body)));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let a = read(svc.clone().oneshot(request("/n", &[], body)).await.unwrap()).await;
    assert_eq!(a.status, 500);
    assert_eq!(
        a.text(),
        "<xml><return_code><![CDATA[FAIL]]></return_code><return_msg><![CDATA[FAIL]]></return_msg></xml>"
    );
    let ok = read(first.await.unwrap().unwrap()).await;
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn p6_window_expiry_runs_again() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().window(Duration::from_millis(200)))
        .service(counting(runs.clone(), 0));
    svc.clone().oneshot(key_req("x", "{}")).await.unwrap();
    let (_, _, replayed) = text(svc.clone().oneshot(key_req("x", "{}")).await.unwrap()).await;
    assert!(replayed);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (_, b, replayed) = text(svc.clone().oneshot(key_req("x", "{}")).await.unwrap()).await;
    assert_eq!((b.as_str(), replayed), ("order 2", false));
}

#[tokio::test]
async fn p6_memory_store_evicts_at_capacity_and_counts_it() {
    let store = MemoryStore::builder().max_bytes(16 * 1024).build();
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().with_store(store.clone()))
        .service(counting(runs.clone(), 0));
    for i in 0..500 {
        svc.clone()
            .oneshot(key_req(&format!("e{i}"), "{}"))
            .await
            .unwrap();
    }
    assert!(store.evicted_early() > 0, "nothing evicted");
    assert!(store.len() < 500);
    // An evicted key runs again, as documented.
    let before = runs.get();
    for i in 0..500 {
        svc.clone()
            .oneshot(key_req(&format!("e{i}"), "{}"))
            .await
            .unwrap();
    }
    assert!(runs.get() > before);
}

#[tokio::test]
async fn p6_keys_are_scoped_by_route_and_principal() {
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key())
        .service(counting(runs.clone(), 0));
    let alice = [
        ("idempotency-key", "same"),
        ("authorization", "Bearer alice"),
    ];
    let bob = [("idempotency-key", "same"), ("authorization", "Bearer bob")];
    let (_, a, _) = text(
        svc.clone()
            .oneshot(request("/orders", &alice, "{}"))
            .await
            .unwrap(),
    )
    .await;
    let (_, b, replayed) = text(
        svc.clone()
            .oneshot(request("/orders", &bob, "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (a.as_str(), b.as_str(), replayed),
        ("order 1", "order 2", false)
    );
    let (_, c, _) = text(
        svc.clone()
            .oneshot(request("/refunds", &alice, "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(c, "order 3");
}

// ------------------------------------------------------- P7 Store down

/// The memory store behind switches: `down` makes every call fail; `late`
/// makes a claim answer 500 ms after the store acted (the layer times out,
/// the claim is made).
#[derive(Clone, Default)]
struct Switches {
    down: Arc<AtomicBool>,
    late: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Faults for Switches {
    async fn before(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        if matches!(op, Op::PutToken | Op::TakeToken) {
            return Ok(());
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            Err(backend_error("connection refused"))
        } else {
            Ok(())
        }
    }
    async fn after(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        if op == Op::Claim && self.late.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(())
    }
}

type Switchable = FaultStore<Switches>;

#[tokio::test]
async fn p7_fail_closed_answers_retryable_and_recovers() {
    let store = Switchable::default();
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::wechatpay_v3().with_store(store.clone()))
        .service(counting(runs.clone(), 0));
    let body = r#"{"id":"s1","event_type":"TRANSACTION.SUCCESS","resource":{"original_type":"transaction"}}"#;
    store.down.store(true, Ordering::SeqCst);
    let a = read(svc.clone().oneshot(request("/n", &[], body)).await.unwrap()).await;
    assert_eq!(
        (a.status, a.text().as_str()),
        (500, r#"{"code":"FAIL","message":"失败"}"#)
    );
    assert_eq!(runs.get(), 0, "nothing ran while the store was down");
    store.down.store(false, Ordering::SeqCst);
    let a = read(svc.clone().oneshot(request("/n", &[], body)).await.unwrap()).await;
    assert_eq!(a.status, 200);
    let a = read(svc.clone().oneshot(request("/n", &[], body)).await.unwrap()).await;
    assert!(a.replayed());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn p7_fail_closed_client_api_is_503_with_retry_after() {
    let store = Switchable::default();
    store.down.store(true, Ordering::SeqCst);
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::idempotency_key().with_store(store.clone()))
        .service(counting(Counter::default(), 0));
    let res = svc.oneshot(key_req("s", "{}")).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
}

#[tokio::test]
async fn p7_fail_open_passes_through_and_is_marked() {
    let store = Switchable::default();
    store.down.store(true, Ordering::SeqCst);
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(store.clone())
                .on_store_error(OnStoreError::FailOpen),
        )
        .service(counting(runs.clone(), 0));
    for _ in 0..2 {
        let res = svc.clone().oneshot(key_req("o", "{}")).await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(
            res.extensions().get::<Outcome>(),
            Some(&Outcome::PassedThrough)
        );
    }
    assert_eq!(runs.get(), 2, "fail-open relies on the business backstop");
}

/// A store whose calls never answer: the store timeout must bound them.
#[derive(Clone, Default)]
struct Hang;

impl Faults for Hang {
    async fn before(&self, _: Op, _: &str) -> Result<(), StoreError> {
        std::future::pending().await
    }
}

#[tokio::test]
async fn p7_every_store_call_has_a_timeout() {
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(FaultStore::new(Hang))
                .store_timeout(Duration::from_millis(100)),
        )
        .service(counting(Counter::default(), 0));
    let started = Instant::now();
    let res = svc.oneshot(key_req("h", "{}")).await.unwrap();
    assert_eq!(res.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_a_claim_that_timed_out_is_released_not_left_for_a_lease() {
    let store = Switchable::default();
    store.late.store(true, Ordering::SeqCst);
    let runs = Counter::default();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::idempotency_key()
                .with_store(store.clone())
                .store_timeout(Duration::from_millis(100))
                .wait(Duration::ZERO),
        )
        .service(counting(runs.clone(), 0));
    let res = svc.clone().oneshot(key_req("late", "{}")).await.unwrap();
    assert_eq!(res.status(), 503);
    store.late.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Without the release this would be 409 for the whole 30 s lease.
    let (s, b, _) = text(svc.clone().oneshot(key_req("late", "{}")).await.unwrap()).await;
    assert_eq!((s, b.as_str()), (200, "order 1"));
}
