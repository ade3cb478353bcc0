//! The gateway binary against upstreams that answer before they read the
//! request's body: a trickled upload holds no upstream connection once its
//! answer has ended (the call cap bounds the upstream's connections), and a
//! desynced connection's stray answer is never kept as another client's
//! reply; `--upstream-keepalive false` opens a connection per call.

use crate::gateway_support;
use gateway_support::Gateway;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Reads a request's head (up to the blank line) byte by byte; `None` when
/// the connection ends first.
async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

fn path(head: &str) -> String {
    head.split(' ').nth(1).unwrap_or("").to_owned()
}

/// An upstream that answers `401` as soon as it has a request's head and
/// reads the body afterwards (as nginx's `return 401`, Tomcat and Go
/// servers do), keeping the connection; counts the connections open.
struct EarlyAnswer {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl EarlyAnswer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let open = counted.clone();
                open.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    while let Some(head) = read_head(&mut stream).await {
                        let answer =
                            "HTTP/1.1 401 Unauthorized\r\ncontent-length: 7\r\n\r\nno way\n";
                        if stream.write_all(answer.as_bytes()).await.is_err() {
                            break;
                        }
                        let mut body = vec![0u8; content_length(&head)];
                        if stream.read_exact(&mut body).await.is_err() {
                            break;
                        }
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self { addr, open, task }
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

impl Drop for EarlyAnswer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_to_a_trickled_upload_keeps_no_upstream_connection() {
    let up = EarlyAnswer::start().await;
    let gw = Gateway::start(
        &format!("http://{}", up.addr),
        &[
            "--workers",
            "1",
            "--max-upstream-calls",
            "2",
            "--upstream-timeout",
            "2s",
            "--queue-wait",
            "10s",
            "--route",
            "/api=idempotency-key",
        ],
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for i in 0..6 {
        let (addr, stop, answered) = (gw.addr, stop.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "POST /unrouted/{i} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/octet-stream\r\n\
                 Content-Length: 100000\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            let (mut rd, mut wr) = stream.into_split();
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                while !String::from_utf8_lossy(&got).contains("no way") {
                    match rd.read(&mut buf).await {
                        Ok(0) | Err(_) => return got,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                answered.fetch_add(1, Ordering::SeqCst);
                got
            });
            // A byte every 100 ms, until the test is done with the
            // connection (100000 bytes take far longer).
            while !stop.load(Ordering::SeqCst) {
                if wr.write_all(b"x").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            String::from_utf8_lossy(&reader.await.unwrap()).into_owned()
        }));
    }
    // Every client gets the upstream's early answer.
    for _ in 0..600 {
        if answered.load(Ordering::SeqCst) == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        answered.load(Ordering::SeqCst),
        6,
        "every client gets the 401\n{}",
        gw.log()
    );
    // The answers have ended, the clients are still trickling: their
    // upstream connections are closed, not left with no slot and no
    // deadline.
    let mut open = up.open();
    for _ in 0..200 {
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        open = up.open();
    }
    stop.store(true, Ordering::SeqCst);
    assert_eq!(
        open, 0,
        "the upstream still has {open} connections from the gateway while its clients trickle"
    );
    for client in clients {
        let answer = client.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
}

/// A broken upstream (CL.0): it answers `POST /api/early` without reading
/// its body and then reads that body as a request of its own, whose answer
/// it writes once the next request has come in, followed by that one's own.
struct Desync {
    addr: SocketAddr,
    /// Connections accepted.
    conns: Arc<AtomicUsize>,
    /// The paths of the requests it read, in order.
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

const SMUGGLED: &str = "POST /smuggled HTTP/1.1\r\nHost: up\r\nContent-Length: 0\r\n\r\n";

fn ok(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

impl Desync {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(AtomicUsize::new(0));
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let (counted, log) = (conns.clone(), seen.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                let log = log.clone();
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    let mut answer_later: Option<String> = None;
                    while let Some(head) = read_head(&mut stream).await {
                        let p = path(&head);
                        log.lock().unwrap().push(p.clone());
                        if p == "/api/early" {
                            let early =
                                "HTTP/1.1 401 Unauthorized\r\ncontent-length: 6\r\n\r\nearly\n";
                            if stream.write_all(early.as_bytes()).await.is_err() {
                                return;
                            }
                            // The body is left unread: the next "request".
                            continue;
                        }
                        let mut body = vec![0u8; content_length(&head)];
                        if stream.read_exact(&mut body).await.is_err() {
                            return;
                        }
                        if p == "/smuggled" {
                            answer_later = Some(ok("smuggled answer\n"));
                            continue;
                        }
                        let mut out = answer_later.take().unwrap_or_default();
                        out.push_str(&ok(&format!("genuine answer for {p}\n")));
                        if stream.write_all(out.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            conns,
            seen,
            task,
        }
    }
}

impl Drop for Desync {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `POST path` with `Idempotency-Key: key` and `body`, over a fresh
/// connection; the answer read until the gateway closes it.
async fn post(addr: SocketAddr, path: &str, key: &str, body: &str) -> gateway_support::raw::Raw {
    let (path, key, body) = (path.to_owned(), key.to_owned(), body.to_owned());
    tokio::task::spawn_blocking(move || {
        gateway_support::raw::raw(
            addr,
            "POST",
            path.as_bytes(),
            &[("Idempotency-Key", &key), ("Content-Type", "text/plain")],
            body.as_bytes(),
        )
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desynced_upstreams_stray_answer_is_never_kept_as_another_reply() {
    let up = Desync::start().await;
    let gw = Gateway::start(
        &format!("http://{}", up.addr),
        &["--route", "/api=idempotency-key"],
    );
    let early = post(gw.addr, "/api/early", "early-1", SMUGGLED).await;
    assert_eq!(early.status, 401, "{early:?}");

    // The next call goes on the pooled connection: the upstream answers it
    // with the smuggled request's answer, then with its own.
    let first = post(gw.addr, "/api/order-1", "order-1", "{}").await;
    assert!(
        !(first.status == 200 && first.body.contains("smuggled")),
        "the stray answer was relayed as order-1's: {first:?}\n{}",
        gw.log()
    );
    let retry = post(gw.addr, "/api/order-1", "order-1", "{}").await;
    assert!(
        !retry.body.contains("smuggled"),
        "the stray answer was kept as order-1's reply and replayed: {retry:?}\n{}",
        gw.log()
    );
    assert_eq!(retry.status, 200, "{retry:?}");
    assert!(
        retry.body.contains("genuine answer for /api/order-1"),
        "{retry:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_keepalive_off_opens_a_connection_per_call() {
    let up = Desync::start().await;
    let gw = Gateway::start(
        &format!("http://{}", up.addr),
        &[
            "--route",
            "/api=idempotency-key",
            "--upstream-keepalive",
            "false",
        ],
    );
    let early = post(gw.addr, "/api/early", "early-1", SMUGGLED).await;
    assert_eq!(early.status, 401, "{early:?}");
    let first = post(gw.addr, "/api/order-1", "order-1", "{}").await;
    assert_eq!(first.status, 200, "{first:?}\n{}", gw.log());
    assert!(
        first.body.contains("genuine answer for /api/order-1"),
        "{first:?}"
    );
    let retry = post(gw.addr, "/api/order-1", "order-1", "{}").await;
    assert!(retry.replayed(), "{retry:?}");
    assert!(
        retry.body.contains("genuine answer for /api/order-1"),
        "{retry:?}"
    );
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        2,
        "one connection per call"
    );
    let seen = up.seen.lock().unwrap().clone();
    assert_eq!(
        seen.iter().filter(|p| *p == "/api/order-1").count(),
        1,
        "{seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_keepalive_is_a_config_key() {
    let up = Desync::start().await;
    let cfg = gateway_support::temp_path("keepalive.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://{}\"\nupstream_keepalive = false\n\
             [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n",
            up.addr
        ),
    )
    .unwrap();
    let gw = gateway_support::Proc::start(
        &["--config", cfg.to_str().unwrap()],
        &[],
        std::process::Stdio::null(),
    );
    for key in ["a", "b", "c"] {
        let a = post(gw.addr, "/api/x", key, "{}").await;
        assert_eq!(a.status, 200, "{a:?}");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        3,
        "one connection per call"
    );
    let _ = std::fs::remove_file(&cfg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_is_a_key_of_each_named_upstream() {
    // The default upstream keeps its connections; the named one, with
    // `keepalive = false`, opens one per call.
    let kept = Desync::start().await;
    let closed = Desync::start().await;
    let cfg = gateway_support::temp_path("keepalive-named.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://{}\"\n\
             [[upstreams]]\nname = \"orders\"\nurl = \"http://{}\"\nkeepalive = false\n\
             [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n\
             [[route]]\nprefix = \"/orders\"\npreset = \"idempotency-key\"\nupstream = \"orders\"\n",
            kept.addr, closed.addr
        ),
    )
    .unwrap();
    let gw = gateway_support::Proc::start(
        &["--config", cfg.to_str().unwrap()],
        &[],
        std::process::Stdio::null(),
    );
    for key in ["a", "b", "c"] {
        let a = post(gw.addr, "/api/x", key, "{}").await;
        assert_eq!(a.status, 200, "{a:?}");
        let o = post(gw.addr, "/orders/x", key, "{}").await;
        assert_eq!(o.status, 200, "{o:?}");
    }
    assert_eq!(
        closed.conns.load(Ordering::SeqCst),
        3,
        "the named upstream: one connection per call"
    );
    // One pool per serving thread: at most one connection each.
    let kept = kept.conns.load(Ordering::SeqCst);
    assert!(
        kept < 3,
        "the default upstream keeps its connections: {kept}"
    );
    let _ = std::fs::remove_file(&cfg);
}
