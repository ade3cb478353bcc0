//! The gateway's operator commands as a user meets them: a notification
//! followed from its first copy to its answer with `gateway inspect` and
//! `gateway journal`, forgotten with `gateway forget` (then a copy runs once
//! more), on the memory store and on Redis; the admin API refuses calls
//! without the token.
//!
//! Build the binary first when running this file alone:
//! `cargo build --all-features --example gateway && cargo test --all-features --test gateway_admin`.

mod common;
mod gateway_support;
mod support_redis;

use common::upstream::{Replies, Upstream};
use common::{client, free_addr, post};
use gateway_support::{gateway_bin, raw_http, temp_path, Proc};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "s3cret-admin-token-0123456789";

struct Ops {
    gw: Proc,
    metrics: SocketAddr,
    token_file: PathBuf,
    dir: PathBuf,
}

impl Drop for Ops {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.token_file);
    }
}

fn start(upstream: &str, store: &str) -> Ops {
    let metrics = free_addr();
    let dir = temp_path("admin-data");
    let token_file = temp_path("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let metrics_arg = metrics.to_string();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--store",
            store,
            "--route",
            "/notify/stripe=stripe",
            "--journal",
            "--data-dir",
            dir.to_str().unwrap(),
            "--metrics-listen",
            &metrics_arg,
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ],
        &[],
        Stdio::inherit(),
    );
    Ops {
        gw,
        metrics,
        token_file,
        dir,
    }
}

