//! The gateway's flags as a real process: bad flags exit 2 with a
//! message, `--help` exits 0, a taken port exits 1; `/metrics` counts
//! executed and replayed requests (feature `metrics`).

use crate::gateway_support;
use test_support::common;

use common::{client, upstream::Upstream, vectors::STRIPE_VECTORS};
use gateway_support::storm::send_vector;
use gateway_support::{exits_2, gateway_bin};
use gateway_support::{get, Gateway};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A bad flag exits 2 with the gateway's message; the whole table of bad
/// flags and their messages is the binary's unit tests (`settings/tests.rs`).
#[test]
fn bad_flags_exit_2_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "`--listen ADDR` is required"),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--frobnicate",
            ],
            "unknown flag `--frobnicate`",
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
            "invalid value '25x' for '--window <DUR>'",
        ),
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "stray",
            ],
            "unexpected argument `stray`",
        ),
    ];
    let bin = gateway_bin();
    for (args, hint) in cases {
        let mut cmd = Command::new(&bin);
        cmd.args(*args);
        exits_2(cmd, hint);
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

    // So is the port of a running gateway: the serving threads share their
    // port among themselves only (a second process with its own store
    // taking half the connections would run notifications twice).
    let first = Gateway::start("http://127.0.0.1:1", &["--workers", "2"]);
    for workers in ["1", "2"] {
        let mut second = Command::new(&bin)
            .args(["--listen", &first.addr.to_string(), "--workers", workers])
            .args(["--upstream", "http://127.0.0.1:1"])
            .env("RUST_LOG", "off")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let waited = std::time::Instant::now();
        while second.try_wait().unwrap().is_none() {
            if waited.elapsed() > Duration::from_secs(20) {
                let _ = second.kill();
                panic!("--workers {workers}: a second gateway started on a running one's port");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = second.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--workers {workers}: {stderr}");
        assert!(stderr.contains("cannot listen"), "{stderr}");
        assert!(out.stdout.is_empty());
    }
}

/// `--workers` (flag, environment, config file) takes 1 to 1024 serving
/// threads; anything else exits 2 naming the flag or the file's line.
#[test]
fn workers_must_be_a_number_of_threads() {
    let base = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:1",
    ];
    let cases: &[(&[&str], &str)] = &[
        (&["--workers", "0"], "invalid value '0' for '--workers"),
        (&["--workers", "two"], "invalid value 'two' for '--workers"),
        (&["--workers=-1"], "invalid value '-1' for '--workers"),
        (&["--workers", "100000"], "from 1 to 1024"),
        (&["--workers"], "`--workers` needs a value"),
    ];
    for (args, hint) in cases {
        let mut cmd = Command::new(gateway_bin());
        cmd.args(base).args(*args);
        exits_2(cmd, hint);
    }
    let mut cmd = Command::new(gateway_bin());
    cmd.args(base).env("IDEMPOTENCY_GATEWAY_WORKERS", "0");
    exits_2(cmd, "serving threads from 1 to 1024");

    let file = gateway_support::temp_path("workers.toml");
    std::fs::write(&file, "upstream = \"http://127.0.0.1:1\"\nworkers = 0\n").unwrap();
    let mut cmd = Command::new(gateway_bin());
    cmd.args(&base[..2]).arg("--config").arg(&file);
    exits_2(
        cmd,
        ":2: `workers`: expected a number of serving threads from 1 to 1024",
    );
    let _ = std::fs::remove_file(&file);
}

/// `name{labels} value` lines of a Prometheus text body whose labels include
/// every one of `want`.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_executed_and_replayed() {
    let up = Upstream::start().await;
    let metrics_addr = common::free_addr();
    let gw = Gateway::start(&up.url(), &["--metrics-listen", &metrics_addr.to_string()]);
    let client = client();
    let v = &STRIPE_VECTORS[0];
    for _ in 0..3 {
        let a = send_vector(&client, &gw.url("/stripe"), v).await;
        assert_eq!(a.status, 200);
    }
    let (status, text) = get(metrics_addr, "/metrics");
    assert_eq!(status, 200);
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
    assert_eq!(get(metrics_addr, "/other").0, 404);
    // One access line per request, with what the library decided. Logs go
    // through a non-blocking writer: read them once the gateway has exited.
    let mut gw = gw;
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_exit(Duration::from_secs(20)).success());
    let log = gw.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("gateway::access"))
        .collect();
    assert_eq!(lines.len(), 3, "{log}");
    for (line, outcome) in lines.iter().zip(["executed", "replayed", "replayed"]) {
        for part in [
            "method=POST",
            "path=/stripe",
            "preset=\"stripe\"",
            &format!("outcome=\"{outcome}\""),
            "status=200",
        ] {
            assert!(line.contains(part), "{part} not in {line}");
        }
    }
}

/// With access lines off (`RUST_LOG=warn`) the duplicate ratio is still
/// kept, and nothing is logged per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duplicate_ratio_is_kept_with_access_lines_off() {
    let up = Upstream::start().await;
    let metrics_addr = common::free_addr();
    let log = std::env::temp_dir().join(format!("gw-ratio-{}.log", std::process::id()));
    let gw = gateway_support::Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(),
            "--metrics-listen",
            &metrics_addr.to_string(),
        ],
        &[("RUST_LOG", "warn")],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let client = client();
    let v = &STRIPE_VECTORS[0];
    for _ in 0..4 {
        let a = send_vector(&client, &format!("http://{}/stripe", gw.addr), v).await;
        assert_eq!(a.status, 200);
    }
    let (_, text) = get(metrics_addr, "/metrics");
    let ratio = sample(&text, "idempotency_duplicate_ratio", &["preset=\"stripe\""])
        .unwrap_or_else(|| panic!("no duplicate ratio in\n{text}"));
    assert!((ratio - 3.0 / 4.0).abs() < 1e-9, "{ratio}");
    // Read the log once the gateway has exited and flushed it.
    let mut gw = gw;
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_exit(Duration::from_secs(20)).success());
    let written = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(!written.contains("gateway::access"), "{written}");
}
