//! Dead letters through the running gateway's admin API, for every queue:
//! `gateway dlq list|show|replay|delete` with the admin token (and the
//! `/admin/dead` calls they make) while the gateway runs; a replayed dead
//! letter is delivered once, and a deleted one's key is queued again by its
//! next copy.

use super::gateway_ack::{
    admin_cli, gateway, gauge, own_redis, rabbitmq_queue, send_all, send_one, wait_for, Upstream,
};
use crate::gateway_support::temp_path;
use test_support::common::{client, free_addr};
use test_support::support_nats;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(crate) const TOKEN: &str = "s3cret-admin-token-0123456789";

pub(crate) fn token_file(tag: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let token = temp_path(tag);
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    token
}

/// `METHOD path` on the admin API with the token: status and JSON.
pub(crate) async fn admin_call(
    metrics: SocketAddr,
    method: &str,
    path: &str,
) -> (u16, serde_json::Value) {
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{metrics}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let res = client().request(req).await.unwrap();
    let status = res.status().as_u16();
    use http_body_util::BodyExt as _;
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body).unwrap();
    let template = match path.split('?').next().unwrap() {
        "/admin/dead" => "/admin/dead",
        "/admin/dead/replay" => "/admin/dead/replay",
        p if p.ends_with("/replay") => "/admin/dead/{id}/replay",
        _ => "/admin/dead/{id}",
    };
    as_documented(&method.to_lowercase(), template, status, &json);
    (status, json)
}

/// Asserts that `body`, the answer `status` of `method template`, is as
/// `deploy/openapi/admin.json` documents it.
pub(crate) fn as_documented(method: &str, template: &str, status: u16, body: &serde_json::Value) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openapi/admin.json");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let op = &spec["paths"][template][method];
    let schema = &op["responses"][status.to_string()]["content"]["application/json"]["schema"];
    assert!(
        !schema.is_null(),
        "{method} {template}: {status} is not documented: {body}"
    );
    let mut root = serde_json::json!({ "components": spec["components"].clone() });
    root["allOf"] = serde_json::json!([schema]);
    let validator = jsonschema::validator_for(&root).unwrap();
    let errors: Vec<String> = validator.iter_errors(body).map(|e| e.to_string()).collect();
    assert!(
        errors.is_empty(),
        "{method} {template} {status}: {errors:?} in {body}"
    );
}

/// `dlq ARGS` through the admin API: exit status, stdout, stderr.
fn dlq(metrics: SocketAddr, token: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["dlq"];
    all.extend_from_slice(args);
    admin_cli(metrics, token, &all)
}