/// `gateway ARGS --admin URL` with the token file: exit code and stdout.
fn gateway(ops: &Ops, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(gateway_bin())
        .arg("--admin-token-file")
        .arg(&ops.token_file)
        .args(args)
        .arg("--admin")
        .arg(format!("http://{}", ops.metrics))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn send(ops: &Ops, id: &str) -> u16 {
    let body = format!(r#"{{"id":"{id}","object":"event","type":"charge.succeeded"}}"#);
    let headers = [("content-type", "application/json")];
    post(&client(), ops.gw.addr, "/notify/stripe", &headers, body)
        .await
        .status
}

async fn follow_a_notification(store: &str) {
    let up = Upstream::start().await;
    let ops = start(&up.url(), store);
    let id = format!("evt_ops_{}", std::process::id());
    for _ in 0..3 {
        assert_eq!(send(&ops, &id).await, 200);
    }
    assert_eq!(up.calls("/notify/stripe"), 1);

    // By the channel's id: the record and its journal.
    let (code, out, err) = gateway(&ops, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("record: completed: status 200"), "{out}");
    assert!(out.contains("3 copies (executed 1, replayed 2)"), "{out}");
    assert!(out.contains("upstream answered 200"), "{out}");
    let key = out
        .lines()
        .find_map(|l| l.strip_prefix("key: "))
        .unwrap_or_else(|| panic!("no key in {out}"))
        .to_owned();
    assert!(key.ends_with(&format!(":{id}")), "{key}");

    // The journal by outcome, as JSON.
    let (code, out, err) = gateway(
        &ops,
        &["journal", "--outcome", "executed", "--format", "json"],
    );
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let records = json["records"].as_array().unwrap();
    let record = records
        .iter()
        .find(|r| r["key"] == key.as_str())
        .expect("journaled");
    assert_eq!(record["copies"], 3);
    assert_eq!(record["route"], "/notify/stripe");
    assert_eq!(record["preset"], "stripe");
    let (_, out, _) = gateway(&ops, &["journal", "--outcome", "mismatch"]);
    assert!(!out.contains(&key), "{out}");

    // Forget it: the next copy runs once more, then is replayed again.
    let (code, out, err) = gateway(&ops, &["forget", &key, "--by", "oncall"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("forgotten"), "{out}");
    let (code, _, err) = gateway(&ops, &["forget", &key]);
    assert_eq!(code, 1, "a second forget finds nothing");
    assert!(err.contains("no completed record"), "{err}");
    assert_eq!(send(&ops, &id).await, 200);
    assert_eq!(send(&ops, &id).await, 200);
    assert_eq!(up.calls("/notify/stripe"), 2);
    let (code, out, err) = gateway(&ops, &["inspect", &key]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("5 copies (executed 2, replayed 3)"), "{out}");
    assert!(out.contains("forgotten by oncall at "), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_journal_and_forget_on_the_memory_store() {
    follow_a_notification("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_journal_and_forget_on_redis() {
    if !support_redis::redis_available() {
        return;
    }
    let redis = support_redis::RedisServer::start();
    follow_a_notification(&redis.url()).await;
}

/// A key in flight is not forgotten: its owner decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_refuses_a_key_in_flight() {
    let up = Upstream::with(Replies::default().delay(Duration::from_secs(3))).await;
    let ops = start(&up.url(), "memory");
    let addr = ops.gw.addr;
    let slow = tokio::spawn(async move {
        let body = r#"{"id":"evt_slow","object":"event","type":"charge.succeeded"}"#;
        let headers = [("content-type", "application/json")];
        post(&client(), addr, "/notify/stripe", &headers, body)
            .await
            .status
    });
    up.wait_for_call("/notify/stripe").await;
    // The stored key of a route's notification: prefix, preset, route, no
    // principal, the event's id.
    let key = "idem:stripe:/notify/stripe::evt_slow";
    let path = format!("/admin/keys/{}", key.replace('/', "%2F"));
    let answer = raw_http(
        ops.metrics,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"),
    );
    if answer.contains("\"in_flight\"") {
        let (code, _, err) = gateway(&ops, &["forget", key]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("in flight"), "{err}");
    } else {
        panic!("the stored key's form changed; update this test: {answer}");
    }
    assert_eq!(slow.await.unwrap(), 200);
    assert_eq!(up.calls("/notify/stripe"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_the_token() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), "memory");
    let get = |auth: &str| {
        raw_http(
            ops.metrics,
            format!("GET /admin/journal HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"),
        )
    };
    let none = get("");
    assert!(none.starts_with("HTTP/1.1 401"), "{none}");
    assert!(
        none.to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{none}"
    );
    let wrong = get("Authorization: Bearer s3cret-admin-token-0123456788\r\n");
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let right = get(&format!("Authorization: Bearer {TOKEN}\r\n"));
    assert!(right.starts_with("HTTP/1.1 200"), "{right}");
    // The CLI without the token file says what it needs.
    let out = Command::new(gateway_bin())
        .args(["journal", "--admin", &format!("http://{}", ops.metrics)])
        .env_remove("IDEMPOTENCY_GATEWAY_ADMIN_TOKEN_FILE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--admin-token-file"));
}

/// Without `--admin-token-file` there is no admin API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_is_off_by_default() {
    let up = Upstream::start().await;
    let metrics = free_addr();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(),
            "--metrics-listen",
            &metrics.to_string(),
        ],
        &[],
        Stdio::inherit(),
    );
    let answer = raw_http(
        metrics,
        format!("GET /admin/journal HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"),
    );
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    drop(gw);
}

/// The admin API's answers: `(method, path template, path, status, body)`.
fn call(ops: &Ops, method: &str, path: &str, auth: bool) -> (u16, serde_json::Value) {
    let auth = if auth {
        format!("Authorization: Bearer {TOKEN}\r\n")
    } else {
        String::new()
    };
    let raw = raw_http(
        ops.metrics,
        format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"),
    );
    let status: u16 = raw[9..12].parse().unwrap();
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {raw}"));
    (status, json)
}

/// Every answer of the admin API, on each path, method and status it
/// documents, matches `deploy/openapi/admin.json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_as_its_openapi_file_says() {
    let spec_path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openapi/admin.json");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(spec_path).unwrap()).unwrap();
    let up = Upstream::with(Replies::default().delay(Duration::from_millis(1500))).await;
    let ops = start(&up.url(), "memory");
    assert_eq!(send(&ops, "evt_spec").await, 200);
    assert_eq!(send(&ops, "evt_spec").await, 200);
    let key = "idem:stripe:/notify/stripe::evt_spec";
    let enc = |k: &str| k.replace('/', "%2F").replace(':', "%3A");
    let addr = ops.gw.addr;
    let slow = tokio::spawn(async move {
        let body = r#"{"id":"evt_slow","object":"event","type":"charge.succeeded"}"#;
        let headers = [("content-type", "application/json")];
        post(&client(), addr, "/notify/stripe", &headers, body)
            .await
            .status
    });
    while up.total() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let slow_key = "idem:stripe:/notify/stripe::evt_slow";
    let calls: Vec<(&str, &str, String, bool)> = vec![
        (
            "get",
            "/admin/keys/{key}",
            format!("/admin/keys/{}", enc(key)),
            true,
        ),
        (
            "get",
            "/admin/keys/{key}",
            format!("/admin/keys/{}", enc(slow_key)),
            true,
        ),
        (
            "get",
            "/admin/keys/{key}",
            "/admin/keys/nothing-here".into(),
            true,
        ),
        ("get", "/admin/keys/{key}", "/admin/keys/%FF".into(), true),
        (
            "get",
            "/admin/keys/{key}",
            format!("/admin/keys/{}", enc(key)),
            false,
        ),
        ("get", "/admin/keys", "/admin/keys?id=evt_spec".into(), true),
        ("get", "/admin/keys", "/admin/keys".into(), true),
        (
            "get",
            "/admin/journal",
            "/admin/journal?outcome=replayed&since=2020-01-01T00:00:00Z".into(),
            true,
        ),
        (
            "get",
            "/admin/journal",
            "/admin/journal?since=yesterday".into(),
            true,
        ),
        (
            "delete",
            "/admin/keys/{key}",
            format!("/admin/keys/{}", enc(slow_key)),
            true,
        ),
        (
            "delete",
            "/admin/keys/{key}",
            format!("/admin/keys/{}?by=spec", enc(key)),
            true,
        ),
        (
            "delete",
            "/admin/keys/{key}",
            format!("/admin/keys/{}", enc(key)),
            true,
        ),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (method, template, path, auth) in calls {
        let (status, body) = call(&ops, &method.to_uppercase(), &path, auth);
        let op = &spec["paths"][template][method];
        let schema = &op["responses"][status.to_string()]["content"]["application/json"]["schema"];
        assert!(
            !schema.is_null(),
            "{method} {path}: {status} is not documented: {body}"
        );
        let mut root = serde_json::json!({ "components": spec["components"].clone() });
        root["allOf"] = serde_json::json!([schema]);
        let validator = jsonschema::validator_for(&root).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&body)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{method} {path} {status}: {errors:?} in {body}"
        );
        seen.insert((method, template, status));
    }
    // The calls above met these documented answers.
    for want in [
        ("get", "/admin/keys/{key}", 200),
        ("get", "/admin/keys/{key}", 400),
        ("get", "/admin/keys/{key}", 401),
        ("get", "/admin/keys", 200),
        ("get", "/admin/keys", 400),
        ("get", "/admin/journal", 200),
        ("get", "/admin/journal", 400),
        ("delete", "/admin/keys/{key}", 200),
        ("delete", "/admin/keys/{key}", 404),
        ("delete", "/admin/keys/{key}", 409),
    ] {
        assert!(seen.contains(&want), "{want:?} not met: {seen:?}");
    }
    assert_eq!(slow.await.unwrap(), 200);
}

