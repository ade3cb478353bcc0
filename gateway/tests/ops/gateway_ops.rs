//! The gateway as an operator runs it: logs that never block,
//! JSON logs, a trace collector that is down, health endpoints,
//! environment variables, a config file, stalled clients. Each test starts the
//! gateway binary.

use crate::gateway_support;
use test_support::common;

use bytes::Bytes;
use common::client;
use common::upstream::Upstream;
use gateway_support::{get, Proc};
use http::Request;
use http_body_util::Full;
use std::process::Stdio;
use std::time::Duration;

/// A log collector that stops reading (stderr is a pipe nobody reads)
/// must not stop the gateway: it keeps answering, losing log lines.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_log_sink_does_not_stop_the_gateway() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/api=idempotency-key",
        ],
        &[("RUST_LOG", "debug")],
        Stdio::piped(), // never read
    );
    let client = client();
    let n = 2_000;
    for i in 0..n {
        let req = Request::post(format!("http://{}/api/orders", gw.addr))
            .header("idempotency-key", format!("order-{i}"))
            .body(Full::new(Bytes::from(format!("{{\"order\":{i}}}"))))
            .unwrap();
        let res = tokio::time::timeout(Duration::from_secs(20), client.request(req))
            .await
            .unwrap_or_else(|_| {
                panic!("request {i} got no answer within 20 s: the gateway stalled")
            })
            .unwrap();
        assert_eq!(res.status(), 200, "request {i}");
    }
    assert_eq!(up.total(), n);
}

/// POSTs `body` to `url` with an `Idempotency-Key`; the status.
async fn post_key(url: &str, key: &str, body: &str) -> u16 {
    let req = Request::post(url)
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(20), client().request(req))
        .await
        .expect("an answer within 20 s")
        .unwrap();
    res.status().as_u16()
}

#[tokio::test(flavor = "multi_thread")]
async fn health_endpoints_and_dropped_log_lines_share_the_metrics_listener() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let admin = common::free_addr().to_string();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--metrics-listen",
            &admin,
        ],
        &[],
        Stdio::null(),
    );
    let admin: std::net::SocketAddr = admin.parse().unwrap();
    let _ = &gw;
    assert_eq!(get(admin, "/healthz"), (200, "ok\n".to_owned()));
    assert_eq!(get(admin, "/readyz"), (200, "ready\n".to_owned()));
    let (status, metrics) = get(admin, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("gateway_log_lines_dropped_total 0"),
        "{metrics}"
    );
    assert_eq!(get(admin, "/nothing").0, 404);
}

