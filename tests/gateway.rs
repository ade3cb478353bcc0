//! The gateway example (`examples/gateway/`) as a real process: each test
//! starts the built binary with `--listen 127.0.0.1:0`, reads its `listening
//! on` line and talks to it over TCP, in front of a real hyper upstream on
//! loopback that counts the calls it gets per path.
//!
//! A plain `cargo test --all-features` builds the examples before it runs
//! integration tests; `cargo test --test gateway` does not, so build the
//! binary first when running this file alone:
//! `cargo build --all-features --example gateway && cargo test --all-features --test gateway`.
//!
//! - every preset with its vectors from `tests/fixtures/`: explicit routes
//!   and `auto` detection, 7 copies at once, one upstream call, the channel's
//!   exact reply bytes; unrecognized requests pass through every time;
//! - forwarding: the request's own bytes, path and query, `x-forwarded-for`
//!   appended, hop-by-hop headers removed, `Host` set;
//! - upstream refused or too slow: the channel's failure reply, never cached;
//! - SIGTERM with a request in flight: it completes, the process exits 0;
//! - bad flags: exit status 2;
//! - `/metrics` counts executed and replayed requests (feature `metrics`);
//! - two instances sharing Redis and Redis Cluster (feature `redis`).

mod common;
#[cfg(feature = "redis")]
mod support_redis;

use bytes::Bytes;
use common::{all_at_once, client, Answer, HttpClient};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Copies of one notification sent at the same instant.
const K: usize = 7;

/// Request headers, owned.
type Headers = Vec<(String, String)>;

// ---------------------------------------------------------------------------
// The upstream: a hyper server that records every request.
// ---------------------------------------------------------------------------

/// A request as the upstream saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

/// Answers 200 `upstream call N for PATH` (N counts calls per path), after
/// `x-delay-ms` milliseconds if that header is set, or `x-status` if set.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Self {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap())
    }

    fn start_on(listener: TcpListener) -> Self {
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let log = log.clone();
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let log = log.clone();
                    async move { Ok::<_, Infallible>(answer(log, req).await) }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, seen, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Calls whose path is `path`.
    fn calls(&self, path: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.uri.split('?').next() == Some(path))
            .count()
    }

    fn last(&self, path: &str) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|s| s.uri.split('?').next() == Some(path))
            .cloned()
            .unwrap_or_else(|| panic!("the upstream never saw {path}"))
    }

    async fn wait_for_call(&self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.calls(path) == 0 {
            assert!(Instant::now() < deadline, "the upstream never saw {path}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(log: Arc<Mutex<Vec<Seen>>>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let uri = parts.uri.to_string();
    let path = parts.uri.path().to_owned();
    let n = {
        let mut log = log.lock().unwrap();
        log.push(Seen {
            method: parts.method.to_string(),
            uri,
            headers: parts.headers.clone(),
            body,
        });
        log.iter()
            .filter(|s| s.uri.split('?').next() == Some(path.as_str()))
            .count()
    };
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = header("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let mut res = Response::new(Full::new(Bytes::from(format!(
        "upstream call {n} for {path}"
    ))));
    if let Some(status) = header("x-status") {
        *res.status_mut() = StatusCode::from_u16(status as u16).unwrap();
    }
    res.headers_mut()
        .insert("content-type", "text/plain".parse().unwrap());
    res.headers_mut()
        .insert("x-upstream", "yes".parse().unwrap());
    res
}

// ---------------------------------------------------------------------------
// The gateway process.
// ---------------------------------------------------------------------------

fn gateway_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir = dir.parent().unwrap();
    }
    let bin = dir
        .join("examples")
        .join(format!("gateway{}", std::env::consts::EXE_SUFFIX));
    let build = "build it with `cargo build --all-features --example gateway` \
                 (a plain `cargo test` builds it; `cargo test --test gateway` does not)";
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {build}", bin.display()));
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gateway");
    let newest = std::fs::read_dir(&source).ok().and_then(|files| {
        files
            .filter_map(Result::ok)
            .filter_map(|f| f.metadata().and_then(|m| m.modified()).ok())
            .max()
    });
    if let Some(changed) = newest {
        assert!(
            built >= changed,
            "{} is older than {}: {build}",
            bin.display(),
            source.display()
        );
    }
    bin
}

fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "tower-idempotency-gateway-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// One running gateway; killed on drop, its log printed if the test failed.
struct Gateway {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// Lines written to stdout after the first.
    more_stdout: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    /// `--listen 127.0.0.1:0 --upstream UPSTREAM ARGS...`
    fn start(upstream: &str, args: &[&str]) -> Self {
        let mut all = vec!["--listen", "127.0.0.1:0", "--upstream", upstream];
        all.extend_from_slice(args);
        let log = temp_path("log");
        let mut child = Command::new(gateway_bin())
            .args(&all)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn the gateway");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let more_stdout: Arc<Mutex<Vec<String>>> = Arc::default();
        let more = more_stdout.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for line in lines.map_while(Result::ok) {
                more.lock().unwrap().push(line);
            }
        });
        let first = rx.recv_timeout(Duration::from_secs(30));
        let addr = match first {
            Ok(Some(Ok(line))) => line
                .strip_prefix("listening on ")
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("unexpected first line {line:?}")),
            other => {
                let _ = child.kill();
                let status = child.wait();
                panic!(
                    "the gateway did not announce itself ({other:?}, {status:?}); stderr:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        Self {
            child,
            addr,
            log,
            more_stdout,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) with a pid this test spawned and still owns.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig})");
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway did not exit within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- gateway {} stderr ----\n{}", self.addr, self.log());
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

