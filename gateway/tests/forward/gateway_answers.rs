//! Whole answers through the gateway, over real TCP: a first answer
//! that the upstream writes in several segments arrives whole on a
//! client-API route; trailers reach the first answer; a reader that stops
//! does not make the request run again; client-key records never push a
//! channel's records out.

use crate::gateway_support;
use test_support::common;

use gateway_support::segments::{exchange, post, sized, Answer, RawUpstream};
use gateway_support::storm::send_vector;
use gateway_support::Gateway;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_answers_in_several_segments_arrive_whole_on_a_client_api_route() {
    // The head comes with the first piece, so the gateway takes part of the
    // body at once before it streams the rest.
    for len in [16 * 1024, 64 * 1024, 1024 * 1024] {
        let up = RawUpstream::start(sized(len, 8, Duration::from_millis(2))).await;
        for workers in ["1", "2"] {
            let gw = Gateway::start(
                &up.url(),
                &["--route", "/api=idempotency-key", "--workers", workers],
            );
            let (mut short, before) = (Vec::new(), up.calls());
            for i in 0..40 {
                let req = post("/api/orders", &format!("seg-{len}-{workers}-{i}"), "");
                let read = exchange(gw.addr, &req, Duration::from_secs(5)).await;
                if read.status() != 200 || read.body.len() != len {
                    short.push((i, read.status(), read.body.len()));
                }
            }
            assert!(
                short.is_empty(),
                "{len} bytes, --workers {workers}: {} of 40 first answers were not whole \
                 (answer, status, body bytes read): {short:?}",
                short.len()
            );
            assert_eq!(up.calls() - before, 40, "one upstream call per key");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_reach_the_first_answer_and_the_replay() {
    let answer = Answer {
        head: b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntrailer: x-checksum\r\n\
                transfer-encoding: chunked\r\n\r\n"
            .to_vec(),
        pieces: vec![
            b"5\r\nhello\r\n".to_vec(),
            b"6\r\n world\r\n".to_vec(),
            b"0\r\nx-checksum: abc\r\n\r\n".to_vec(),
        ],
        pause: Duration::from_millis(5),
    };
    let up = RawUpstream::start(answer).await;
    let gw = Gateway::start(&up.url(), &["--route", "/api=idempotency-key"]);
    let te = "TE: trailers\r\n";
    for (path, key, what) in [
        ("/api/orders", "trl-1", "first answer"),
        ("/api/orders", "trl-1", "replay"),
        ("/plain", "none", "unrouted answer"),
    ] {
        let before = up.calls();
        let read = exchange(gw.addr, &post(path, key, te), Duration::from_secs(5)).await;
        assert_eq!(read.status(), 200, "{what}: {}", read.head);
        let calls = up.calls() - before;
        assert_eq!(
            calls,
            usize::from(what != "replay"),
            "{what}: upstream calls"
        );
        assert_eq!(
            read.header("trailer").as_deref(),
            Some("x-checksum"),
            "{what}: no `Trailer` header: {}",
            read.head
        );
        let body = String::from_utf8_lossy(&read.body).to_lowercase();
        assert!(
            body.contains("hello") && body.contains(" world"),
            "{what}: body {body:?}"
        );
        assert!(
            body.contains("\r\n0\r\nx-checksum: abc\r\n"),
            "{what}: the trailer is missing from the chunked body {body:?}"
        );
        if calls == 1 {
            assert!(
                up.last().contains("\r\nte: trailers\r\n"),
                "{what}: `TE: trailers` did not reach the upstream: {}",
                up.last()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_does_not_make_the_request_run_again() {
    const LEN: usize = 64 << 20;
    let up = RawUpstream::start(sized(LEN, 64, Duration::ZERO)).await;
    let gw = Gateway::start(
        &up.url(),
        &["--route", "/api=idempotency-key", "--max-run", "2s"],
    );
    let req = post("/api/orders", "stopped-reader", "");
    // The client reads the head, waits 3 s without reading, and leaves.
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("the head arrives")
            .unwrap();
        assert!(n > 0, "the gateway closed before the head");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(stream);

    // The retry replays the success: the upstream ran once.
    let read = exchange(gw.addr, &req, Duration::from_secs(10)).await;
    assert_eq!(read.status(), 200, "the retry: {}", read.head);
    assert_eq!(
        up.calls(),
        1,
        "the retry ran the upstream again: {}",
        read.head
    );
    assert_eq!(
        read.header("idempotent-replayed").as_deref(),
        Some("true"),
        "{}",
        read.head
    );
    // Past the cache limit the record keeps the head, not the body.
    assert_eq!(
        read.header("idempotent-body-omitted").as_deref(),
        Some("true"),
        "{}",
        read.head
    );
    assert!(read.body.is_empty(), "{} body bytes", read.body.len());
}

/// One Stripe event, then 60 client-key records of 64 KiB with random
/// keys, through a gateway with `--max-memory 2MiB` and `routes`: the
/// Stripe event still replays.
async fn client_keys_leave_the_channel_records(routes: &[&str], stripe: &str, api: &str) {
    let up = RawUpstream::start(sized(64 * 1024, 2, Duration::ZERO)).await;
    let mut args = vec!["--max-memory", "2MiB"];
    args.extend_from_slice(routes);
    let gw = Gateway::start(&up.url(), &args);
    let client = common::client();
    let event = &common::vectors::STRIPE_VECTORS[0];
    let first = send_vector(&client, &gw.url(stripe), event).await;
    assert_eq!(
        first.status,
        200,
        "{routes:?}: the event: {:?}",
        first.text()
    );
    assert_eq!(up.calls(), 1);
    for i in 0..60u64 {
        let key = format!("random-{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let read = exchange(gw.addr, &post(api, &key, ""), Duration::from_secs(5)).await;
        assert_eq!(
            read.status(),
            200,
            "{routes:?}: client key {i}: {}",
            read.head
        );
        assert_eq!(read.body.len(), 64 * 1024, "{routes:?}: client key {i}");
    }
    assert_eq!(up.calls(), 61);
    let again = send_vector(&client, &gw.url(stripe), event).await;
    assert_eq!(
        again.status,
        200,
        "{routes:?}: the resent event: {:?}",
        again.text()
    );
    assert_eq!(
        up.calls(),
        61,
        "{routes:?}: the Stripe event ran again after 60 client-key records: \
         client keys pushed the channel's record out"
    );
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_key_records_never_push_a_channel_record_out() {
    // The default route: `/` = auto, channels and client keys on one route.
    client_keys_leave_the_channel_records(&[], "/webhooks/stripe", "/orders").await;
    // A route each.
    client_keys_leave_the_channel_records(
        &[
            "--route",
            "/stripe=stripe",
            "--route",
            "/api=idempotency-key",
        ],
        "/stripe",
        "/api/orders",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_s_own_max_memory_keeps_its_records() {
    let config = gateway_support::temp_path("budgets.toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmax_memory = \"256KiB\"\n\
         [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n",
    )
    .unwrap();
    let args = ["--config", config.to_str().unwrap()];
    client_keys_leave_the_channel_records(&args, "/stripe", "/api/orders").await;
    let _ = std::fs::remove_file(&config);
}

/// `gateway ARGS --check-config` exits 2 with `hint` in its message.
fn refused(args: &[&str], hint: &str) {
    let out = std::process::Command::new(gateway_support::gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .args(args)
        .arg("--check-config")
        .env("RUST_LOG", "off")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(hint), "{args:?}: {stderr:?} lacks {hint:?}");
}

#[test]
fn route_budgets_that_cannot_work_are_refused_at_start() {
    let config = gateway_support::temp_path("over.toml");
    std::fs::write(
        &config,
        "max_memory = \"1MiB\"\n\
         [[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\nmax_memory = \"1MiB\"\n\
         [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n",
    )
    .unwrap();
    // The routes' own budgets leave nothing for `/api`.
    refused(&["--config", config.to_str().unwrap()], "--max-memory");
    // 20 KiB shared by two routes: too little for either.
    refused(
        &[
            "--max-memory",
            "20KiB",
            "--route",
            "/a=stripe",
            "--route",
            "/b=idempotency-key",
        ],
        "route /a",
    );
    let _ = std::fs::remove_file(&config);
}