/// The sum of a counter's series in a Prometheus text page.
fn counter_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `--log-format json`: every line of the log is one JSON object, and the
/// lines of a request (its access line among them) carry its `request_id`
/// and `trace_id`. Traces go to a collector that is down (nothing listens
/// at `OTEL_EXPORTER_OTLP_ENDPOINT`): every request is answered as without
/// tracing and at once, and the spans it could not take are counted.
#[tokio::test(flavor = "multi_thread")]
async fn json_logs_parse_and_a_down_collector_costs_no_answer() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let admin = common::free_addr();
    let collector = format!("http://{}", common::free_addr());
    let log = gateway_support::temp_path("json-log");
    let mut gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/api=idempotency-key",
            "--metrics-listen",
            &admin.to_string(),
            "--log-format",
            "json",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector),
            ("OTEL_BSP_SCHEDULE_DELAY", "20"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "8"),
        ],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let client = client();
    let n = 40;
    for i in 0..n {
        let req = Request::post(format!("http://{}/api/orders", gw.addr))
            .header("idempotency-key", format!("order-{i}"))
            .header("x-request-id", format!("req-{i}"))
            .body(Full::new(Bytes::from(format!("{{\"order\":{i}}}"))))
            .unwrap();
        let started = std::time::Instant::now();
        let res = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .unwrap_or_else(|_| panic!("request {i}: no answer within 10 s"))
            .unwrap();
        assert_eq!(res.status(), 200, "request {i}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "request {i} took {took:?}");
    }
    assert_eq!(up.total(), n);
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = get(admin, "/metrics").1;
        if counter_sum(&metrics, "gateway_trace_spans_dropped_total") > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dropped = counter_sum(&metrics, "gateway_trace_spans_dropped_total");
    assert!(dropped > 0.0, "no dropped span counted: {metrics}");
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_exit(Duration::from_secs(20)).success());
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let mut access = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}\n{text}"));
        for field in ["timestamp", "level", "target"] {
            assert!(v[field].is_string(), "no {field}: {line}");
        }
        if v["target"] == "gateway::access" {
            access.push(v);
        }
    }
    assert_eq!(access.len(), n, "{text}");
    let mut traces = std::collections::HashSet::new();
    for (i, line) in access.iter().enumerate() {
        assert_eq!(line["request_id"], format!("req-{i}"), "{line}");
        assert_eq!(line["route"], "/api", "{line}");
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["outcome"], "executed", "{line}");
        let trace = line["trace_id"].as_str().unwrap_or_default();
        assert!(
            trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit()),
            "{line}"
        );
        assert!(
            traces.insert(trace.to_owned()),
            "one trace per request: {line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_flag_can_come_from_the_environment() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let gw = Proc::start(
        &[],
        &[
            ("IDEMPOTENCY_GATEWAY_LISTEN", "127.0.0.1:0"),
            ("IDEMPOTENCY_GATEWAY_UPSTREAM", &upstream),
            (
                "IDEMPOTENCY_GATEWAY_ROUTE",
                "/api=idempotency-key,/other=stripe",
            ),
            ("IDEMPOTENCY_GATEWAY_MAX_BODY", "1KiB"),
        ],
        Stdio::null(),
    );
    let url = format!("http://{}/api/orders", gw.addr);
    assert_eq!(post_key(&url, "k1", "{}").await, 200);
    assert_eq!(post_key(&url, "k1", "{}").await, 200);
    assert_eq!(up.total(), 1, "the copy is replayed");
    // IDEMPOTENCY_GATEWAY_MAX_BODY applies.
    assert_eq!(post_key(&url, "k2", &"x".repeat(2048)).await, 413);
}