async fn send(
    client: &HttpClient,
    url: &str,
    headers: &[(String, String)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut req = Request::post(url);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let res = client
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    common::read(res).await
}

// ---------------------------------------------------------------------------
// The vectors (headers as in tests/channels.rs) and what each preset answers.
// ---------------------------------------------------------------------------

const JSON: (&str, &str) = ("content-type", "application/json");
const XML: (&str, &str) = ("content-type", "text/xml");
const FORM: (&str, &str) = (
    "content-type",
    "application/x-www-form-urlencoded; charset=utf-8",
);

/// One notification.
struct Vector {
    preset: &'static str,
    file: Option<&'static str>,
    inline: &'static str,
    headers: &'static [(&'static str, &'static str)],
}

impl Vector {
    fn body(&self) -> Bytes {
        match self.file {
            Some(f) => fixture(f),
            None => Bytes::from_static(self.inline.as_bytes()),
        }
    }

    fn headers(&self) -> Headers {
        self.headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn label(&self) -> String {
        format!("{} {}", self.preset, self.file.unwrap_or("(inline)"))
    }
}

fn fixture(name: &str) -> Bytes {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

const fn file(
    preset: &'static str,
    file: &'static str,
    headers: &'static [(&'static str, &'static str)],
) -> Vector {
    Vector {
        preset,
        file: Some(file),
        inline: "",
        headers,
    }
}

const WECHAT_V3_HEADERS: &[(&str, &str)] = &[
    JSON,
    ("Wechatpay-Nonce", "EcZ9Cmy4Xyx1i6RlJQzLcCyEqDa26NBz"),
    ("Wechatpay-Timestamp", "1624523846"),
    ("Wechatpay-Serial", "D7CE59D1F522D701"),
    ("Wechatpay-Signature", "tJHIiIS9eB2hAYstmAmbbD3ZE5LiIm/Ug5tuL4fC0YOFRWIHV39UFIZXC0e9Wl6lBu6sKvkqDkzpqzBsVHyXFlbYZTOQrVdG4b6LfTnK4mikv9++ixJMd3vTf2yCqvBkh98zs3Ds5zsYQakzbcwhmw4fMJs4nPLws28H0UW9FjDR//rxELLwXvV1VEA1IBLX70xptjL8hrfUjEE8kkry6yNJTHZRU8CAc7qHli2Ng1V1qb9ARbK8A3ThmFmPQvRGrapI/jS2laKKgYUmfdEdkNO6B2Cke5e8VTxY406ArAmQ90GAihDwIcb16TQMnzCMBoutnwZKNiKRACrFmtxw2Q=="),
];

const STRIPE_HEADERS: &[(&str, &str)] = &[
    JSON,
    (
        "Stripe-Signature",
        "t=1700000000,v1=c488b24db08e6b7ea11d0ce6b4d536817201a6dff3608deb089bd4e413a0ff93",
    ),
];

const VECTORS: &[Vector] = &[
    file(
        "wechatpay-v3",
        "wechatpay_v3_notify_wechatpay-go.json",
        WECHAT_V3_HEADERS,
    ),
    // The official doc example comes with a timestamp only; WeChat Pay always
    // signs, so `auto` gets the signature headers real deliveries carry.
    file(
        "wechatpay-v3",
        "wechatpay_v3_notify_official_doc_transaction_success.json",
        &[
            JSON,
            ("Wechatpay-Timestamp", "1432100975"),
            ("Wechatpay-Serial", "5157F09EFDC096DE15EBE81A47057A7232F1B8E1"),
            ("Wechatpay-Signature", "cmUtc2lnbmVkIGNvcHkgb2YgdGhlIHNhbWUgbm90aWZpY2F0aW9u"),
        ],
    ),
    file(
        "wechatpay-v2",
        "wechatpay_v2_notify_wechatpay-php_paysuccess.xml",
        &[XML],
    ),
    file(
        "wechatpay-v2",
        "wechatpay_v2_notify_SYNTHESIZED_md5_doc_key.xml",
        &[XML],
    ),
    file(
        "wechatpay-v2",
        "wechatpay_v2_notify_SYNTHESIZED_hmacsha256_doc_key.xml",
        &[XML],
    ),
    file(
        "alipay",
        "alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form",
        &[FORM],
    ),
    file(
        "alipay",
        "alipay_notify_servicemarket_order_notify_alipay-sdk-nodejs-all.form",
        &[FORM],
    ),
    file(
        "stripe",
        "stripe_webhook_SYNTHESIZED_stripe-go_testPayload.json",
        STRIPE_HEADERS,
    ),
    file(
        "paypal",
        "paypal_webhook_PayPal-Java-SDK_ValidateCertTest.json",
        &[
            JSON,
            ("PAYPAL-CERT-URL", "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-360caa42-fca2a594-1d93a270"),
            ("PAYPAL-TRANSMISSION-ID", "afa30d40-ca4a-11e9-ab68-7d4e2605c70c"),
            ("PAYPAL-TRANSMISSION-TIME", "2019-08-29T10:49:33Z"),
            ("PAYPAL-AUTH-ALGO", "SHA256withRSA"),
            ("PAYPAL-TRANSMISSION-SIG", "K7DF5+hOyGS6v0xTZ9PkEO+BFNQmpryxw2hFlXbHgmxpu+883ldEC9HcL6ccEmB8sfy80y/Q3qcZZL1MR8Qi0e1ysylVj/yROgKK6zBsQPoNmgXC8yTiNoAjULuhk5Aoau0Itk3nrkgAfji1zvADlErMFM9VZe2nDvhM3nDMLjCi/K5fRjWp3eGo6Nx17GX/WIEibeKDyS+YdJMex3i+KO4aWmm9zznC/FJ5Y/ntd0MxOJNrM0r0f3y7c3e3sO5pB3oPgN6KzKVS5P6AWHqtS8acD3DjgCKZ1uqKz7q954G1aBz2/m0wRGOFFsv0/D3FE2uIheRRmoQtVSOAX7Aupg=="),
        ],
    ),
    file(
        "paypal",
        "paypal_webhook_PayPal-Python-SDK_sample_PAYMENT.SALE.COMPLETED.json",
        &[
            JSON,
            ("PAYPAL-TRANSMISSION-ID", "dfb3be50-fd74-11e4-8bf3-77339302725b"),
            ("PAYPAL-TRANSMISSION-TIME", "2015-05-18T15:45:13Z"),
            ("PAYPAL-CERT-URL", "https://api.sandbox.paypal.com/v1/notifications/certs/CERT-360caa42-fca2a594-a5cafa77"),
            ("PAYPAL-AUTH-ALGO", "sha256"),
            ("PAYPAL-TRANSMISSION-SIG", "thy4/U002quzxFavHPwbfJGcc46E8rc5jzgyeafWm5mICTBdY/8rl7WJpn8JA0GKA+oDTPsSruqusw+XXg5RLAP7ip53Euh9Xu3UbUhQFX7UgwzE2FeYoY6lyRMiiiQLzy9BvHfIzNIVhPad4KnC339dr6y2l+mN8ALgI4GCdIh3/SoJO5wE64Bh/ueWtt8EVuvsvXfda2Le5a2TrOI9vLEzsm9GS79hAR/5oLexNz8UiZr045Mr5ObroH4w4oNfmkTaDk9Rj0G19uvISs5QzgmBpauKr7Nw++JI0pr/v5mFctQkoWJSGfBGzPRXawrvIIVHQ9Wer48GR2g9ZiApWg=="),
        ],
    ),
    file(
        "adyen",
        "adyen_notify_adyen-python_backslash_ENVELOPED.json",
        &[JSON],
    ),
    file(
        "adyen",
        "adyen_notify_adyen-python_colon_ENVELOPED.json",
        &[JSON],
    ),
    file(
        "adyen",
        "adyen_notify_adyen-python_forwardslash_ENVELOPED.json",
        &[JSON],
    ),
    file(
        "adyen",
        "adyen_notify_adyen-python_mixed_ENVELOPED.json",
        &[JSON],
    ),
    file(
        "standard-webhooks",
        "standard_webhooks_standard-webhooks_go_test.json",
        &[
            JSON,
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
        ],
    ),
    file(
        "standard-webhooks",
        "standard_webhooks_standard-webhooks_rust_test.json",
        &[
            JSON,
            ("webhook-id", "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"),
            ("webhook-timestamp", "1649367553"),
        ],
    ),
    Vector {
        preset: "idempotency-key",
        file: None,
        inline: r#"{"order":"A-1","amount":100}"#,
        headers: &[
            JSON,
            ("Idempotency-Key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\""),
            ("Authorization", "Bearer user-1"),
        ],
    },
];

const PRESETS: &[&str] = &[
    "wechatpay-v3",
    "wechatpay-v2",
    "alipay",
    "stripe",
    "paypal",
    "adyen",
    "standard-webhooks",
    "idempotency-key",
];

const WECHAT_SUCCESS: &str = r#"{"code":"SUCCESS","message":"成功"}"#;
const WECHAT_FAIL: &str = r#"{"code":"FAIL","message":"失败"}"#;

/// The success reply of DESIGN §6: status, content type (if fixed), body.
/// `None` body: the upstream's own answer (client APIs).
fn success(preset: &str) -> (u16, Option<&'static str>, Option<&'static str>) {
    match preset {
        "wechatpay-v3" => (200, Some("application/json"), Some(WECHAT_SUCCESS)),
        "wechatpay-v2" => (
            200,
            Some("xml"),
            Some("<xml><return_code><![CDATA[SUCCESS]]></return_code><return_msg><![CDATA[OK]]></return_msg></xml>"),
        ),
        "alipay" => (200, Some("text/plain"), Some("success")),
        "stripe" => (200, Some("application/json"), Some(r#"{"received":true}"#)),
        "paypal" => (200, None, Some("")),
        "adyen" => (200, Some("text/plain"), Some("[accepted]")),
        "standard-webhooks" => (204, None, Some("")),
        "idempotency-key" => (200, Some("text/plain"), None),
        other => panic!("no reply for {other}"),
    }
}

fn assert_success(preset: &str, a: &Answer, path: &str, what: &str) {
    let (status, ct, body) = success(preset);
    assert_eq!(a.status, status, "{what}: status; body {:?}", a.text());
    if let Some(ct) = ct {
        let got = a
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(got.contains(ct), "{what}: content-type {got:?}");
    }
    match body {
        Some(body) => assert_eq!(a.text(), body, "{what}: body"),
        None => assert_eq!(
            a.text(),
            format!("upstream call 1 for {path}"),
            "{what}: body"
        ),
    }
}

/// K copies of `v` to `gateway_path` at once: every copy gets the success
/// reply, K-1 of them replayed, and the upstream sees one call with the
/// request's own bytes.
async fn storm(client: &HttpClient, gw: &Gateway, up: &Upstream, v: &Vector, path: &str) {
    let url = gw.url(path);
    let headers = v.headers();
    let body = v.body();
    let answers = all_at_once(K, |_| {
        let (client, url, headers, body) =
            (client.clone(), url.clone(), headers.clone(), body.clone());
        async move { send(&client, &url, &headers, body).await }
    })
    .await;
    let what = format!("{} at {path}", v.label());
    for a in &answers {
        assert_success(v.preset, a, path, &what);
    }
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, K - 1, "{what}: replayed copies");
    assert_eq!(up.calls(path), 1, "{what}: upstream calls");
    assert_eq!(
        up.last(path).body,
        body,
        "{what}: the upstream got other bytes"
    );
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_routes_run_each_vector_once_and_answer_the_channel_reply() {
    let up = Upstream::start().await;
    let routes: Vec<String> = PRESETS
        .iter()
        .flat_map(|p| ["--route".to_owned(), format!("/p/{p}={p}")])
        .collect();
    let args: Vec<&str> = routes.iter().map(String::as_str).collect();
    let gw = Gateway::start(&up.url(), &args);
    let client = client();
    for (i, v) in VECTORS.iter().enumerate() {
        storm(&client, &gw, &up, v, &format!("/p/{}/{i}", v.preset)).await;
    }
    // Longest prefix wins: `/p/stripe/...` is not `auto` nor another preset;
    // a path under no route passes through untouched.
    let stripe = &VECTORS[7];
    assert_eq!(stripe.preset, "stripe");
    for _ in 0..2 {
        let a = send(
            &client,
            &gw.url("/elsewhere"),
            &stripe.headers(),
            stripe.body(),
        )
        .await;
        assert!(a.text().starts_with("upstream call"), "{}", a.text());
    }
    assert_eq!(up.calls("/elsewhere"), 2);
    assert!(
        gw.more_stdout.lock().unwrap().is_empty(),
        "one stdout line only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_detects_every_channel_and_passes_the_rest_through() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up.url(), &[]);
    let client = client();
    for (i, v) in VECTORS.iter().enumerate() {
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
    let v = &VECTORS[5];
    assert_eq!(v.preset, "alipay");
    let mut padded = v.body().to_vec();
    padded.extend_from_slice(b"&pad=");
    padded.resize(65 * 1024, b'x');
    let a = send(&client, &gw.url("/big/alipay"), &v.headers(), padded).await;
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
    let v = &VECTORS[7];
    assert_eq!(v.preset, "stripe");
    let answers = all_at_once(K, |_| {
        let (client, url, headers, body) = (h2.clone(), gw.url("/h2"), v.headers(), v.body());
        async move { send(&client, &url, &headers, body).await }
    })
    .await;
    for a in &answers {
        assert_success("stripe", a, "/h2", "h2");
    }
    assert_eq!(up.calls("/h2"), 1);
}

/// Sends raw HTTP/1.1 and reads until the server closes.
fn raw_http(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

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
    let reply = tokio::task::spawn_blocking(move || raw_http(addr, &req))
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
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    ] {
        assert!(!h.contains_key(gone), "{gone} reached the upstream: {h:?}");
    }
    if let Some(c) = h.get("connection") {
        assert!(!c.to_str().unwrap().contains("X-Hop"), "{c:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_upstream_does_not_downgrade_the_reply() {
    // An upstream that answers every request in HTTP/1.0 and closes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = vec![0u8; 65536];
            let mut len = 0;
            while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf[len..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => len += n,
                }
            }
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

/// A loopback port nobody listens on (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gets_the_failure_reply_and_the_retry_is_forwarded() {
    let port = free_port();
    let gw = Gateway::start(
        &format!("http://127.0.0.1:{port}"),
        &[
            "--route",
            "/wx=wechatpay-v3",
            "--route",
            "/orders=idempotency-key",
        ],
    );
    let client = client();
    let wx = &VECTORS[0];
    let order = &VECTORS[VECTORS.len() - 1];
    assert_eq!(
        (wx.preset, order.preset),
        ("wechatpay-v3", "idempotency-key")
    );

    // Refused: WeChat Pay gets its failure reply, the client API a 502.
    for _ in 0..2 {
        let a = send(&client, &gw.url("/wx/notify"), &wx.headers(), wx.body()).await;
        assert_eq!((a.status, a.text().as_str()), (500, WECHAT_FAIL));
        assert!(a.headers["content-type"].to_str().unwrap().contains("json"));
        let a = send(&client, &gw.url("/orders"), &order.headers(), order.body()).await;
        assert_eq!(a.status, 502, "{}", a.text());
        assert!(!a.replayed());
    }

    // The upstream comes back: the retry is forwarded (the failure was not
    // cached), and the one after it replays.
    let up = Upstream::start_on(
        TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("rebind the upstream port"),
    );
    let a = send(&client, &gw.url("/wx/notify"), &wx.headers(), wx.body()).await;
    assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(!a.replayed());
    let a = send(&client, &gw.url("/wx/notify"), &wx.headers(), wx.body()).await;
    assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
    assert!(a.replayed());
    assert_eq!(up.calls("/wx/notify"), 1);

    let a = send(&client, &gw.url("/orders"), &order.headers(), order.body()).await;
    assert_eq!(
        (a.status, a.text().as_str()),
        (200, "upstream call 1 for /orders")
    );
    let a = send(&client, &gw.url("/orders"), &order.headers(), order.body()).await;
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
    let v = &VECTORS[5];
    assert_eq!(v.preset, "alipay");
    let slow: Headers = v
        .headers()
        .into_iter()
        .chain([("x-delay-ms".to_owned(), "3000".to_owned())])
        .collect();
    let failing: Headers = v
        .headers()
        .into_iter()
        .chain([("x-status".to_owned(), "503".to_owned())])
        .collect();
    // Too slow (the reply deadline), then the upstream's own 503: both answered with
    // Alipay's `fail`, and each retry reaches the upstream again.
    let started = Instant::now();
    let a = send(&client, &gw.url("/ali"), &slow, v.body()).await;
    assert_eq!((a.status, a.text().as_str()), (500, "fail"));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    let a = send(&client, &gw.url("/ali"), &failing, v.body()).await;
    assert_eq!((a.status, a.text().as_str()), (500, "fail"));
    let a = send(&client, &gw.url("/ali"), &v.headers(), v.body()).await;
    assert_eq!((a.status, a.text().as_str()), (200, "success"));
    assert!(!a.replayed());
    let a = send(&client, &gw.url("/ali"), &v.headers(), v.body()).await;
    assert!(a.replayed());
    assert_eq!(up.calls("/ali"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_request_in_flight_and_exits_0() {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up.url(), &["--route", "/=wechatpay-v3"]);
    let client = client();
    let v = &VECTORS[0];
    let headers: Headers = v
        .headers()
        .into_iter()
        .chain([("x-delay-ms".to_owned(), "1500".to_owned())])
        .collect();
    let in_flight = tokio::spawn({
        let (client, url, body) = (client.clone(), gw.url("/slow"), v.body());
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

#[test]
fn bad_flags_exit_2_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "--listen"),
        (&["--listen", "127.0.0.1:0"], "--upstream"),
        (&["--upstream", "http://127.0.0.1:1"], "--listen"),
        (
            &["--listen", "localhost", "--upstream", "http://127.0.0.1:1"],
            "IP:PORT",
        ),
        (
            &["--listen", "127.0.0.1:0", "--upstream", "ftp://x"],
            "http://",
        ),
        (
            // https upstreams work; one with a query does not.
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "https://x/base?q=1",
            ],
            "query",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--frobnicate",
            ],
            "unknown flag",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--window",
            ],
            "needs a value",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--window",
                "25x",
            ],
            "unit",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--lease",
                "0s",
            ],
            "more than 0",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--wait",
                "soon",
            ],
            "--wait",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--max-body",
                "64KB",
            ],
            "KiB",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--route",
                "/x",
            ],
            "PREFIX=PRESET",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--route",
                "x=stripe",
            ],
            "start with",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--route",
                "/x=bitcoin",
            ],
            "unknown preset",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--route",
                "/x=stripe",
                "--route",
                "/x/=alipay",
            ],
            "twice",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "mongodb://x:1",
            ],
            "redis://",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "redis+cluster://a:1,b",
            ],
            "HOST:PORT",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--on-store-error",
                "maybe",
            ],
            "closed",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--principal-header",
                "bad header",
            ],
            "header",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--metrics-listen",
                "9100",
            ],
            "IP:PORT",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "stray",
            ],
            "unexpected",
        ),
    ];
    let bin = gateway_bin();
    for (args, hint) in cases {
        let out = Command::new(&bin)
            .args(*args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("gateway: "), "{args:?}: {stderr}");
        assert!(stderr.contains(hint), "{args:?}: {stderr:?} lacks {hint:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // --help is not an error.
    let out = Command::new(&bin).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--route PREFIX=PRESET"));

    // A taken port is a failure at start (1), not a bad flag.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = Command::new(&bin)
        .args(["--listen", &taken.local_addr().unwrap().to_string()])
        .args(["--upstream", "http://127.0.0.1:1"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty());
}

/// `name{labels} value` lines of a Prometheus text body whose labels include
/// every one of `want`.
#[cfg(feature = "metrics")]
fn sample(text: &str, name: &str, want: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            series
                .strip_prefix(name)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('{'))
                && want.iter().all(|w| series.contains(w))
        })
        .and_then(|(_, v)| v.parse().ok())
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_executed_and_replayed() {
    let up = Upstream::start().await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let gw = Gateway::start(&up.url(), &["--metrics-listen", &metrics_addr]);
    let client = client();
    let v = &VECTORS[7];
    assert_eq!(v.preset, "stripe");
    for _ in 0..3 {
        let a = send(&client, &gw.url("/stripe"), &v.headers(), v.body()).await;
        assert_eq!(a.status, 200);
    }
    let res = client
        .request(
            Request::get(format!("http://{metrics_addr}/metrics"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let a = common::read(res).await;
    assert_eq!(a.status, 200);
    let text = a.text();
    let count = |outcome: &str| {
        sample(
            &text,
            "idempotency_requests_total",
            &["preset=\"stripe\"", &format!("outcome=\"{outcome}\"")],
        )
    };
    assert_eq!(count("executed"), Some(1.0), "{text}");
    assert_eq!(count("replayed"), Some(2.0), "{text}");
    let ratio = sample(&text, "idempotency_duplicate_ratio", &["preset=\"stripe\""])
        .unwrap_or_else(|| panic!("no duplicate ratio in\n{text}"));
    assert!((ratio - 2.0 / 3.0).abs() < 1e-9, "{ratio}");
    assert!(
        sample(&text, "idempotency_store_seconds_count", &[]).is_some_and(|n| n >= 1.0),
        "{text}"
    );
    let res = client
        .request(
            Request::get(format!("http://{metrics_addr}/other"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use support_redis::{shared_cluster, shared_standalone};

    /// K copies of the WeChat Pay v3 vector (the upstream takes 300 ms),
    /// spread over two gateways: one upstream call, K successes.
    async fn storm_over(a: &Gateway, b: &Gateway, up: &Upstream, path: &str) {
        let client = client();
        let v = &VECTORS[0];
        let headers: Headers = v
            .headers()
            .into_iter()
            .chain([("x-delay-ms".to_owned(), "300".to_owned())])
            .collect();
        let answers = all_at_once(K, |i| {
            let url = if i % 2 == 0 { a.url(path) } else { b.url(path) };
            let (client, headers, body) = (client.clone(), headers.clone(), v.body());
            async move { send(&client, &url, &headers, body).await }
        })
        .await;
        for a in &answers {
            assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
        }
        assert_eq!(up.calls(path), 1);
        // Later copies on either instance replay.
        for gw in [a, b] {
            let r = send(&client, &gw.url(path), &v.headers(), v.body()).await;
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
        let a = Gateway::start(&up.url(), &["--store", &store]);
        let b = Gateway::start(&up.url(), &["--store", &store]);
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
        let a = Gateway::start(&up.url(), &["--store", &store]);
        let b = Gateway::start(&up.url(), &["--store", &store]);
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
        let v = &VECTORS[0];
        redis.stop();
        let a = send(&client, &closed.url("/p7/closed"), &v.headers(), v.body()).await;
        assert_eq!((a.status, a.text().as_str()), (500, WECHAT_FAIL));
        assert_eq!(up.calls("/p7/closed"), 0);
        let a = send(&client, &open.url("/p7/open"), &v.headers(), v.body()).await;
        assert_eq!((a.status, a.text().as_str()), (200, WECHAT_SUCCESS));
        assert_eq!(up.calls("/p7/open"), 1);

        redis.restart();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let a = send(&client, &closed.url("/p7/closed"), &v.headers(), v.body()).await;
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
        let mut a = Gateway::start(&up.url(), &["--store", &store]);
        let v = &VECTORS[0];
        let headers: Headers = v
            .headers()
            .into_iter()
            .chain([("x-delay-ms".to_owned(), "1000".to_owned())])
            .collect();
        // Raw TCP, so that hanging up really closes the connection.
        let mut request = String::from("POST /redis/hangup HTTP/1.1\r\nHost: gw\r\n");
        for (k, v) in &headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = v.body();
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

        let b = Gateway::start(&up.url(), &["--store", &store]);
        let r = send(&client(), &b.url("/redis/hangup"), &v.headers(), v.body()).await;
        assert_eq!((r.status, r.text().as_str()), (200, WECHAT_SUCCESS));
        assert!(r.replayed(), "the first call's record was not written");
        assert_eq!(up.calls("/redis/hangup"), 1);
    }
}