/// On `queue`, while the gateway runs: two notifications die (the upstream
/// down, `--max-attempts 3`, answering 500, 502, 503 in turn); the API
/// and `dlq show` give each attempt's error, in order, with its time;
/// `dlq list` lists both and the API pages
/// them one at a time; `dlq show` has the request; `dlq replay` of one
/// delivers it once (a second replay finds nothing); `dlq delete` of the
/// other removes it (journaled), and its next copy is queued and
/// delivered once.
async fn dead_letters_through_the_admin_api(queue: &[&str], tag: &str) {
    let (up, up_addr) = Upstream::start_in_turn(true).await;
    let token = token_file(&format!("dead-api-token-{tag}"));
    let dir = temp_path(&format!("dead-api-{tag}"));
    let metrics = free_addr();
    let extra = [
        "--max-attempts",
        "3",
        "--journal",
        "--data-dir",
        dir.to_str().unwrap(),
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    let gw = gateway(up_addr, queue, metrics, &extra);
    let run = std::process::id();
    let (a, b) = (
        format!("EV-DEAD-A-{tag}-{run}"),
        format!("EV-DEAD-B-{tag}-{run}"),
    );
    send_all(&client(), gw.addr, &[a.clone(), b.clone()]).await;
    wait_for("two dead letters", Duration::from_secs(90), move || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(2.0)
    })
    .await;

    let (code, listed, err) = dlq(metrics, &token, &["list"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed}");
    for l in &lines {
        assert!(l.contains("attempts=3"), "{listed}");
        assert!(l.contains("path=/wx/notify"), "{listed}");
    }
    // Paged one at a time, the cursor reaches both, then no more.
    let (status, first) = admin_call(metrics, "GET", "/admin/dead?limit=1").await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        first["dead_letters"].as_array().unwrap().len(),
        1,
        "{first}"
    );
    let cursor = first["next_cursor"].as_str().expect("a cursor").to_owned();
    let (status, second) = admin_call(
        metrics,
        "GET",
        &format!("/admin/dead?limit=1&cursor={cursor}"),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    let ids = [&first, &second].map(|p| p["dead_letters"][0]["id"].as_str().unwrap().to_owned());
    assert_ne!(ids[0], ids[1]);
    let (status, filtered) = admin_call(metrics, "GET", "/admin/dead?route=/elsewhere").await;
    assert_eq!(status, 200);
    assert_eq!(filtered["dead_letters"].as_array().unwrap().len(), 0);
    let (status, _) = admin_call(metrics, "GET", "/admin/dead?since=yesterday").await;
    assert_eq!(status, 400);
    // Which line is which notification: `show` has the body.
    let id_of = |want: &str| {
        for l in &lines {
            let id = l.split('\t').next().unwrap();
            let (code, shown, err) = dlq(metrics, &token, &["show", id]);
            assert_eq!(code, 0, "{err}");
            if shown.contains(want) {
                return (id.to_owned(), shown);
            }
        }
        panic!("no dead letter of {want} in {listed}");
    };
    let (id_a, shown_a) = id_of(&a);
    let (id_b, _) = id_of(&b);
    assert!(shown_a.contains("request: POST /wx/notify"), "{shown_a}");
    assert!(shown_a.contains("attempts: 3"), "{shown_a}");
    let errors = [
        "upstream answered 500 Internal Server Error",
        "upstream answered 502 Bad Gateway",
        "upstream answered 503 Service Unavailable",
    ];
    let shown_errors: Vec<&str> = (shown_a.lines())
        .filter(|l| l.starts_with("attempt "))
        .map(|l| l.split_once(": ").map_or("", |(_, e)| e))
        .collect();
    assert_eq!(shown_errors, errors, "{shown_a}");
    assert!(
        shown_a.contains("header: content-type: application/json"),
        "{shown_a}"
    );
    let (status, detail) = admin_call(metrics, "GET", &format!("/admin/dead/{id_a}")).await;
    assert_eq!(status, 200);
    let attempts = detail["attempt_errors"].as_array().expect("attempts");
    let got: Vec<(u64, &str)> = (attempts.iter())
        .map(|a| (a["attempt"].as_u64().unwrap(), a["error"].as_str().unwrap()))
        .collect();
    assert_eq!(
        got,
        [(1, errors[0]), (2, errors[1]), (3, errors[2])],
        "{detail}"
    );
    let times: Vec<std::time::SystemTime> = (attempts.iter())
        .map(|a| humantime::parse_rfc3339(a["at"].as_str().unwrap()).unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{detail}");
    let dead_at = humantime::parse_rfc3339(detail["dead_at"].as_str().unwrap()).unwrap();
    assert!(times[2] <= dead_at + Duration::from_secs(1), "{detail}");
    assert_eq!(detail["attempts_not_kept"], 0, "{detail}");
    assert!(detail["body_base64"]
        .as_str()
        .is_some_and(|b| !b.is_empty()));
    let (status, _) = admin_call(metrics, "GET", "/admin/dead/999999999").await;
    assert_eq!(status, 404);

    let (status, dry) = admin_call(metrics, "POST", "/admin/dead/replay?dry_run=true").await;
    assert_eq!(
        (status, &dry["matched"]),
        (200, &serde_json::json!(2)),
        "{dry}"
    );
    let (status, _) = admin_call(metrics, "POST", "/admin/dead/999999999/replay").await;
    assert_eq!(status, 404);
    let (status, _) = admin_call(metrics, "DELETE", "/admin/dead/999999999").await;
    assert_eq!(status, 404);
    // A dry run counts and replays nothing.
    let (code, out, err) = dlq(metrics, &token, &["replay", "--dry-run", "--route", "/wx"]);
    assert_eq!(
        (code, out.trim()),
        (0, "would replay 2 of 2 dead letters"),
        "{err}"
    );

    // Replayed: delivered once, and a second replay finds nothing.
    up.down.store(false, Ordering::SeqCst);
    let (code, out, err) = dlq(metrics, &token, &["replay", &id_a]);
    assert_eq!(
        (code, out.trim()),
        (0, format!("replayed {id_a}").as_str()),
        "{err}"
    );
    let (code, _, err) = dlq(metrics, &token, &["replay", &id_a]);
    assert_eq!(code, 1, "replayed twice: {err}");
    let probe = up.clone();
    let want = a.clone();
    wait_for(
        "the replayed delivery",
        Duration::from_secs(60),
        move || probe.counts().get(&want) == Some(&1),
    )
    .await;

    // Deleted: gone from the list, noted in the journal, and its next copy
    // is queued again (not "already queued") and delivered once.
    let (code, out, err) = dlq(
        metrics,
        &token,
        &[
            "delete",
            &id_b,
            "--by",
            "ops-test",
            "--reason",
            "bad payload",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("deleted {id_b}")), "{out}");
    let (code, _, _) = dlq(metrics, &token, &["delete", &id_b]);
    assert_eq!(code, 1, "deleted twice");
    let (code, out, err) = dlq(metrics, &token, &["list"]);
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    let (code, out, err) = admin_cli(metrics, &token, &["inspect", "--id", &b]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("dead letter {id_b} deleted by ops-test"))
            && out.contains("bad payload"),
        "{out}"
    );
    assert_eq!(up.counts().get(&b), None, "the deleted one was delivered");
    send_one(gw.addr, &b).await;
    let probe = up.clone();
    let want = b.clone();
    wait_for(
        "the copy after delete",
        Duration::from_secs(60),
        move || probe.counts().get(&want) == Some(&1),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let counts = up.counts();
    assert_eq!(
        (counts.get(&a), counts.get(&b)),
        (Some(&1), Some(&1)),
        "{counts:?}"
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_listed_shown_replayed_deleted_through_the_admin_api_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    let queue = temp_path("dead-api-queue");
    dead_letters_through_the_admin_api(&["--queue", queue.to_str().unwrap()], "embedded").await;
    let _ = std::fs::remove_dir_all(queue);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_listed_shown_replayed_deleted_through_the_admin_api_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    dead_letters_through_the_admin_api(
        &[
            "--queue",
            &redis.url(),
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        "redis",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_listed_shown_replayed_deleted_through_the_admin_api_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = rabbitmq_queue("dead-api") else {
        return;
    };
    dead_letters_through_the_admin_api(
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        "amqp",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_listed_shown_replayed_deleted_through_the_admin_api_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = support_nats::own() else {
        return;
    };
    dead_letters_through_the_admin_api(
        &[
            "--queue",
            &nats.url(),
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        "jetstream",
    )
    .await;
}

/// With `--offline` (a token or not), `dlq` works on the queue directly,
/// and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_offline_says_it_works_on_the_queue_directly() {
    let dir = temp_path("dead-api-offline");
    let token = token_file("dead-api-offline-token");
    let out = std::process::Command::new(crate::gateway_support::gateway_bin())
        .args(["--admin-token-file", token.to_str().unwrap()])
        .args([
            "dlq",
            "list",
            "--offline",
            "--data-dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--offline: working on the queue directly"),
        "{err}"
    );
    assert!(err.contains("no queue at"), "{err}");
    assert_eq!(out.status.code(), Some(1));
    let _ = std::fs::remove_file(token);
}

/// Dead letters that others wrote into a shared Redis queue read as what
/// is known, never a failed answer: one an earlier version wrote (no
/// history of its attempts) and one a hostile peer wrote (a history that
/// is not one, attempts at the top of `u32`, a time past year 9999, markup
/// in its error) each show their last error as their one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_an_earlier_version_or_a_hostile_peer_wrote_still_read_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    let url = redis.url();
    let (_up, up_addr) = Upstream::start(false).await;
    let token = token_file("dead-api-hostile-token");
    let metrics = free_addr();
    let extra = ["--admin-token-file", token.to_str().unwrap()];
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        metrics,
        &extra,
    );
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let hostile_error = r#"<img src=x onerror="alert(1)">"#;
    let letters: [(&str, u64, &str, u64, Option<&str>); 2] = [
        (
            "old",
            3,
            "upstream answered 503 Service Unavailable",
            now_ms,
            None,
        ),
        (
            "hostile",
            u64::from(u32::MAX),
            hostile_error,
            u64::MAX,
            Some("1;0;1@x=;;%zz"),
        ),
    ];
    for (body, attempts, error, at, history) in letters {
        let mut add = redis::cmd("XADD");
        add.arg("{gateway}:d")
            .arg("*")
            .arg("m")
            .arg(body)
            .arg("a")
            .arg(attempts)
            .arg("e")
            .arg(error)
            .arg("at")
            .arg(at);
        if let Some(h) = history {
            add.arg("h").arg(h);
        }
        let _: String = add.query_async(&mut conn).await.unwrap();
    }
    let (status, page) = admin_call(metrics, "GET", "/admin/dead").await;
    assert_eq!(status, 200, "{page}");
    let listed = page["dead_letters"].as_array().unwrap().clone();
    assert_eq!(listed.len(), 2, "{page}");
    for (d, (_, attempts, error, _, _)) in listed.iter().zip(letters) {
        let id = d["id"].as_str().unwrap();
        let (status, detail) = admin_call(metrics, "GET", &format!("/admin/dead/{id}")).await;
        assert_eq!(status, 200, "{detail}");
        let shown = detail["attempt_errors"].as_array().unwrap();
        assert_eq!(shown.len(), 1, "{detail}");
        assert_eq!(shown[0]["error"], error, "{detail}");
        assert_eq!(shown[0]["attempt"], attempts, "{detail}");
        assert_eq!(detail["attempts_not_kept"], attempts - 1, "{detail}");
        let (code, out, err) = dlq(metrics, &token, &["show", id]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(&format!("attempt {attempts} at ")), "{out}");
    }
    drop(gw);
    let _ = std::fs::remove_file(token);
}
