//! The gateway's operator commands as a user meets them: a notification
//! followed from its first copy to its answer with `gateway inspect` and
//! `gateway journal`, forgotten with `gateway forget` (then a copy runs once
//! more), on the memory store and on Redis; the admin API refuses calls
//! without the token; with traces exported, `inspect` names the trace a
//! collector got.

use crate::gateway_support;
use crate::gateway_support::otlp;
use test_support::common;
use test_support::support_redis;

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

/// The token file, readable by its owner only (the gateway refuses others).
fn write_token(path: &std::path::Path, token: &str) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, token).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn start(upstream: &str, store: &str) -> Ops {
    start_with(upstream, store, &[])
}

fn start_with(upstream: &str, store: &str, extra: &[&str]) -> Ops {
    let metrics = free_addr();
    let dir = temp_path("admin-data");
    let token_file = temp_path("admin-token");
    write_token(&token_file, &format!("{TOKEN}\n"));
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
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
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
        (
            "get",
            "/admin/keys",
            "/admin/keys?id=evt_spec&limit=1".into(),
            true,
        ),
        ("get", "/admin/keys", "/admin/keys".into(), true),
        (
            "get",
            "/admin/keys",
            "/admin/keys?id=x&limit=1001".into(),
            true,
        ),
        (
            "get",
            "/admin/journal",
            "/admin/journal?limit=1".into(),
            true,
        ),
        (
            "get",
            "/admin/journal",
            "/admin/journal?limit=0".into(),
            true,
        ),
        (
            "get",
            "/admin/journal",
            "/admin/journal?cursor=not-a-cursor".into(),
            true,
        ),
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

/// Every method on every path under `/admin/` gets the same answer, its
/// JSON body byte for byte: a path that is no call is 404 for GET and
/// DELETE, any other method is 405 (HEAD too: no call answers it), with
/// no `Allow` header; a key that is not UTF-8 once decoded is 400 whatever
/// the method; a key is everything after `/admin/keys/`, percent-decoded
/// once (an escape that is not one kept as written; empty and `/` allowed);
/// a call without the token is 401 before anything else is looked at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_path_and_method_answers_as_before() {
    use gateway_support::raw::raw;
    let up = Upstream::start().await;
    let ops = start(&up.url(), "memory");
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];
    let absent = |key: &str| {
        let key = serde_json::Value::String(key.to_owned());
        format!(r#"{{"journal":null,"key":{key},"record":{{"state":"absent"}}}}"#)
    };
    let no_call = r#"{"error":"no such admin call"}"#.to_owned();
    let not_allowed = r#"{"error":"use GET, or DELETE on a key"}"#.to_owned();
    let not_utf8 = r#"{"error":"the key is not valid UTF-8"}"#.to_owned();
    let cases: Vec<(&str, &str, u16, String)> = vec![
        ("GET", "/admin/nothing", 404, no_call.clone()),
        ("DELETE", "/admin/nothing", 404, no_call.clone()),
        ("GET", "/admin/journal/", 404, no_call.clone()),
        ("GET", "/admin/", 404, no_call.clone()),
        ("GET", "/admin/keys%2Fx", 404, no_call.clone()),
        ("DELETE", "/admin/journal", 404, no_call.clone()),
        ("DELETE", "/admin/keys", 404, no_call.clone()),
        ("DELETE", "/admin/keys?id=x", 404, no_call.clone()),
        ("POST", "/admin/journal", 405, not_allowed.clone()),
        ("PUT", "/admin/keys", 405, not_allowed.clone()),
        ("PATCH", "/admin/nothing", 405, not_allowed.clone()),
        ("OPTIONS", "/admin/keys/k", 405, not_allowed.clone()),
        ("POST", "/admin/keys/k", 405, not_allowed.clone()),
        ("POST", "/admin/keys/", 405, not_allowed.clone()),
        ("GET", "/admin/keys/%FF", 400, not_utf8.clone()),
        ("DELETE", "/admin/keys/a%C3%28", 400, not_utf8.clone()),
        ("POST", "/admin/keys/%FF", 400, not_utf8.clone()),
        ("GET", "/admin/keys/", 200, absent("")),
        ("GET", "/admin/keys/a%2Fb/c", 200, absent("a/b/c")),
        ("GET", "/admin/keys//x/", 200, absent("/x/")),
        ("GET", "/admin/keys/%zz%4%", 200, absent("%zz%4%")),
        ("GET", "/admin/keys/%2541", 200, absent("%41")),
        (
            "GET",
            "/admin/keys/caf%C3%A9+x?by=y",
            200,
            absent("caf\u{e9}+x"),
        ),
        ("GET", "/admin/keys/%7Bk%7D", 200, absent("{k}")),
        ("GET", "/admin/keys/{*k}", 200, absent("{*k}")),
        ("GET", "/admin/keys/a;b", 200, absent("a;b")),
        (
            "DELETE",
            "/admin/keys/k",
            404,
            r#"{"forgotten":"absent","key":"k"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/keys?limit=5",
            400,
            r#"{"error":"`id` is needed"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/keys?id=x&cursor=zz",
            400,
            r#"{"error":"`cursor` is not one this API gave"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/journal?limit=abc",
            400,
            r#"{"error":"`limit` is a number from 1 to 1000"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/journal?bogus=1",
            400,
            r#"{"error":"unknown parameter `bogus`"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/journal?lim%69t=0",
            400,
            r#"{"error":"`limit` is a number from 1 to 1000"}"#.to_owned(),
        ),
        (
            "GET",
            "/admin/journal?outcome=nothing&limit=1&limit=x",
            200,
            r#"{"dropped":0,"next_cursor":null,"records":[]}"#.to_owned(),
        ),
    ];
    let mut wrong = Vec::new();
    for (method, target, status, body) in cases {
        let want: serde_json::Value = serde_json::from_str(&body).unwrap();
        let a = raw(ops.metrics, method, target.as_bytes(), &auth, b"");
        let got: Option<serde_json::Value> = serde_json::from_str(a.body.trim()).ok();
        let kind = a.header("content-type");
        if a.status != status
            || got.as_ref() != Some(&want)
            || !a.body.ends_with("}\n")
            || kind.as_deref() != Some("application/json")
            || a.header("allow").is_some()
        {
            wrong.push(format!("{method} {target}: {}\n{}", a.head, a.body));
        }
        // Without the token: 401 whatever the call.
        let a = raw(ops.metrics, method, target.as_bytes(), &[], b"");
        if a.status != 401 || a.header("www-authenticate").is_none() {
            wrong.push(format!("{method} {target} without the token: {}", a.head));
        }
    }
    // HEAD is no call: 405, without a body.
    for target in ["/admin/journal", "/admin/keys/k", "/admin/keys?id=x"] {
        let a = raw(ops.metrics, "HEAD", target.as_bytes(), &auth, b"");
        if a.status != 405 || !a.body.is_empty() || a.header("allow").is_some() {
            wrong.push(format!("HEAD {target}: {}\n{}", a.head, a.body));
        }
    }
    // `/admin` itself is the metrics listener's, not the admin API's.
    let a = raw(ops.metrics, "GET", b"/admin", &auth, b"");
    if (a.status, a.body.as_str()) != (404, "not found\n") {
        wrong.push(format!("GET /admin: {}\n{}", a.head, a.body));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
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
    write_token(&token_file, TOKEN);
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

/// `inspect` with the channel's (or the client's) own key, not the stored
/// form `idem:PRESET:ROUTE:PRINCIPAL:KEY`, looks it up as `--id` does; an
/// id nobody sent is an error (exit 1), never `record: absent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_with_the_senders_own_key_looks_it_up_as_id_does() {
    let up = Upstream::start().await;
    let ops = start(&up.url(), "memory");
    assert_eq!(send(&ops, "evt_bare_key").await, 200);
    let (code, out, err) = gateway(&ops, &["inspect", "evt_bare_key"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("key: idem:stripe:/notify/stripe::evt_bare_key"),
        "{out}"
    );
    assert!(out.contains("record: completed: status 200"), "{out}");
    assert!(!out.contains("absent"), "{out}");
    let (code, out, err) = gateway(&ops, &["inspect", "evt_never_sent"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(!out.contains("record: absent"), "{out}");
    assert!(err.contains("idem:PRESET:ROUTE:PRINCIPAL:KEY"), "{err}");
    assert!(err.contains("evt_never_sent"), "{err}");
    // The stored form still reads the store, absent or not.
    let (code, out, err) = gateway(
        &ops,
        &["inspect", "idem:stripe:/notify/stripe::evt_never_sent"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("record: absent"), "{out}");
}

/// A command that cannot reach the admin API says how to point it there.
#[test]
fn an_unreachable_admin_api_names_the_flags_that_find_it() {
    let token_file = temp_path("admin-token");
    write_token(&token_file, &format!("{TOKEN}\n"));
    let nobody = free_addr();
    for args in [
        vec!["forget".to_owned(), "idem:stripe:/s::evt_1".to_owned()],
        vec!["journal".to_owned()],
        vec![
            "--metrics-listen".to_owned(),
            nobody.to_string(),
            "inspect".to_owned(),
            "evt_1".to_owned(),
        ],
    ] {
        let out = Command::new(gateway_bin())
            .args(&args)
            .env("IDEMPOTENCY_GATEWAY_ADMIN_TOKEN_FILE", &token_file)
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN")
            .env_remove("IDEMPOTENCY_GATEWAY_METRICS_LISTEN")
            .env_remove("IDEMPOTENCY_GATEWAY_ADMIN_LISTEN")
            .env_remove("IDEMPOTENCY_GATEWAY_CONFIG")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        for hint in [
            "--admin URL",
            "--admin-listen",
            "IDEMPOTENCY_GATEWAY_ADMIN",
            "--config",
        ] {
            assert!(err.contains(hint), "{args:?}: `{hint}` in {err}");
        }
    }
    let _ = std::fs::remove_file(&token_file);
}

/// Every record of the journal, read page by page through the admin API.
fn all_pages(ops: &Ops, limit: usize) -> (Vec<serde_json::Value>, usize) {
    let (mut records, mut pages) = (Vec::new(), 0);
    let mut cursor = String::new();
    loop {
        let (status, json) = call(
            ops,
            "GET",
            &format!("/admin/journal?limit={limit}&cursor={cursor}"),
            true,
        );
        assert_eq!(status, 200, "{json}");
        let page = json["records"].as_array().unwrap();
        assert!(page.len() <= limit, "{json}");
        records.extend(page.iter().cloned());
        pages += 1;
        match json["next_cursor"].as_str() {
            Some(next) => cursor = next.to_owned(),
            None => return (records, pages),
        }
    }
}

/// Anonymous clients make records on a client-API route: the journal keeps
/// their bodies byte for byte (base64 in JSON), holds at most
/// `--journal-max-size` of records by removing the oldest first (counted),
/// lives in a directory and a file only its owner can read, and answers a
/// page at a time. A token file that others can read is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_is_bounded_private_and_paged() {
    use base64::Engine as _;
    use std::os::unix::fs::PermissionsExt as _;
    let up = Upstream::start().await;
    let metrics = free_addr();
    let root = temp_path("admin-bounded");
    let dir = root.join("data");
    let token_file = temp_path("admin-bounded-token");
    write_token(&token_file, TOKEN);
    let (upstream, metrics_arg) = (up.url(), metrics.to_string());
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--route",
        "/api=idempotency-key",
        "--journal",
        "--journal-body",
        "--journal-max-size",
        "1MiB",
        "--data-dir",
        dir.to_str().unwrap(),
        "--metrics-listen",
        &metrics_arg,
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ];
    let gw = Proc::start(&args, &[], Stdio::inherit());
    let ops = Ops {
        gw,
        metrics,
        token_file,
        dir: root.clone(),
    };
    // 150 keys with 60 KiB bodies that are not UTF-8: 9 MiB of bodies.
    let body = vec![0xFF_u8; 61_440];
    for n in 0..150 {
        let key = format!("bulk-{n:03}");
        let headers = [
            ("content-type", "application/octet-stream"),
            ("idempotency-key", key.as_str()),
        ];
        let a = post(
            &client(),
            ops.gw.addr,
            "/api/upload",
            &headers,
            body.clone(),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let (records, pages) = all_pages(&ops, 7);
    let keys: Vec<&str> = records.iter().map(|r| r["key"].as_str().unwrap()).collect();
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "no record twice: {keys:?}");
    assert!(pages >= 2, "{pages} pages");
    assert!(
        keys.len() < 150 && keys.len() >= 8,
        "1 MiB holds some of the 60 KiB records: {}",
        keys.len()
    );
    assert!(
        keys.iter().any(|k| k.ends_with(":bulk-149")),
        "the newest stays: {keys:?}"
    );
    assert!(
        !keys.iter().any(|k| k.ends_with(":bulk-000")),
        "the oldest went first: {keys:?}"
    );
    // Bytes as received.
    let kept = base64::engine::general_purpose::STANDARD
        .decode(records[0]["body_base64"].as_str().unwrap())
        .unwrap();
    assert_eq!(kept, body, "the body byte for byte");
    let file = std::fs::metadata(dir.join("journal.redb")).unwrap();
    eprintln!(
        "journal.redb: {} bytes for {} records",
        file.len(),
        keys.len()
    );
    assert!(
        file.len() <= 6 << 20,
        "journal.redb is {} bytes for a 1 MiB cap",
        file.len()
    );
    assert_eq!(file.permissions().mode() & 0o777, 0o600);
    let data = std::fs::metadata(&dir).unwrap();
    assert_eq!(data.permissions().mode() & 0o777, 0o700);
    let (_, text) = gateway_support::get(ops.metrics, "/metrics");
    let pruned: f64 = text
        .lines()
        .find(|l| l.starts_with("idempotency_journal_pruned_total{reason=\"size\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no size pruning counted: {text}"));
    assert!(pruned >= 1.0, "{pruned}");
    // Paged answers: 100 by default, at most 1,000; the CLI reads every page.
    let (status, json) = call(&ops, "GET", "/admin/journal?limit=5000", true);
    assert_eq!(status, 400, "{json}");
    let (code, out, err) = gateway(&ops, &["journal", "--limit", "3", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["records"].as_array().unwrap().len(), 3, "{out}");
    // A token file that others can read: refused at start, naming its mode.
    let loose = temp_path("admin-loose-token");
    std::fs::write(&loose, TOKEN).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(gateway_bin())
        .args(["--listen", "127.0.0.1:0", "--upstream", &upstream])
        .args(["--metrics-listen", "127.0.0.1:0", "--admin-token-file"])
        .arg(&loose)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("0644") && stderr.contains("too open"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&loose);
}

/// What a sender chose reaches the operator's terminal as text: `inspect`
/// and `journal` escape control characters (an OSC 52 clipboard write, a
/// CSI, a bidi override) in keys, bodies and every other field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_journal_escape_control_characters() {
    let up = Upstream::start().await;
    let ops = start_with(
        &up.url(),
        "memory",
        &["--journal-body", "--route", "/api=idempotency-key"],
    );
    let key = format!("esc-{}", std::process::id());
    // A client's body is anyone's bytes: a clipboard write (OSC 52), a CSI
    // as one C1 character, a bidi override, a byte that is not UTF-8.
    let mut body = b"\x1b]52;c;aGFja2Vk\x07 ".to_vec();
    body.extend_from_slice("\u{9b}2J\u{202e}".as_bytes());
    body.push(0xFF);
    let headers = [
        ("content-type", "application/octet-stream"),
        ("idempotency-key", key.as_str()),
    ];
    let a = post(&client(), ops.gw.addr, "/api/pay", &headers, body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // A channel's id with an escape in it (JSON's \u001b): its key too.
    let sly = r#"{"id":"evt_\u001b]52;c;aGk=\u0007","object":"event","type":"x"}"#;
    let headers = [("content-type", "application/json")];
    let _ = post(&client(), ops.gw.addr, "/notify/stripe", &headers, sly).await;
    let (code, out, err) = gateway(&ops, &["inspect", "--id", &key]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("body: "), "{out}");
    assert!(out.contains("\\e]52;c;aGFja2Vk\\a"), "escaped: {out}");
    assert!(out.contains("\\u{9b}2J\\u{202e}\\xff"), "escaped: {out}");
    let (code, journal, err) = gateway(&ops, &["journal"]);
    assert_eq!(code, 0, "{err}");
    if up.calls("/notify/stripe") == 1 {
        assert!(journal.contains("evt_\\e]52;c;aGk=\\a"), "{journal}");
    }
    for printed in [&out, &journal] {
        assert!(
            !printed.contains(['\u{1b}', '\u{7}', '\u{9b}', '\u{202e}']),
            "a control character reached the terminal: {printed:?}"
        );
    }
}

/// With `--otlp-endpoint`, each request's `request` span reaches the
/// collector (its request id, its route, its trace id; never the key nor
/// the body), and `gateway inspect` names the trace of the copy that ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_points_to_the_trace_the_collector_got() {
    let up = Upstream::start().await;
    let collector = otlp::Collector::start().await;
    let endpoint = collector.url();
    let mut ops = start_with(&up.url(), "memory", &["--otlp-endpoint", &endpoint]);
    let id = format!("evt_traced_{}", std::process::id());
    for _ in 0..2 {
        assert_eq!(send(&ops, &id).await, 200);
    }
    assert_eq!(up.calls("/notify/stripe"), 1);
    let (code, out, err) = gateway(&ops, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    let trace = out
        .split("; trace ")
        .nth(1)
        .map(|t| {
            t.chars()
                .take_while(char::is_ascii_hexdigit)
                .collect::<String>()
        })
        .unwrap_or_else(|| panic!("no trace in {out}"));
    assert_eq!(trace.len(), 32, "{out}");
    // The batch is sent at the latest when the gateway exits.
    ops.gw.signal(libc::SIGTERM);
    assert!(ops.gw.wait_exit(Duration::from_secs(20)).success());
    let spans = collector
        .wait_for("request", 2, Duration::from_secs(10))
        .await;
    assert_eq!(spans.len(), 2, "{:#?}", collector.spans());
    let ran = spans
        .iter()
        .find(|s| s.trace_id == trace)
        .unwrap_or_else(|| panic!("no exported request span in trace {trace}: {spans:#?}"));
    assert_eq!(ran.parent_span_id, "", "the request span is the root");
    assert_eq!(ran.service, "idempotency-gateway");
    assert_eq!(ran.attributes["route"], "/notify/stripe", "{ran:#?}");
    assert_eq!(ran.attributes["trace_id"], trace, "{ran:#?}");
    assert!(!ran.attributes["request_id"].is_empty(), "{ran:#?}");
    assert_ne!(spans[0].trace_id, spans[1].trace_id, "one trace per copy");
    // The upstream's call is in that trace: its `traceparent` names it.
    let seen = up.seen();
    let traceparent = seen[0]
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no traceparent upstream: {:?}", seen[0].headers));
    assert_eq!(
        traceparent.split('-').nth(1),
        Some(trace.as_str()),
        "{traceparent}"
    );
    // The library's spans are the request span's children: `idempotency`
    // under `request`, `claim` and `upstream` under `idempotency`.
    let all = collector.spans();
    let in_trace = |name: &str| {
        all.iter()
            .find(|s| s.name == name && s.trace_id == trace)
            .unwrap_or_else(|| panic!("no `{name}` span in trace {trace}: {all:#?}"))
    };
    let guarded = in_trace("idempotency");
    assert_eq!(guarded.parent_span_id, ran.span_id, "{guarded:#?}");
    for child in ["claim", "upstream"] {
        assert_eq!(
            in_trace(child).parent_span_id,
            guarded.span_id,
            "`{child}` under `idempotency`"
        );
    }
    assert_eq!(
        traceparent.split('-').nth(2),
        Some(in_trace("upstream").span_id.as_str()),
        "the upstream's parent is the `upstream` span"
    );
    for span in collector.spans() {
        for value in span.attributes.values() {
            assert!(!value.contains(&id), "the key or the body in {span:#?}");
        }
    }
}

/// A client's `traceparent` or `tracestate`, one case of
/// [`a_hostile_trace_context_is_never_followed_nor_passed_up`].
struct Hostile {
    what: &'static str,
    headers: Vec<(&'static str, String)>,
    /// The trace ids it names (none may be the gateway's).
    names: Vec<String>,
}

/// With `--accept-traceparent`, a client's trace context that is malformed
/// (W3C Trace Context: a version of `ff`, an all-zero trace id, a field that
/// is not lowercase hex of its length, a missing field, two `traceparent`
/// headers) or 400 KB long is never followed and never reaches the upstream:
/// each copy of a signed notification gets the channel's answer, the
/// upstream runs once per notification and gets a fresh `traceparent` of
/// the gateway's trace and no `tracestate`, and every `request` span
/// exported is a root. A valid `traceparent` with a 400 KB `tracestate` is
/// followed (the flag's point), and its `tracestate` is not passed up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_trace_context_is_never_followed_nor_passed_up() {
    const SECRET: &str = "whsec_hostile_trace_context";
    const SPAN: &str = "00f067aa0ba902b7";
    let up = Upstream::start().await;
    let collector = otlp::Collector::start().await;
    let config = temp_path("hostile-trace.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\n\
             [[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
             verify = {{ secrets = [\"{SECRET}\"], tolerance = \"300s\" }}\n",
            up.url()
        ),
    )
    .unwrap();
    let endpoint = collector.url();
    let mut gw = Proc::start(
        &[
            "--config",
            config.to_str().unwrap(),
            "--otlp-endpoint",
            &endpoint,
            "--accept-traceparent",
        ],
        &[],
        Stdio::inherit(),
    );
    // A trace id of its own for each case, so that any that leaks is named.
    let id = |n: u32| format!("4bf92f3577b34da6a3ce929d{n:08x}");
    let one = |what, n: u32, traceparent: String| Hostile {
        what,
        headers: vec![("traceparent", traceparent)],
        names: vec![id(n)],
    };
    // Members of the right shape: the list is read, not refused outright.
    let mut members = String::new();
    for i in 0.. {
        if members.len() >= 400_000 {
            break;
        }
        members.push_str(&format!("k{i}=v,"));
    }
    let cases = vec![
        one("version ff", 1, format!("ff-{}-{SPAN}-01", id(1))),
        one(
            "an all-zero trace id",
            2,
            format!("00-{}-{SPAN}-01", "0".repeat(32)),
        ),
        one("a trace id with a non-hex digit", 3, {
            let mut t = id(3);
            t.replace_range(31.., "g");
            format!("00-{t}-{SPAN}-01")
        }),
        one("a trace id with a sign", 4, {
            let mut t = id(4);
            t.replace_range(..1, "+");
            format!("00-{t}-{SPAN}-01")
        }),
        one("no flags", 5, format!("00-{}-{SPAN}", id(5))),
        one(
            "a short trace id",
            6,
            format!("00-{}-{SPAN}-01", &id(6)[16..]),
        ),
        Hostile {
            what: "two traceparent headers",
            headers: vec![
                ("traceparent", format!("00-{}-{SPAN}-01", id(7))),
                ("traceparent", format!("00-{}-{SPAN}-01", id(8))),
            ],
            names: vec![id(7), id(8)],
        },
        Hostile {
            what: "a 400 KB tracestate beside an all-zero trace id",
            headers: vec![
                ("traceparent", format!("00-{}-{SPAN}-01", "0".repeat(32))),
                ("tracestate", members.clone()),
            ],
            names: vec![],
        },
        one(
            "a 400 KB traceparent",
            9,
            format!("00-{}-{SPAN}-01-{}", id(9), "a".repeat(400_000)),
        ),
    ];
    let followed = Hostile {
        what: "a valid traceparent with a 400 KB tracestate",
        headers: vec![
            ("traceparent", format!("00-{}-{SPAN}-01", id(10))),
            ("tracestate", format!("k={}", "v".repeat(400_000))),
        ],
        names: vec![id(10)],
    };
    let client = client();
    let run = std::process::id();
    for (n, case) in cases.iter().chain([&followed]).enumerate() {
        let body =
            format!(r#"{{"id":"evt_trace_{run}_{n}","object":"event","type":"charge.succeeded"}}"#);
        let signature = gateway_support::stripe_signature(SECRET, unix_now(), body.as_bytes());
        for copy in 0..2 {
            let mut req = http::Request::post(format!("http://{}/notify/stripe", gw.addr))
                .header("content-type", "application/json")
                .header("stripe-signature", &signature);
            for (name, value) in &case.headers {
                req = req.header(*name, value.as_str());
            }
            let req = req
                .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
                .unwrap();
            let answer = match client.request(req).await {
                Ok(res) => common::read(res).await,
                Err(e) => panic!("{}, copy {copy}: no answer: {e:?}", case.what),
            };
            let what = format!("{}, copy {copy}", case.what);
            common::vectors::check(&answer, common::vectors::STRIPE.success.unwrap(), &what);
            assert_eq!(answer.replayed(), copy == 1, "{what}");
        }
    }
    let seen = up.seen();
    assert_eq!(seen.len(), cases.len() + 1, "once per notification");
    // Every case is checked and every wrong thing said at once.
    let mut wrong = Vec::new();
    let leaked = |trace: &str| cases.iter().flat_map(|c| &c.names).any(|n| n == trace);
    let hex = |s: &str, len| {
        s.len() == len && (s.bytes()).all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut upstream_traces = Vec::new();
    for (call, case) in seen.iter().zip(cases.iter().chain([&followed])) {
        let what = case.what;
        let sent: Vec<&str> = (call.headers.get_all("traceparent").iter())
            .map(|v| v.to_str().unwrap())
            .collect();
        let trace = match sent[..] {
            [traceparent] => {
                let f: Vec<&str> = traceparent.split('-').collect();
                let w3c = f.len() == 4
                    && f[0] == "00"
                    && hex(f[1], 32)
                    && hex(f[2], 16)
                    && hex(f[3], 2)
                    && f[1] != "0".repeat(32);
                if !w3c {
                    wrong.push(format!("{what}: upstream traceparent {traceparent:.100}"));
                }
                f.get(1).copied().unwrap_or_default().to_owned()
            }
            _ => {
                wrong.push(format!("{what}: {} traceparent upstream", sent.len()));
                String::new()
            }
        };
        if let Some(state) = call.headers.get("tracestate") {
            wrong.push(format!(
                "{what}: a tracestate of {} bytes upstream",
                state.len()
            ));
        }
        let size: usize = (call.headers.iter())
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        if size > 4096 {
            wrong.push(format!("{what}: {size} bytes of headers upstream"));
        }
        if leaked(&trace) {
            wrong.push(format!(
                "{what}: the upstream got the client's trace {trace}"
            ));
        }
        upstream_traces.push((what, trace));
    }
    // The batch is sent at the latest when the gateway exits.
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_exit(Duration::from_secs(20)).success());
    let copies = 2 * (cases.len() + 1);
    let spans = collector
        .wait_for("request", copies, Duration::from_secs(10))
        .await;
    assert_eq!(spans.len(), copies, "{:#?}", collector.spans());
    for (n, (what, trace)) in upstream_traces.iter().enumerate() {
        let Some(span) = spans.iter().find(|s| &s.trace_id == trace) else {
            wrong.push(format!(
                "{what}: no request span in the upstream's trace {trace}"
            ));
            continue;
        };
        let parent = if n < cases.len() { "" } else { SPAN };
        if span.parent_span_id != parent {
            wrong.push(format!(
                "{what}: the request span's parent is {:?}, not {parent:?} (trace {trace})",
                span.parent_span_id
            ));
        }
    }
    let followed_spans = (spans.iter())
        .filter(|s| s.trace_id == id(10) && s.parent_span_id == SPAN)
        .count();
    if followed_spans != 2 {
        wrong.push(format!(
            "{}: {followed_spans} request spans in the client's trace, not 2",
            followed.what
        ));
    }
    for span in &spans {
        if span.trace_id != id(10) && (!span.parent_span_id.is_empty() || leaked(&span.trace_id)) {
            wrong.push(format!("a request span not a root of its own: {span:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Slow clients cannot hold the `--metrics-listen` listener: with 70
/// connections each holding half a request head open, `/healthz` still
/// answers at once (a liveness probe must not restart a healthy gateway),
/// and those connections are closed at the listener's header timeout.
#[tokio::test(flavor = "multi_thread")]
async fn slow_clients_do_not_hold_the_admin_listener() {
    use std::io::{Read, Write};
    let up = Upstream::start().await;
    let ops = start(&up.url(), "memory");
    let mut slow = Vec::new();
    for _ in 0..70 {
        let mut s = std::net::TcpStream::connect(ops.metrics).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n")
            .unwrap();
        slow.push(s);
    }
    // The slow connections are accepted before the probe comes.
    std::thread::sleep(Duration::from_millis(300));
    let began = std::time::Instant::now();
    let mut probe = std::net::TcpStream::connect(ops.metrics).unwrap();
    probe
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let read = probe.read_to_end(&mut answer);
    let took = began.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        read.is_ok() && answer.starts_with("HTTP/1.1 200"),
        "/healthz did not answer within 5 s beside 70 slow clients ({took:?}): {read:?} {answer:?}"
    );
    assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
    // The slow ones are closed once the header timeout passes.
    let s = &mut slow[0];
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut rest = Vec::new();
    let closed = s.read_to_end(&mut rest);
    assert!(closed.is_ok(), "still open: {closed:?}");
}

/// `GET /admin/routes` shows each route's own upstream: the named one a
/// route's `upstream` names, the default one for the others.
#[tokio::test(flavor = "multi_thread")]
async fn the_routes_list_shows_each_routes_own_upstream() {
    let metrics = free_addr();
    let dir = temp_path("admin-upstreams");
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = temp_path("admin-token");
    write_token(&token_file, &format!("{TOKEN}\n"));
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9001\"\n\
             metrics_listen = \"{metrics}\"\nadmin_token_file = \"{}\"\n\
             [[upstreams]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9002/base\"\n\
             [[route]]\nprefix = \"/api/orders\"\npreset = \"idempotency-key\"\nupstream = \"orders\"\n\
             [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n",
            token_file.display()
        ),
    )
    .unwrap();
    let gw = Proc::start(
        &["--config", config.to_str().unwrap()],
        &[],
        Stdio::inherit(),
    );
    let ops = Ops {
        gw,
        metrics,
        token_file,
        dir,
    };
    let (status, v) = call(&ops, "GET", "/admin/routes", true);
    assert_eq!(status, 200, "{v}");
    let upstream_of = |prefix: &str| {
        (v["routes"].as_array().into_iter().flatten())
            .find(|r| r["prefix"] == prefix)
            .map(|r| r["upstream"].clone())
            .unwrap_or_else(|| panic!("no route {prefix}: {v}"))
    };
    assert_eq!(
        upstream_of("/api/orders"),
        "http://127.0.0.1:9002/base",
        "{v}"
    );
    assert_eq!(upstream_of("/api"), "http://127.0.0.1:9001", "{v}");
}