/// On an acknowledge-then-deliver route the journal has the copies the
/// channel sent (acknowledged once, then "already queued") and each
/// delivery attempt from the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_follows_an_acknowledged_notification_to_its_delivery() {
    let up = Upstream::start().await;
    let metrics = free_addr();
    let dir = temp_path("admin-ack");
    let token_file = temp_path("admin-ack-token");
    std::fs::write(&token_file, TOKEN).unwrap();
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
            "--journal",
            "--data-dir",
            dir.to_str().unwrap(),
            "--metrics-listen",
            &metrics_arg,
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ],
        &[],
        Stdio::inherit(),
    );
    let ops = Ops {
        gw,
        metrics,
        token_file,
        dir,
    };
    let id = "EV-JOURNAL-ACK-1";
    let doc = common::vectors::fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String(id.to_owned());
    let headers = [("content-type", "application/json")];
    for _ in 0..2 {
        let a = post(&client(), ops.gw.addr, "/wx", &headers, v.to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    up.wait_for_call("/wx").await;
    let mut out = String::new();
    for _ in 0..100 {
        let (code, o, err) = gateway(&ops, &["inspect", "--id", id]);
        assert_eq!(code, 0, "{err}");
        out = o;
        if out.contains("1 delivery attempts") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(out.contains("2 copies ("), "{out}");
    assert!(out.contains("delivered 1"), "{out}");
    assert!(out.contains("executed 1"), "{out}");
    assert!(out.contains("replayed 1"), "{out}");
    assert!(out.contains("1 delivery attempts"), "{out}");
    assert!(out.contains("record: completed"), "{out}");
    assert_eq!(up.calls("/wx"), 1);
}

/// The commands find the running gateway from the same flags it was
/// started with (`--metrics-listen`, `--admin-token-file`), and `--preset`
/// looks the channel's id up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_take_the_gateways_own_flags() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), "memory");
    assert_eq!(send(&ops, "evt_own_flags").await, 200);
    let out = Command::new(gateway_bin())
        .args(["--metrics-listen", &ops.metrics.to_string()])
        .arg("--admin-token-file")
        .arg(&ops.token_file)
        .args(["inspect", "evt_own_flags", "--preset", "stripe"])
        .env_remove("IDEMPOTENCY_GATEWAY_ADMIN")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stdout.contains("key: idem:stripe:"), "{stdout}");
    assert!(stdout.contains("record: completed: status 200"), "{stdout}");
    // Another preset finds nothing.
    let out = Command::new(gateway_bin())
        .args(["--metrics-listen", &ops.metrics.to_string()])
        .arg("--admin-token-file")
        .arg(&ops.token_file)
        .args(["inspect", "evt_own_flags", "--preset", "alipay"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("no key ending in :evt_own_flags"));
}
