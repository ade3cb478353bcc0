//! The gateway as a real process between a client and the
//! recording upstream (`tests/common/upstream.rs`): forwarding (the
//! request's own bytes, path and query, `x-forwarded-for` appended,
//! hop-by-hop headers removed, `Host` set); an HTTP/1.0 upstream; upstream
//! refused or too slow (the channel's failure reply, never cached); an
//! unrequested `101 Switching Protocols` (502, never relayed); SIGTERM
//! with a request in flight (one and two serving threads) and SIGINT when
//! idle (exit 0); two instances
//! sharing Redis and Redis Cluster; the upstream's
//! keep-alive connections (reused, never used once closed, closed when an
//! answer is cut off or idle past the pool's timeout; a randomized storm of
//! calls on connections closed and cut off at random, `POOL_SEED`).

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;

use common::upstream::{Replies, Upstream};
use common::vectors::{
    ALIPAY_FAIL, ALIPAY_SUCCESS, ALIPAY_VECTORS, IDEMPOTENCY_KEY_VECTORS, WECHATPAY_V3_VECTORS,
    WECHAT_FAIL, WECHAT_SUCCESS,
};
use common::{all_at_once, client};
use gateway_support::storm::{headers_with, send, send_vector, Headers, K};
use gateway_support::{raw_http, Gateway};
use http::Request;
use http_body_util::Full;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_keeps_bytes_path_query_and_drops_hop_by_hop_headers() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&format!("{}/base/", up.url()), &["--route", "/fwd=auto"]);
    let body: &[u8] = b"raw \x00\x01 bytes\r\nsecond line";
    let mut req = Vec::new();
    req.extend_from_slice(
        b"POST /fwd/x%20y?q=1&r=two%3D HTTP/1.1\r\n\
          Host: gateway.example\r\n\
          Connection: close, X-Hop\r\n\
          X-Hop: named by connection\r\n\
          Keep-Alive: timeout=5\r\n\
          Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
          Proxy-Foo: bar\r\n\
          TE: trailers\r\n\
          Trailer: X-Checksum\r\n\
          Upgrade: h2c\r\n\
          X-Forwarded-For: 203.0.113.7\r\n\
          X-End-To-End: kept\r\n\
          Content-Type: application/octet-stream\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    );
    let (a, b) = body.split_at(7);
    for chunk in [a, b] {
        req.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        req.extend_from_slice(chunk);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let addr = gw.addr;
    let reply = tokio::task::spawn_blocking(move || raw_http(addr, req))
        .await
        .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(
        reply.contains("upstream call 1 for /base/fwd/x%20y"),
        "{reply}"
    );

    let seen = up.last("/base/fwd/x%20y");
    assert_eq!(seen.uri, "/base/fwd/x%20y?q=1&r=two%3D");
    assert_eq!(seen.body, body);
    let h = &seen.headers;
    assert_eq!(h["host"], up.addr.to_string().as_str());
    assert_eq!(h["x-forwarded-for"], "203.0.113.7, 127.0.0.1");
    assert_eq!(h["x-end-to-end"], "kept");
    assert_eq!(h["content-type"], "application/octet-stream");
    assert_eq!(h["content-length"], body.len().to_string().as_str());
    for gone in [
        "x-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-foo",
        "trailer",
        "upgrade",
        "transfer-encoding",
    ] {
        assert!(!h.contains_key(gone), "{gone} reached the upstream: {h:?}");
    }
    if let Some(c) = h.get("connection") {
        assert!(!c.to_str().unwrap().contains("X-Hop"), "{c:?}");
    }
    // The client accepts trailers: the upstream hears it, and nothing else
    // of the hop-by-hop `TE`.
    assert_eq!(h["te"], "trailers");
}

/// Reads one request's head (up to its blank line, or until the peer
/// stops) from a raw upstream's connection.
async fn read_head(stream: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 65536];
    let mut len = 0;
    while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf[len..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
    }
}

/// The gateway in front of `upstream` with a WeChat Pay v3 route `/wx` and
/// a client-key route `/orders`.
fn wx_and_orders(upstream: &str) -> Gateway {
    Gateway::start(
        upstream,
        &[
            "--route",
            "/wx=wechatpay-v3",
            "--route",
            "/orders=idempotency-key",
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_upstream_does_not_downgrade_the_reply() {
    // An upstream that answers every request in HTTP/1.0 and closes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut stream, _)) = listener.accept().await {
            read_head(&mut stream).await;
            let _ = stream
                .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await;
        }
    });
    let gw = Gateway::start(&format!("http://{addr}"), &[]);
    let res = client()
        .request(Request::get(gw.url("/old")).body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.version(), http::Version::HTTP_11);
    let a = common::read(res).await;
    assert_eq!((a.status, a.text().as_str()), (200, "ok"));
    task.abort();
}

