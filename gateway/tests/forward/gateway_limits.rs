//! The gateway's bounds under floods, through the gateway binary over real
//! TCP: stalled bodies time out (`--body-timeout`), bodies being read share
//! one budget (`--max-buffered`), a hung upstream holds at most
//! `--max-upstream-calls` calls (and descriptors). And the library's
//! builders take durations that cannot work without panicking later.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use gateway_support::{get, Gateway};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A Stripe event (`auto` detects it by its signature header; nothing
/// verifies it there).
fn stripe(id: &str, content_length: Option<usize>) -> (String, String) {
    let body = format!(r#"{{"id":"{id}","object":"event","type":"charge.succeeded"}}"#);
    let len = content_length.unwrap_or(body.len());
    let head = format!(
        "POST /notify HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Stripe-Signature: t=1,v1=00\r\nContent-Length: {len}\r\n\r\n"
    );
    (head, body)
}

/// Sends the head and `part` of a body that is never finished; the stream
/// is kept open.
fn stall(addr: SocketAddr, head: &str, part: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    // A body shed past the budget is answered (and its connection closed)
    // while the rest may still be on its way.
    let _ = s.write_all(part);
    s
}

/// What the server wrote until it closed the stream (or `within` passed).
fn answer_of(mut s: TcpStream, within: Duration) -> String {
    s.set_read_timeout(Some(within)).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// One whole request on a fresh connection, `Connection: close`; the answer
/// (empty if none came within `within`).
fn send(addr: SocketAddr, head: &str, body: &str, within: Duration) -> String {
    let head = head.replace("Host: gw\r\n", "Host: gw\r\nConnection: close\r\n");
    let s = stall(addr, &head, body.as_bytes());
    answer_of(s, within)
}

fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// 60 clients send a head and part of a body, then stall, against 50
/// connections: each gets 408 once the body deadline passes and its
/// connection is closed, and a genuine notification is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_time_out_and_genuine_senders_are_served() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        // One serving thread: with several, one may hold a free connection
        // slot while its listener waits, and let the genuine sender in by luck.
        &[
            "--max-connections",
            "50",
            "--body-timeout",
            "1s",
            "--workers",
            "1",
        ],
    );
    let addr = gw.addr;
    let result = tokio::task::spawn_blocking(move || {
        let (head, body) = stripe("evt_stalled", Some(1000));
        let stalled: Vec<TcpStream> = (0..60)
            .map(|_| stall(addr, &head, &body.as_bytes()[..20]))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let (head, body) = stripe("evt_genuine", None);
        let genuine = send(addr, &head, &body, Duration::from_secs(20));
        let answers: Vec<String> = stalled
            .into_iter()
            .map(|s| answer_of(s, Duration::from_secs(20)))
            .collect();
        (genuine, answers)
    })
    .await
    .unwrap();
    let (genuine, answers) = result;
    assert_eq!(status(&genuine), 200, "genuine notification: {genuine:?}");
    assert!(genuine.contains(r#"{"received":true}"#), "{genuine}");
    for a in &answers {
        // read_to_end returned: the gateway closed the connection.
        assert_eq!(status(a), 408, "{a:?}");
        assert!(a.to_ascii_lowercase().contains("connection: close"), "{a}");
    }
    assert_eq!(up.calls("/notify"), 1);
}

/// Bodies being read share `--max-buffered`: once stalled bodies fill it,
/// the next body gets 503 with `Retry-After` at once (counted as shed), and
/// a genuine notification gets through once the stalled ones time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_flood_is_shed_past_the_budget() {
    let up = Upstream::start().await;
    let metrics = common::free_addr();
    let gw = Gateway::start(
        &up.url(),
        &[
            "--max-buffered",
            "1MiB",
            "--body-timeout",
            "3s",
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    let addr = gw.addr;
    let (shed, genuine) = tokio::task::spawn_blocking(move || {
        // 8 x 200 KiB of 1 MiB bodies: 1.6 MiB would be held.
        let (head, _) = stripe("evt_flood", Some(1 << 20));
        let part = vec![b' '; 200 << 10];
        let flood: Vec<TcpStream> = (0..8).map(|_| stall(addr, &head, &part)).collect();
        let answers: Vec<String> = flood
            .into_iter()
            .map(|s| answer_of(s, Duration::from_secs(20)))
            .collect();
        let shed: Vec<String> = answers.into_iter().filter(|a| status(a) == 503).collect();
        let (head, body) = stripe("evt_genuine", None);
        let genuine = send(addr, &head, &body, Duration::from_secs(20));
        (shed, genuine)
    })
    .await
    .unwrap();
    assert!(!shed.is_empty(), "no body was shed past the budget");
    for a in &shed {
        assert!(a.to_ascii_lowercase().contains("retry-after: 1"), "{a}");
    }
    assert_eq!(status(&genuine), 200, "{genuine:?}");
    let (_, text) = get(metrics, "/metrics");
    // Every preset's series is exported from the start (at 0): add them up.
    let shed_count: f64 = text
        .lines()
        .filter(|l| l.starts_with("idempotency_requests_total{") && l.contains("outcome=\"shed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(shed_count >= shed.len() as f64, "{text}");
}

/// An upstream that accepts connections and never answers.
fn hung_upstream() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<TcpStream>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held: std::sync::Arc<std::sync::Mutex<Vec<TcpStream>>> = Default::default();
    let keep = held.clone();
    std::thread::spawn(move || {
        for s in listener.incoming().map_while(Result::ok) {
            keep.lock().unwrap().push(s);
        }
    });
    (addr, held)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A hung upstream, a short reply deadline and a long run limit: each
/// notification leaves a call running in the background. At most half of
/// `--max-upstream-calls` of them reach the upstream (a route's default
/// share, so the gateway's descriptors stay bounded and other routes keep
/// the rest); the others get the channel's retryable failure at once,
/// counted as shed, and an unguarded request still reaches the upstream
/// (504: it does not answer).
#[test]
fn a_hung_upstream_holds_at_most_the_cap_of_calls() {
    let (upstream, held) = hung_upstream();
    let metrics = common::free_addr();
    let gw = Gateway::start(
        &format!("http://{upstream}"),
        &[
            "--route",
            "/notify=stripe",
            "--upstream-timeout",
            "200ms",
            "--max-run",
            "120s",
            "--max-upstream-calls",
            "8",
            "--workers",
            "2",
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    let before = open_fds(gw.child.id());
    let mut answers = Vec::new();
    for i in 0..40 {
        let (head, body) = stripe(&format!("evt_hung_{i}"), None);
        answers.push(send(gw.addr, &head, &body, Duration::from_secs(20)));
    }
    for a in &answers {
        // Stripe's failure reply: retryable.
        assert_eq!(status(a), 500, "{a:?}");
    }
    assert!(
        held.lock().unwrap().len() <= 4,
        "{} upstream connections",
        held.lock().unwrap().len()
    );
    let after = open_fds(gw.child.id());
    assert!(
        after <= before + 4 + 4,
        "descriptors grew from {before} to {after}"
    );
    let unguarded = get(gw.addr, "/health");
    assert_eq!(unguarded.0, 504, "{unguarded:?}");
    let (_, text) = get(metrics, "/metrics");
    let value = |name: &str, label: &str| {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        value("idempotency_requests_total{", "outcome=\"shed\""),
        Some(36.0),
        "{text}"
    );
    assert_eq!(value("idempotency_upstream_calls", ""), Some(4.0), "{text}");
}

/// `Duration::MAX` for the lease, the wait and the run limit (and a lease of
/// 2 ns) are taken within bounds: requests are served, never a panic.
#[tokio::test]
async fn builders_take_durations_that_cannot_work() {
    use bytes::Bytes;
    use http_body_util::Full;
    use tower::{ServiceBuilder, ServiceExt};
    use tower_idempotency::IdempotencyLayer;

    for lease in [Duration::MAX, Duration::from_nanos(2)] {
        let layer = IdempotencyLayer::stripe()
            .lease(lease)
            .wait(Duration::MAX)
            .max_run(Duration::MAX)
            .window(Duration::MAX)
            .reply_timeout(Duration::MAX);
        let svc = ServiceBuilder::new().layer(layer).service_fn(|_req| async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
        });
        for replayed in [false, true] {
            let req = common::request("/", &[], r#"{"id":"evt_1","type":"charge.succeeded"}"#);
            let res = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), 200);
            assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
        }
        // The same for a message consumer.
        let consumer = tower_idempotency::consumer::Consumer::new(
            tower_idempotency::store::MemoryStore::new(),
        )
        .lease(lease)
        .wait(Duration::MAX)
        .window(Duration::MAX);
        let fp = tower_idempotency::Fingerprint::of(b"p");
        for _ in 0..2 {
            let got = consumer
                .once("msg-1", fp, async {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, std::io::Error>(())
                })
                .await;
            assert!(got.is_ok(), "{got:?}");
        }
    }
}

/// An HTTP/2 client that sends its preface and then only answers what the
/// server asks (SETTINGS and PING acknowledgements), as an idle browser
/// connection does. Returns the server's `SETTINGS_MAX_CONCURRENT_STREAMS`
/// and whether the server closed the connection within `within`.
fn idle_h2(addr: SocketAddr, within: Duration) -> (Option<u32>, bool) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    s.set_read_timeout(Some(within)).unwrap();
    let mut streams = None;
    loop {
        let mut header = [0u8; 9];
        if s.read_exact(&mut header).is_err() {
            // EOF (or a reset): closed. A timeout is not.
            let mut probe = [0u8; 1];
            let closed =
                !matches!(s.read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            return (streams, closed);
        }
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let mut payload = vec![0u8; len];
        if s.read_exact(&mut payload).is_err() {
            return (streams, true);
        }
        let (kind, flags) = (header[3], header[4]);
        if kind == 0x4 && flags & 1 == 0 {
            streams = payload.chunks_exact(6).find_map(|setting| {
                (setting[..2] == [0, 3])
                    .then(|| u32::from_be_bytes(setting[2..].try_into().unwrap()))
            });
            let _ = s.write_all(&[0, 0, 0, 0x4, 1, 0, 0, 0, 0]);
        }
        if kind == 0x6 && flags & 1 == 0 {
            let mut ack = vec![0, 0, 8, 0x6, 1, 0, 0, 0, 0];
            ack.extend_from_slice(&payload);
            let _ = s.write_all(&ack);
        }
    }
}

/// An HTTP/2 client that opens a connection and sends nothing more: the
/// gateway announces `--h2-max-streams` and closes the idle connection
/// (after about `--header-timeout`; there is no header timeout between
/// HTTP/2 streams).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_are_closed_and_streams_capped() {
    let up = Upstream::start().await;
    for (args, streams) in [(&["--h2-max-streams", "7"][..], 7), (&[][..], 64)] {
        let mut all = vec!["--header-timeout", "1s"];
        all.extend_from_slice(args);
        let gw = Gateway::start(&up.url(), &all);
        let addr = gw.addr;
        let (announced, closed) =
            tokio::task::spawn_blocking(move || idle_h2(addr, Duration::from_secs(15)))
                .await
                .unwrap();
        assert_eq!(announced, Some(streams));
        assert!(closed, "the idle HTTP/2 connection stayed open");
    }
}

/// The library's `BodyLimitsLayer` in front of an idempotency stack: a body that
/// stalls past the deadline gets 408 (a channel: its failure reply), one
/// past the budget 503 with `Retry-After`, counted as shed; neither reaches
/// the handler.
#[tokio::test]
async fn body_limits_in_front_of_the_stack() {
    use bytes::Bytes;
    use futures_util::StreamExt;
    use http_body_util::{Full, StreamBody};
    use tower::{ServiceBuilder, ServiceExt};
    use tower_idempotency::limit::{BodyBudget, BodyLimitError, BodyLimitsLayer};
    use tower_idempotency::{IdempotencyLayer, Outcome};

    type Frames = std::pin::Pin<
        Box<
            dyn futures_util::Stream<Item = Result<http_body::Frame<Bytes>, std::io::Error>> + Send,
        >,
    >;
    let stalled = || -> StreamBody<Frames> {
        let first = futures_util::stream::iter([Ok(http_body::Frame::data(Bytes::from_static(
            br#"{"id":"evt_"#,
        )))]);
        StreamBody::new(first.chain(futures_util::stream::pending()).boxed())
    };
    let whole = |body: &'static str| -> StreamBody<Frames> {
        let frame = Ok(http_body::Frame::data(Bytes::from_static(body.as_bytes())));
        StreamBody::new(futures_util::stream::iter([frame]).boxed())
    };
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stack = |layer: IdempotencyLayer, limits: BodyLimitsLayer| {
        let calls = calls.clone();
        ServiceBuilder::new()
            .layer(limits)
            .layer(layer)
            .service_fn(move |_req| {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                }
            })
    };
    let post = |body, key: Option<&str>| {
        let mut req = http::Request::post("/orders").header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.body(body).unwrap()
    };

    let limits = BodyLimitsLayer::new().timeout(Duration::from_millis(200));
    let res = stack(IdempotencyLayer::idempotency_key(), limits.clone())
        .oneshot(post(stalled(), Some("k1")))
        .await
        .unwrap();
    assert_eq!(res.status(), 408);
    assert_eq!(
        res.extensions().get::<BodyLimitError>(),
        Some(&BodyLimitError::Timeout(Duration::from_millis(200)))
    );
    let res = stack(IdempotencyLayer::stripe(), limits)
        .oneshot(post(stalled(), None))
        .await
        .unwrap();
    assert_eq!(res.status(), 500, "Stripe's failure reply");
    assert!(res.extensions().get::<BodyLimitError>().is_some());

    let budget = BodyBudget::new(16);
    let limits = BodyLimitsLayer::new().budget(budget.clone());
    let res = stack(IdempotencyLayer::idempotency_key(), limits.clone())
        .oneshot(post(
            whole(r#"{"order":"more than sixteen bytes"}"#),
            Some("k2"),
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Shed));
    assert_eq!(budget.used(), 0, "a shed body gives its bytes back");
    let res = stack(IdempotencyLayer::idempotency_key(), limits)
        .oneshot(post(whole(r#"{"order":1}"#), Some("k3")))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(budget.used(), 0);
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A slow client API cannot starve the callbacks: a route with no
/// `max_in_flight` of its own holds at most half of `--max-upstream-calls`,
/// so while client-API calls hang at the upstream, a burst of notifications
/// on a channel route still gets through, every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_client_api_leaves_the_callbacks_their_share() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &[
            "--route",
            "/api=idempotency-key",
            "--route",
            "/notify=stripe",
            "--max-upstream-calls",
            "8",
            "--queue-wait",
            "1s",
            "--upstream-timeout",
            "60s",
            "--workers",
            "2",
        ],
    );
    let addr = gw.addr;
    let answered = Arc::new(AtomicUsize::new(0));
    for i in 0..8 {
        let answered = answered.clone();
        std::thread::spawn(move || {
            let body = "{}";
            let head = format!(
                "POST /api/slow HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: slow-{i}\r\n\
                 X-Delay-Ms: 60000\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = send(addr, &head, body, Duration::from_secs(90));
            answered.fetch_add(1, Ordering::SeqCst);
        });
    }
    // Each client call hangs at the upstream or was shed.
    let deadline = Instant::now() + Duration::from_secs(20);
    while up.calls("/api/slow") + answered.load(Ordering::SeqCst) < 8 {
        assert!(
            Instant::now() < deadline,
            "{} client calls at the upstream, {} answered",
            up.calls("/api/slow"),
            answered.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let burst: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let (head, body) = stripe(&format!("evt_burst_{i}"), None);
                send(addr, &head, &body, Duration::from_secs(20))
            })
        })
        .collect();
    for (i, t) in burst.into_iter().enumerate() {
        let a = t.join().unwrap();
        assert_eq!(status(&a), 200, "notification {i}: {a}");
    }
    assert_eq!(up.calls("/notify"), 6, "{:?}", up.seen().len());
    assert!(up.calls("/api/slow") <= 4, "{}", up.calls("/api/slow"));
}

/// The metrics and admin listener has the main listener's header timeout
/// (at most 5 s) and a cap on its connections (1024): a client that sends
/// half its headers is closed once `--header-timeout` passes, and 100 more
/// such clients than the cap hold at most the cap of descriptors; health
/// checks are answered again once they are gone.
#[test]
fn the_metrics_listener_times_out_headers_and_caps_its_connections() {
    let metrics = common::free_addr();
    let gw = Gateway::start(
        "http://127.0.0.1:9",
        &[
            "--metrics-listen",
            &metrics.to_string(),
            "--header-timeout",
            "2s",
        ],
    );
    assert_eq!(get(metrics, "/healthz").0, 200);
    let half = "GET /metrics HTTP/1.1\r\nHost: gw\r\n";
    let started = Instant::now();
    let s = stall(metrics, half, b"");
    let answer = answer_of(s, Duration::from_secs(20));
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "a connection with half its headers stayed open {took:?}: {answer:?}"
    );
    let before = open_fds(gw.child.id());
    const CAP: usize = 1024;
    let stalled: Vec<TcpStream> = (0..CAP + 100).map(|_| stall(metrics, half, b"")).collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = open_fds(gw.child.id());
    assert!(
        during <= before + CAP + 4,
        "descriptors grew from {before} to {during} with {} stalled clients",
        CAP + 100
    );
    drop(stalled);
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(metrics, "/healthz").0 != 200 {
        assert!(Instant::now() < deadline, "/healthz never answered again");
        std::thread::sleep(Duration::from_millis(50));
    }
}