/// A config file with routes and per-route settings; a flag overrides the
/// file's upstream.
#[tokio::test(flavor = "multi_thread")]
async fn a_config_file_sets_routes_and_flags_override_it() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let path = gateway_support::temp_path("gateway.toml");
    std::fs::write(
        &path,
        format!(
            r#"listen = "127.0.0.1:0"
upstream = "http://127.0.0.1:{dead}"
store = "memory"
max_memory = "64MiB"

[[route]]
prefix = "/api"
preset = "idempotency-key"
window = "1h"
max_body = "1KiB"

[[route]]
prefix = "/notify/wechat"
preset = "wechatpay-v3"
"#,
            dead = common::free_port()
        ),
    )
    .unwrap();
    let gw = Proc::start(
        &["--config", path.to_str().unwrap(), "--upstream", &upstream],
        &[],
        Stdio::null(),
    );
    let url = format!("http://{}/api/orders", gw.addr);
    assert_eq!(post_key(&url, "k1", "{}").await, 200);
    assert_eq!(post_key(&url, "k1", "{}").await, 200);
    assert_eq!(up.total(), 1);
    assert_eq!(
        post_key(&url, "k2", &"x".repeat(2048)).await,
        413,
        "the route's max_body"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn check_config_exits_0_or_2_with_the_line_and_the_reason() {
    let bin = gateway_support::gateway_bin();
    let path = gateway_support::temp_path("check.toml");
    let good = "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9\"\n\n[[route]]\nprefix = \"/notify\"\npreset = \"alipay\"\nwindow = \"25h\"\n";
    std::fs::write(&path, good).unwrap();
    let out = std::process::Command::new(&bin)
        .args(["--config", path.to_str().unwrap(), "--check-config"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty());

    let cases: &[(&str, &str)] = &[
        (
            &good.replace("window = \"25h\"", "window = \"25x\""),
            ":7: `window`",
        ),
        (
            &good.replace("preset = \"alipay\"", "preset = \"bitcoin\""),
            ":6: unknown preset",
        ),
        (
            &good.replace("prefix = \"/notify\"", "prefx = \"/notify\""),
            ":5: unknown field",
        ),
        (
            &format!("{good}\n[[route]]\nprefix = \"/notify/\"\npreset = \"stripe\"\n"),
            ":10: the prefix `/notify` is routed twice",
        ),
        ("upstream = \"ftp://x\"\n", ":1: `upstream`"),
        (&format!("log_format = \"xml\"\n{good}"), ":1: `log_format`"),
        (
            &format!("trace_sample_ratio = 1.5\n{good}"),
            ":1: `trace_sample_ratio`",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(&bin)
            .args(["--config", path.to_str().unwrap(), "--check-config"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(want), "{stderr:?} lacks {want:?}");
        assert!(stderr.contains(path.to_str().unwrap()), "{stderr}");
    }
    // A file the config names that cannot be read: its line, its key.
    let missing = "/nonexistent/idempotency-gateway-test/file.pem";
    let file_cases: Vec<(String, &str)> = vec![
        (
            format!("admin_listen = \"127.0.0.1:0\"\nadmin_token_file = \"{missing}\"\n{good}"),
            ":2: `admin_token_file`: cannot read",
        ),
        (
            format!("tls_cert = \"{missing}\"\ntls_key = \"{missing}\"\n{good}"),
            ":1: `tls_cert`: cannot read",
        ),
        (
            format!("admin_listen = \"127.0.0.1:0\"\nadmin_tls_cert = \"{missing}\"\nadmin_tls_key = \"{missing}\"\n{good}"),
            ":2: `admin_tls_cert`: cannot read",
        ),
        (
            format!("upstream_ca = \"{missing}\"\n{good}"),
            ":1: `upstream_ca`: cannot read",
        ),
        (
            format!("queue = \"redis://127.0.0.1:1\"\nqueue_secret_file = \"{missing}\"\n{good}"),
            ":2: `queue_secret_file`: cannot read",
        ),
        (
            format!("{good}\n[[upstreams]]\nname = \"ledger\"\nurl = \"http://127.0.0.1:9\"\nca = \"{missing}\"\n"),
            ":12: `ca`: cannot read",
        ),
    ];
    for (text, want) in &file_cases {
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(&bin)
            .args(["--config", path.to_str().unwrap(), "--check-config"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        let line = format!("{}{want}", path.display());
        assert!(stderr.contains(&line), "{stderr:?} lacks {line:?}");
    }
    // The OpenTelemetry variables are checked at start too.
    std::fs::write(&path, good).unwrap();
    for (env, want) in [
        (
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://x"),
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
        (("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"), "`http/json`"),
        (("OTEL_TRACES_SAMPLER_ARG", "2"), "OTEL_TRACES_SAMPLER_ARG"),
    ] {
        let out = std::process::Command::new(&bin)
            .args(["--config", path.to_str().unwrap(), "--check-config"])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
            .env("OTEL_TRACES_SAMPLER", "traceidratio")
            .env(env.0, env.1)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(want), "{stderr:?} lacks {want:?}");
    }
    let _ = std::fs::remove_file(&path);
}

/// 800 clients that send half a header and stall do not stop real
/// notifications; the header read timeout closes them.
#[tokio::test(flavor = "multi_thread")]
async fn stalled_clients_do_not_stop_real_notifications() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let upstream = up.url();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/api=idempotency-key",
            "--header-timeout",
            "3s",
        ],
        &[("RUST_LOG", "warn")],
        Stdio::null(),
    );
    let mut stalled = Vec::new();
    for _ in 0..800 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"POST /api/orders HTTP/1.1\r\nHost: gw\r\nIdempot")
            .await
            .unwrap();
        stalled.push(s);
    }
    let url = format!("http://{}/api/orders", gw.addr);
    for i in 0..50 {
        assert_eq!(
            post_key(&url, &format!("real-{i}"), "{}").await,
            200,
            "request {i}"
        );
    }
    assert_eq!(up.total(), 50);
    // The header read timeout closes the stalled connections.
    let mut first = stalled.swap_remove(0);
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), first.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "a stalled connection was still open after 30 s"
    );
}

