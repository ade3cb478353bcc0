//! The alert rules and the dashboard in `deploy/`: the rules pass
//! `promtool test rules` on the series `deploy/prometheus/alerts.test.yml`
//! writes, and every metric the rules and the dashboard name is one a
//! running gateway exports from its start.
//!
//! `promtool` comes with Debian's `prometheus` package; CI installs it.

use crate::gateway_support;
use test_support::common;

use common::upstream::Upstream;
use common::vectors::{fixture, STRIPE_VECTORS};
use common::{client, free_addr, post};
use gateway_support::{get, storm::send_vector, temp_path, Proc};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn deploy(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

/// `promtool`, or `None` (said loudly) outside CI when it is missing.
fn promtool() -> Option<&'static str> {
    let found = Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return Some("promtool");
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "promtool is missing in CI: .ci/run installs Debian's prometheus package"
    );
    eprintln!("SKIPPED: promtool not found (apt-get install -y prometheus)");
    None
}

#[test]
fn alert_rules_pass_their_promtool_tests() {
    let Some(promtool) = promtool() else { return };
    for args in [
        vec!["check", "rules", "alerts.yml"],
        vec!["test", "rules", "alerts.test.yml"],
    ] {
        let out = Command::new(promtool)
            .args(&args)
            .current_dir(deploy("prometheus"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Every rule has a unit test: a rule added without one fails here.
#[test]
fn every_alert_has_a_unit_test() {
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(deploy("prometheus/alerts.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 9, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!("alertname: {alert}\n")),
            "{alert} has no test in alerts.test.yml"
        );
    }
}

/// The names `idempotency_*` and `gateway_*` a file mentions, without the
/// histogram suffixes Prometheus adds.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts = text[i..].starts_with("idempotency_") || text[i..].starts_with("gateway_");
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if starts && boundary {
            let end = text[i..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .map_or(text.len(), |n| i + n);
            names.insert(base_name(&text[i..end]).to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

fn base_name(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// The metric families in a `/metrics` text.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|n| base_name(n).to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_dashboard_name_is_exported() {
    let up = Upstream::start().await;
    let metrics = free_addr();
    let dir = temp_path("deploy-queue");
    let (upstream, metrics_arg) = (up.url(), metrics.to_string());
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
            "--route",
            "/stripe=stripe",
            "--data-dir",
            dir.to_str().unwrap(),
            "--journal",
            "--metrics-listen",
            &metrics_arg,
        ],
        &[],
        Stdio::inherit(),
    );
    // A notification and its copy on the ack route (the queue's worker
    // publishes its gauges) and on the synchronous `auto` route (the
    // latency histograms and the duplicate ratio have samples).
    let body = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let http = client();
    for _ in 0..2 {
        let headers = [("content-type", "application/json")];
        let a = post(&http, gw.addr, "/wx", &headers, body.clone()).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let url = format!("http://{}/stripe", gw.addr);
        let a = send_vector(&http, &url, &STRIPE_VECTORS[0]).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let mut wanted = names_in(&std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap());
    wanted.extend(names_in(
        &std::fs::read_to_string(deploy("grafana/gateway.json")).unwrap(),
    ));
    assert!(wanted.contains("idempotency_requests_total"), "{wanted:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let missing = loop {
        let (status, text) = get(metrics, "/metrics");
        assert_eq!(status, 200);
        let have = exported(&text);
        let missing: Vec<&String> = wanted.iter().filter(|n| !have.contains(*n)).collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exported: {missing:?}"
    );
}

#[test]
fn the_dashboard_shows_what_an_operator_needs() {
    let text = std::fs::read_to_string(deploy("grafana/gateway.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let titles: Vec<&str> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for want in [
        "Requests by outcome",
        "Duplicate ratio",
        "Latency",
        "Store latency",
        "Queue depth",
        "Oldest queued",
        "Dead letters",
    ] {
        assert!(
            titles.iter().any(|t| t.starts_with(want)),
            "no panel {want:?} in {titles:?}"
        );
    }
}

/// `idempotency_duplicate_ratio` is the ratio over the last window
/// (`--ratio-window`, 5 minutes by default), not since the start: after
/// 20 first copies and a quiet window, one new event and its copy read
/// 0.5, where a ratio since the start would read 1/22.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duplicate_ratio_covers_the_last_window() {
    let up = Upstream::start().await;
    let metrics = free_addr();
    let (upstream, metrics_arg) = (up.url(), metrics.to_string());
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/stripe=stripe",
            "--ratio-window",
            "3s",
            "--metrics-listen",
            &metrics_arg,
        ],
        &[],
        Stdio::inherit(),
    );
    let http = client();
    let send = |id: String| {
        let http = http.clone();
        async move {
            let body = format!(r#"{{"id":"{id}","object":"event","type":"charge.succeeded"}}"#);
            let headers = [("content-type", "application/json")];
            post(&http, gw.addr, "/stripe", &headers, body).await
        }
    };
    let ratio = || {
        let (_, text) = get(metrics, "/metrics");
        text.lines()
            .find(|l| l.starts_with("idempotency_duplicate_ratio{") && l.contains("stripe"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    for i in 0..20 {
        let a = send(format!("evt_first_{i}")).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(ratio(), Some(0.0));
    tokio::time::sleep(Duration::from_millis(4500)).await;
    for _ in 0..2 {
        let a = send("evt_after_the_window".into()).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let got = ratio().expect("no duplicate ratio");
    assert!(
        (got - 0.5).abs() < 1e-9,
        "ratio {got}, want 0.5 (since the start: 1/22)"
    );
}