/// The gateway removes `Upgrade` from every request, so an upstream's
/// `101 Switching Protocols` was never asked for: it is a broken upstream,
/// answered as one (502, the channel's failure reply), never relayed or
/// recorded, and the retry is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrequested_101_from_the_upstream_is_a_bad_gateway() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    // Each connection: one request read to its head, then either a 101
    // with bytes of "another protocol" after it, or a plain 200.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let switch = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let (sw, n) = (switch.clone(), calls.clone());
    let task = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut stream, _)) = listener.accept().await {
            read_head(&mut stream).await;
            n.fetch_add(1, SeqCst);
            let answer: &[u8] = if sw.load(SeqCst) {
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n\
                  Upgrade: websocket\r\n\r\n\x81\x05hello"
            } else {
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            };
            let _ = stream.write_all(answer).await;
            let _ = stream.flush().await;
            // Held open a while, as a peer that switched would.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                drop(stream);
            });
        }
    });
    let gw = wx_and_orders(&format!("http://{addr}"));
    let client = client();
    let wx = &WECHATPAY_V3_VECTORS[0];
    let order = &IDEMPOTENCY_KEY_VECTORS[0];
    for round in 0..2 {
        let a = send_vector(&client, &gw.url("/wx/notify"), wx).await;
        assert_eq!(
            (a.status, a.text().as_str()),
            (500, WECHAT_FAIL),
            "round {round}"
        );
        let a = send_vector(&client, &gw.url("/orders"), order).await;
        assert_eq!(
            (a.status, a.text().as_str()),
            (502, "bad gateway\n"),
            "round {round}"
        );
        assert!(!a.replayed());
        // A route with no key: relayed as is, but a 101 is not an answer.
        let req = Request::post(gw.url("/plain/1"))
            .body(Full::from("ping"))
            .unwrap();
        let a = common::read(client.request(req).await.unwrap()).await;
        assert_eq!(a.status, 502, "round {round}: {}", a.text());
        assert!(a.headers.get("upgrade").is_none());
    }
    // Nothing was recorded: once the upstream answers properly, the retries
    // reach it, and the copies after them replay.
    switch.store(false, SeqCst);
    let before = calls.load(SeqCst);
    for url in ["/wx/notify", "/orders"] {
        let v = if url == "/orders" { order } else { wx };
        let a = send_vector(&client, &gw.url(url), v).await;
        assert_eq!(a.status, 200, "{url}: {}", a.text());
        assert!(!a.replayed(), "{url}");
        let a = send_vector(&client, &gw.url(url), v).await;
        assert!(a.replayed(), "{url}");
    }
    assert_eq!(calls.load(SeqCst), before + 2);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gets_the_failure_reply_and_the_retry_is_forwarded() {
    let port = common::free_port();
    let gw = wx_and_orders(&format!("http://127.0.0.1:{port}"));
    let client = client();
    let wx = &WECHATPAY_V3_VECTORS[0];
    let order = &IDEMPOTENCY_KEY_VECTORS[0];

    // Refused: WeChat Pay gets its failure reply, the client API a 502.
    for _ in 0..2 {
        let a = send_vector(&client, &gw.url("/wx/notify"), wx).await;
        assert_eq!((a.status, a.text().as_str()), (500, WECHAT_FAIL));
        assert!(a.headers["content-type"].to_str().unwrap().contains("json"));
        let a = send_vector(&client, &gw.url("/orders"), order).await;
        assert_eq!(a.status, 502, "{}", a.text());
        assert!(!a.replayed());
    }

    // The upstream comes back: the retry is forwarded (the failure was not
    // cached), and the one after it replays.
    let up = Upstream::start_on(
        TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("rebind the upstream port"),
        Replies::default(),
    );
    let a = send_vector(&client, &gw.url("/wx/notify"), wx).await;
    assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(!a.replayed());
    let a = send_vector(&client, &gw.url("/wx/notify"), wx).await;
    assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(a.replayed());
    assert_eq!(up.calls("/wx/notify"), 1);

    let a = send_vector(&client, &gw.url("/orders"), order).await;
    assert_eq!(
        (a.status, a.text().as_str()),
        (200, "upstream call 1 for /orders")
    );
    let a = send_vector(&client, &gw.url("/orders"), order).await;
    assert_eq!(
        (a.status, a.text().as_str()),
        (200, "upstream call 1 for /orders")
    );
    assert!(a.replayed());
    assert_eq!(up.calls("/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeout_and_upstream_failures_are_never_cached() {
    let up = Upstream::start().await;
    // The slow call outlives the reply deadline (300 ms) and the run limit
    // (600 ms): it is cancelled, nothing is recorded. (One that answers
    // within the run limit is recorded: tests/gateway_deadline.rs.)
    let gw = Gateway::start(
        &up.url(),
        &["--upstream-timeout", "300ms", "--max-run", "600ms"],
    );
    let client = client();
    let v = &ALIPAY_VECTORS[0];
    let slow: Headers = headers_with(v, &[("x-delay-ms", "3000")]);
    let failing: Headers = headers_with(v, &[("x-status", "503")]);
    // Too slow (the reply deadline), then the upstream's own 503: both answered with
    // Alipay's `fail`, and each retry reaches the upstream again.
    let started = Instant::now();
    let a = send(&client, &gw.url("/ali"), &slow, v.base().body).await;
    assert_eq!((a.status, a.text().as_str()), (500, ALIPAY_FAIL));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    let a = send(&client, &gw.url("/ali"), &failing, v.base().body).await;
    assert_eq!((a.status, a.text().as_str()), (500, ALIPAY_FAIL));
    let a = send_vector(&client, &gw.url("/ali"), v).await;
    assert_eq!((a.status, a.text().as_str()), (200, ALIPAY_SUCCESS));
    assert!(!a.replayed());
    let a = send_vector(&client, &gw.url("/ali"), v).await;
    assert!(a.replayed());
    assert_eq!(up.calls("/ali"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_request_in_flight_and_exits_0() {
    sigterm_drains("1").await;
}

/// The same with two serving threads: every listener closes, the thread
/// with the request waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_every_serving_thread() {
    sigterm_drains("2").await;
}

async fn sigterm_drains(workers: &str) {
    let up = Upstream::start().await;
    let args = ["--route", "/=wechatpay-v3", "--workers", workers];
    let mut gw = Gateway::start(&up.url(), &args);
    let client = client();
    let v = &WECHATPAY_V3_VECTORS[0];
    let headers: Headers = headers_with(v, &[("x-delay-ms", "1500")]);
    let in_flight = tokio::spawn({
        let (client, url, body) = (client.clone(), gw.url("/slow"), v.base().body);
        async move { send(&client, &url, &headers, body).await }
    });
    up.wait_for_call("/slow").await;
    gw.signal(libc::SIGTERM);

    // It stops accepting at once...
    let deadline = Instant::now() + Duration::from_secs(2);
    while TcpStream::connect(gw.addr).is_ok() {
        assert!(Instant::now() < deadline, "still accepting after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    // ...and the request in flight still gets its success.
    let a = in_flight.await.unwrap();
    assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    let status = gw.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{status:?}\n{}", gw.log());
    assert_eq!(up.calls("/slow"), 1);
}

/// A second signal during the drain exits 1 at once, whatever still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_1_at_once() {
    let up = Upstream::start().await;
    let args = ["--route", "/=wechatpay-v3", "--workers", "2"];
    let mut gw = Gateway::start(&up.url(), &args);
    let v = &WECHATPAY_V3_VECTORS[0];
    let headers: Headers = headers_with(v, &[("x-delay-ms", "20000")]);
    let _in_flight = tokio::spawn({
        let (url, body) = (gw.url("/stuck"), v.base().body);
        async move { send(&client(), &url, &headers, body).await }
    });
    up.wait_for_call("/stuck").await;
    gw.signal(libc::SIGTERM);
    // Two signals at once would be seen as one.
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.signal(libc::SIGINT);
    let status = gw.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(1), "{status:?}\n{}", gw.log());
    assert!(gw.log().contains("SIGINT again"), "{}", gw.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_when_idle_exits_0() {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up.url(), &[]);
    let a = send(&client(), &gw.url("/x"), &[], "ping").await;
    assert_eq!(a.status, 200);
    gw.signal(libc::SIGINT);
    let status = gw.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{status:?}\n{}", gw.log());
}

mod redis {
    use super::*;
    use support_redis::{shared_cluster, shared_standalone};

    /// K copies of the WeChat Pay v3 vector (the upstream takes 300 ms),
    /// spread over two gateways: one upstream call, K successes.
    async fn storm_over(a: &Gateway, b: &Gateway, up: &Upstream, path: &str) {
        let client = client();
        let v = &WECHATPAY_V3_VECTORS[0];
        let headers: Headers = headers_with(v, &[("x-delay-ms", "300")]);
        let answers = all_at_once(K, |i| {
            let url = if i % 2 == 0 { a.url(path) } else { b.url(path) };
            let (client, headers, body) = (client.clone(), headers.clone(), v.base().body);
            async move { send(&client, &url, &headers, body).await }
        })
        .await;
        for a in &answers {
            assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
        }
        assert_eq!(up.calls(path), 1);
        // Later copies on either instance replay.
        for gw in [a, b] {
            let r = send(&client, &gw.url(path), &v.base().headers, v.base().body).await;
            assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
            assert!(r.replayed());
        }
        assert_eq!(up.calls(path), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_gateways_share_one_redis() {
        let Some(redis) = shared_standalone() else {
            return;
        };
        let up = Upstream::start().await;
        let store = format!("redis://127.0.0.1:{}", redis.port());
        // A route of its own: the other tests share this Redis and vector.
        let route = ["--store", &store, "--route", "/redis/two=auto"];
        let a = Gateway::start(&up.url(), &route);
        let b = Gateway::start(&up.url(), &route);
        storm_over(&a, &b, &up, "/redis/two").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_gateways_share_one_redis_cluster() {
        let Some(cluster) = shared_cluster() else {
            return;
        };
        let up = Upstream::start().await;
        let nodes: Vec<String> = cluster
            .nodes()
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let store = format!("redis+cluster://{}", nodes.join(","));
        let route = ["--store", &store, "--route", "/cluster/two=auto"];
        let a = Gateway::start(&up.url(), &route);
        let b = Gateway::start(&up.url(), &route);
        storm_over(&a, &b, &up, "/cluster/two").await;
    }

    /// Redis goes down: `closed` answers the channel's failure reply (the
    /// upstream is not called), `open` passes through; when Redis is back,
    /// `closed` recovers by itself.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_down_fails_closed_or_open_as_told_and_recovers() {
        if !support_redis::redis_available() {
            return;
        }
        let mut redis = support_redis::RedisServer::start();
        let up = Upstream::start().await;
        let store = format!("redis://127.0.0.1:{}", redis.port());
        let closed = Gateway::start(&up.url(), &["--store", &store]);
        let open = Gateway::start(&up.url(), &["--store", &store, "--on-store-error", "open"]);
        let client = client();
        let v = &WECHATPAY_V3_VECTORS[0];
        redis.stop();
        let a = send_vector(&client, &closed.url("/p7/closed"), v).await;
        assert_eq!((a.status, a.text().as_str()), (500, WECHAT_FAIL));
        assert_eq!(up.calls("/p7/closed"), 0);
        let a = send_vector(&client, &open.url("/p7/open"), v).await;
        assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
        assert_eq!(up.calls("/p7/open"), 1);

        redis.restart();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let a = send_vector(&client, &closed.url("/p7/closed"), v).await;
            if a.status == 200 {
                assert_eq!(a.text(), WECHAT_SUCCESS);
                break;
            }
            assert_eq!((a.status, a.text().as_str()), (500, WECHAT_FAIL));
            assert!(
                Instant::now() < deadline,
                "no recovery after Redis came back"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(up.calls("/p7/closed"), 1);
    }

    /// SIGTERM while the only copy runs and its caller has hung up: the
    /// gateway still finishes the call and writes the record before it
    /// exits, so another instance replays it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sigterm_after_the_caller_hung_up_still_writes_the_record() {
        let Some(redis) = shared_standalone() else {
            return;
        };
        let up = Upstream::start().await;
        let store = format!("redis://127.0.0.1:{}", redis.port());
        // A route of its own: the other tests share this Redis and vector.
        let route = ["--store", &store, "--route", "/redis/hangup=auto"];
        let mut a = Gateway::start(&up.url(), &route);
        let v = &WECHATPAY_V3_VECTORS[0];
        let headers: Headers = headers_with(v, &[("x-delay-ms", "1000")]);
        // Raw TCP, so that hanging up really closes the connection.
        let mut request = String::from("POST /redis/hangup HTTP/1.1\r\nHost: gw\r\n");
        for (k, v) in &headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = v.base().body;
        request.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let mut caller = TcpStream::connect(a.addr).unwrap();
        caller.write_all(request.as_bytes()).unwrap();
        caller.write_all(&body).unwrap();
        up.wait_for_call("/redis/hangup").await;
        drop(caller);
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.signal(libc::SIGTERM);
        let status = a.wait_exit(Duration::from_secs(10));
        assert_eq!(status.code(), Some(0), "{status:?}\n{}", a.log());

        let b = Gateway::start(&up.url(), &route);
        let r = send_vector(&client(), &b.url("/redis/hangup"), v).await;
        assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
        assert!(r.replayed(), "the first call's record was not written");
        assert_eq!(up.calls("/redis/hangup"), 1);
    }
}

/// An upstream that answers a head and part of the body, then hangs: the
/// forwarder's one deadline covers both, so the head comes through (before
/// it) and the body fails at it, instead of hanging the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_timeout_covers_the_head_and_then_the_body() {
    use http_body_util::BodyExt;
    use idempotency_gateway::proxy::Forward;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            if buf[..n].starts_with(b"GET /part") {
                let head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nten bytes.";
                s.write_all(head).await.unwrap();
            }
            // `/none` gets nothing at all. Both hang until the test ends.
            held.push(s);
        }
    });
    let forward = Forward::builder(format!("http://{addr}").parse().unwrap())
        .timeout(Duration::from_millis(400))
        .build();
    let started = Instant::now();
    let req = Request::get("/none")
        .body(Full::<bytes::Bytes>::default())
        .unwrap();
    let res = forward.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::GATEWAY_TIMEOUT);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    let started = Instant::now();
    let req = Request::get("/part")
        .body(Full::<bytes::Bytes>::default())
        .unwrap();
    let res = forward.oneshot(req).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    let err = tokio::time::timeout(Duration::from_secs(10), res.into_body().collect())
        .await
        .expect("the body failed at the deadline, not later")
        .expect_err("a body cut off at the deadline is an error");
    assert!(err.to_string().contains("timed out"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// `x-request-id`: made when absent (a random UUID, new per request), sent
/// upstream and back; one the client sends is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_made_when_absent_and_kept_when_given() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &["--route", "/fwd=auto"]);
    let addr = gw.addr;
    let ask = |path: &'static str, extra: &'static str| {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n");
        tokio::task::spawn_blocking(move || raw_http(addr, req.into_bytes()))
    };
    let id_in = |reply: &str| -> String {
        let line = reply
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("x-request-id:"))
            .unwrap_or_else(|| panic!("no x-request-id in {reply}"));
        line["x-request-id:".len()..].trim().to_owned()
    };
    let mut made = Vec::new();
    for path in ["/fwd/one", "/fwd/two"] {
        let reply = ask(path, "").await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let id = id_in(&reply);
        let uuid = uuid::Uuid::parse_str(&id).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(uuid.get_version_num(), 4, "{id}");
        assert_eq!(id, uuid.hyphenated().to_string(), "lower-case, hyphenated");
        assert_eq!(up.last(path).headers["x-request-id"], id.as_str());
        made.push(id);
    }
    assert_ne!(made[0], made[1]);
    let reply = ask("/fwd/three", "X-Request-Id: given-7\r\n")
        .await
        .unwrap();
    assert_eq!(id_in(&reply), "given-7");
    assert_eq!(up.last("/fwd/three").headers["x-request-id"], "given-7");
}

/// A keep-alive HTTP/1.1 upstream on raw TCP that counts the connections it
/// accepts and the ones the gateway closed, and answers every request with
/// `body` (its `Content-Length` set); `close_after`, if set, closes each
/// connection that long after an answer, as an upstream with a short idle
/// timeout does (Node.js closes idle ones after 5 s), with no `Connection:
/// close` to warn of it.
struct KeepAliveUpstream {
    addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    closed_by_peer: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl KeepAliveUpstream {
    async fn start(body: Vec<u8>, close_after: Option<Duration>) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed_by_peer = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(AtomicUsize::new(0));
        let (a, c, n) = (accepted.clone(), closed_by_peer.clone(), answered.clone());
        let body = Arc::new(body);
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                a.fetch_add(1, SeqCst);
                let (c, n, body) = (c.clone(), n.clone(), body.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        // One request: its head, then its Content-Length body.
                        let head_end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => {
                                    c.fetch_add(1, SeqCst);
                                    return;
                                }
                                Ok(k) => buf.extend_from_slice(&chunk[..k]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                        let header = |name: &str| {
                            head.lines()
                                .find_map(|l| l.strip_prefix(name))
                                .map(|v| v.trim().parse::<usize>().unwrap())
                        };
                        let len = header("content-length:").unwrap_or(0);
                        // A request may ask for its own answer: that many
                        // bytes, and `Connection: close` after it.
                        let sized = header("x-answer-bytes:").map(pattern);
                        let close = header("x-close:") == Some(1);
                        while buf.len() < head_end + len {
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => buf.extend_from_slice(&chunk[..k]),
                            }
                        }
                        buf.drain(..head_end + len);
                        let body = sized.as_deref().unwrap_or(&body);
                        let connection = if close { "connection: close\r\n" } else { "" };
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n{connection}\r\n",
                            body.len()
                        );
                        if s.write_all(answer.as_bytes()).await.is_err()
                            || s.write_all(body).await.is_err()
                        {
                            // Closed (or reset) by the gateway mid-answer.
                            c.fetch_add(1, SeqCst);
                            return;
                        }
                        n.fetch_add(1, SeqCst);
                        if close {
                            return;
                        }
                        if let Some(after) = close_after {
                            tokio::time::sleep(after).await;
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            accepted,
            closed_by_peer,
            answered,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn closed_by_peer(&self) -> usize {
        self.closed_by_peer
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits (10 s at most) until the gateway has closed `n` connections.
    async fn wait_closed(&self, n: usize, why: &str) {
        let waiting = Instant::now();
        while self.closed_by_peer() < n {
            assert!(waiting.elapsed() < Duration::from_secs(10), "{why}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `n` bytes that say where they are: byte `i` is `i % 251`.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

impl Drop for KeepAliveUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Through the binary: one client's calls, one after another, share one
/// upstream connection; an upstream that closes its idle connections
/// (without `Connection: close`) costs a new connection per call, never a
/// failed call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_kept_alive_and_closed_ones_are_not_used() {
    let c = client();
    // `calls` POSTs one after another, `pause` apart; each answered "pong".
    let calls = |close_after: Option<Duration>, calls: usize, pause: Duration| {
        let c = c.clone();
        async move {
            let up = KeepAliveUpstream::start(b"pong".to_vec(), close_after).await;
            let gw = Gateway::start(&up.url(), &["--workers", "1"]);
            for i in 0..calls {
                let req = Request::post(gw.url(&format!("/plain/{i}")))
                    .body(Full::from("ping"))
                    .unwrap();
                let a = common::read(c.request(req).await.unwrap()).await;
                assert_eq!((a.status, a.text().as_str()), (200, "pong"), "call {i}");
                tokio::time::sleep(pause).await;
            }
            assert_eq!(up.answered(), calls);
            up.accepted()
        }
    };
    let accepted = calls(None, 20, Duration::ZERO).await;
    assert_eq!(accepted, 1, "20 calls in a row on one connection");
    // Each call comes past the upstream's idle timeout: its connection is gone.
    let accepted = calls(
        Some(Duration::from_millis(20)),
        8,
        Duration::from_millis(80),
    )
    .await;
    assert_eq!(accepted, 8, "a closed connection is never used");
}

/// An answer its caller drops before its end leaves its connection
/// unusable (the rest of the answer is still on it): it is closed, not
/// given to the next call, which gets its whole answer on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_dropped_before_its_end_closes_its_connection() {
    use http_body_util::BodyExt;
    use idempotency_gateway::proxy::Forward;
    use tower::ServiceExt;
    let big = vec![b'x'; 4 << 20];
    let up = KeepAliveUpstream::start(big.clone(), None).await;
    let forward = Forward::new(up.url().parse().unwrap());
    let call = || Request::post("/big").body(Full::from("ping")).unwrap();
    let res = forward.clone().oneshot(call()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| d.len() < big.len()));
    drop(body);
    let res = forward.clone().oneshot(call()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    let whole = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(whole.len(), big.len());
    assert_eq!(up.accepted(), 2);
    up.wait_closed(1, "the cut-off connection stays open").await;
    // The second connection, read to its end, is kept for the next call
    // (once its connection has taken in the answer's end: a moment).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let res = forward.oneshot(call()).await.unwrap();
    let whole = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(whole.len(), big.len());
    assert_eq!(up.accepted(), 2);
}

/// `pool_idle_timeout`: a connection idle that long is closed by the
/// gateway even when no other call comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_the_pool_idle_timeout() {
    use http_body_util::BodyExt;
    use idempotency_gateway::proxy::Forward;
    use tower::ServiceExt;
    let up = KeepAliveUpstream::start(b"pong".to_vec(), None).await;
    let forward = Forward::builder(up.url().parse().unwrap())
        .pool_idle_timeout(Duration::from_millis(200))
        .build();
    for _ in 0..3 {
        let req = Request::post("/").body(Full::from("ping")).unwrap();
        let res = forward.clone().oneshot(req).await.unwrap();
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "pong");
        // A connection is kept once it has taken in the answer's end (a
        // moment after the caller read it; a call at once may connect anew).
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!((up.accepted(), up.closed_by_peer()), (1, 0));
    let idle = Instant::now();
    up.wait_closed(1, "an idle connection was kept open").await;
    assert!(
        idle.elapsed() >= Duration::from_millis(150),
        "{:?}",
        idle.elapsed()
    );
    // The next call connects again.
    let req = Request::post("/").body(Full::from("ping")).unwrap();
    let res = forward.oneshot(req).await.unwrap();
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "pong");
    assert_eq!(up.accepted(), 2);
}

/// Many calls at once on one forwarder, each with a random request body and
/// answer size, a random upstream `Connection: close` after its answer, and
/// a random caller that drops the answer after its first frame: every call
/// is answered 200, every answer read to its end is whole and right, none
/// hangs, and the pool serves calls afterwards. `POOL_SEED=<n>` replays one
/// schedule (the seed is printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_calls_on_connections_closed_and_cut_off_at_random() {
    use http_body_util::BodyExt;
    use idempotency_gateway::proxy::Forward;
    use std::sync::Arc;
    use tower::ServiceExt;
    let seed = common::seed("POOL_SEED");
    // xorshift64*: the same seed, the same schedule.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |below: u64| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D) % below
    };
    let up = KeepAliveUpstream::start(Vec::new(), None).await;
    let forward = Forward::new(up.url().parse().unwrap());
    // (request bytes, answer bytes, close after, drop after the first frame)
    let plans: Arc<Vec<(usize, usize, bool, bool)>> = Arc::new(
        (0..200)
            .map(|_| {
                let sent = [0, 3, 700, 70_000][next(4) as usize];
                let answer = [0, 1, 5_000, 300_000][next(4) as usize];
                (sent, answer, next(4) == 0, next(5) == 0)
            })
            .collect(),
    );
    let call = |forward: Forward, (sent, answer, close, cut): (usize, usize, bool, bool)| async move {
        let req = Request::post("/storm")
            .header("x-answer-bytes", answer)
            .header("x-close", usize::from(close))
            .body(Full::from(vec![b'r'; sent]))
            .unwrap();
        let res = forward.oneshot(req).await.unwrap();
        if res.status() != http::StatusCode::OK {
            return Err(format!("status {}", res.status()));
        }
        let mut body = res.into_body();
        if cut {
            let _ = body.frame().await;
            return Ok(());
        }
        let got = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        if got[..] != pattern(answer)[..] {
            return Err(format!(
                "{} bytes of {answer}, or not the right ones",
                got.len()
            ));
        }
        Ok(())
    };
    let storm = common::all_at_once(plans.len(), |i| call(forward.clone(), plans[i]));
    let results = tokio::time::timeout(Duration::from_secs(60), storm)
        .await
        .unwrap_or_else(|_| panic!("a call hung (POOL_SEED={seed})"));
    for (i, result) in results.into_iter().enumerate() {
        if let Err(e) = result {
            panic!("call {i} {:?}: {e} (POOL_SEED={seed})", plans[i]);
        }
    }
    // The pool still serves, one call after another.
    for _ in 0..20 {
        let plan = (next(2) as usize * 700, 5_000, false, false);
        call(forward.clone(), plan)
            .await
            .unwrap_or_else(|e| panic!("after the storm: {e} (POOL_SEED={seed})"));
    }
    assert_eq!(up.answered(), 220, "POOL_SEED={seed}");
}