/// An idle keep-alive connection is closed after `--header-timeout`: the
/// next request's headers did not come in time.
#[tokio::test(flavor = "multi_thread")]
async fn idle_keep_alive_connections_are_closed_after_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let upstream = up.url();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--header-timeout",
            "2s",
        ],
        &[("RUST_LOG", "warn")],
        Stdio::null(),
    );
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    // Idle, kept alive: closed within the timeout plus a wide margin.
    let rest = tokio::time::timeout(Duration::from_secs(30), async {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
        rest
    })
    .await;
    assert!(
        rest.is_ok(),
        "the idle connection was still open after 30 s"
    );
}

/// The memory store's budget (`--max-memory`) and what it holds are in
/// `/metrics`: bytes, records and evictions, early ones included when the
/// traffic outgrows the budget.
#[tokio::test(flavor = "multi_thread")]
async fn store_bytes_records_and_evictions_are_in_the_metrics() {
    let up = Upstream::start().await;
    let upstream = up.url();
    let admin = common::free_addr().to_string();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/orders=idempotency-key",
            "--max-memory",
            "64KiB",
            "--metrics-listen",
            &admin,
        ],
        &[],
        Stdio::null(),
    );
    let admin: std::net::SocketAddr = admin.parse().unwrap();
    let url = format!("http://{}/orders", gw.addr);
    let n = 400;
    for i in 0..n {
        let status = post_key(&url, &format!("order-{i}"), "{\"amount\":1}").await;
        assert_eq!(status, 200, "request {i}");
    }
    assert_eq!(up.total(), n);
    let (status, metrics) = get(admin, "/metrics");
    assert_eq!(status, 200);
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{metrics}"))
    };
    let bytes = value("idempotency_store_bytes");
    assert!(bytes > 0.0 && bytes <= 65536.0, "{bytes} bytes held");
    let records = value("idempotency_store_records");
    assert!(
        records > 0.0 && records < n as f64,
        "{records} records held"
    );
    let early = value("idempotency_store_evictions_total{reason=\"early\"}");
    assert!(early > 0.0, "{early} early evictions");
}

/// `max_run` (global and per route), `local_max_memory` and
/// `drain_timeout` are read from the config file, checked like the rest.
#[test]
fn config_file_takes_the_run_limit_the_local_tier_and_the_drain_timeout() {
    let bin = gateway_support::gateway_bin();
    let path = gateway_support::temp_path("limits.toml");
    let good = "upstream = \"http://127.0.0.1:9\"\nlisten = \"127.0.0.1:0\"\nmax_run = \"2m\"\nlocal_max_memory = \"16MiB\"\ndrain_timeout = \"20s\"\n[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\nmax_run = \"30s\"\n";
    let check = |text: &str| {
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(&bin)
            .args(["--config", path.to_str().unwrap(), "--check-config"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = check(good);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) =
        check(&good.replace("local_max_memory = \"16MiB\"", "local_max_memory = 0"));
    assert_eq!(code, Some(0), "0 turns the local tier off: {stderr}");
    for (text, want) in [
        (
            good.replace("max_run = \"30s\"", "max_run = \"0s\""),
            ":9: `max_run`",
        ),
        (
            good.replace("max_run = \"2m\"", "max_run = \"soon\""),
            ":3: `max_run`",
        ),
        (
            good.replace("\"16MiB\"", "\"16 parsecs\""),
            ":4: `local_max_memory`",
        ),
        (good.replace("\"20s\"", "\"later\""), ":5: `drain_timeout`"),
    ] {
        let (code, stderr) = check(&text);
        assert_eq!(code, Some(2), "{text}: {stderr}");
        assert!(stderr.contains(want), "{stderr:?} lacks {want:?}");
    }
    let _ = std::fs::remove_file(&path);
}
