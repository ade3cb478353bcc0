//! Queue entries are authenticated: through the binary, on Redis Streams,
//! RabbitMQ and NATS JetStream with `--queue-secret-file`, entries written
//! into the queue by someone else (in the gateway's own encoding: one for
//! an ack-then-deliver route with another event, one with the path of a
//! synchronous route and no signature) never reach the upstream; they are
//! dead-lettered as `unauthenticated`, counted, and `dlq replay` refuses
//! them unless `--force`. The embedded queue makes its key at first start,
//! readable by its owner only.

use crate::gateway_support;
use test_support::common;
use test_support::{support_nats, support_rabbitmq, support_redis};

use common::upstream::Upstream;
use common::vectors::{fixture, WECHAT_SUCCESS};
use common::{client, free_addr, post};
use gateway_support::{gateway_bin, get, temp_path, Gateway};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn wechat(id: &str) -> String {
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String(id.to_owned());
    v.to_string()
}

/// A queue entry in the gateway's encoding (version 1, the one earlier
/// versions wrote): key, fingerprint, order, method, target, headers, body.
fn entry(key: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    let mut out = vec![1u8];
    put(&mut out, key.as_bytes());
    out.extend_from_slice(&[0x5a; 16]);
    out.push(1);
    put(&mut out, key.as_bytes());
    put(&mut out, b"POST");
    put(&mut out, path.as_bytes());
    out.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (k, v) in headers {
        put(&mut out, k.as_bytes());
        put(&mut out, v.as_bytes());
    }
    put(&mut out, body);
    out
}

/// The two forged entries: another WeChat Pay event for the
/// ack-then-deliver route, and a notification for the synchronous Alipay
/// route (no signature: that route verifies on arrival, not at delivery).
fn forged() -> Vec<Vec<u8>> {
    let json = [
        ("content-type", "application/json"),
        ("x-forwarded-for", "127.0.0.1"),
        ("x-forwarded-proto", "http"),
    ];
    let form = [
        ("content-type", "application/x-www-form-urlencoded"),
        ("x-forwarded-for", "127.0.0.1"),
        ("x-forwarded-proto", "http"),
    ];
    vec![
        entry(
            "idem:wechatpay-v3:/wx::EV-FORGED-1",
            "/wx/notify",
            &json,
            wechat("EV-FORGED-1").as_bytes(),
        ),
        entry(
            "idem:alipay:/alipay::FORGED-2",
            "/alipay/notify",
            &form,
            b"notify_id=FORGED-2&trade_status=TRADE_SUCCESS&out_trade_no=FORGED-2&total_amount=99999.00",
        ),
    ]
}

/// A secret file of 48 bytes, readable by its owner only.
pub(crate) fn secret_file() -> PathBuf {
    let path = temp_path("queue-secret");
    std::fs::write(&path, "0123456789abcdef0123456789abcdef0123456789abcdef\n").unwrap();
    owner_only(&path);
    path
}

/// `chmod 600 path`.
pub(crate) fn owner_only(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

/// `gateway dlq --offline ARGS QUEUE`: exit status, stdout and stderr.
fn dlq(queue: &[&str], args: &[&str]) -> (i32, String, String) {
    let out = Command::new(gateway_bin())
        .args(["dlq", "--offline"])
        .args(args)
        .args(queue)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// `idempotency_queue_unauthenticated_total{queue="gateway"}` of `/metrics`.
fn unauthenticated_count(metrics: SocketAddr) -> f64 {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| {
            l.starts_with("idempotency_queue_unauthenticated_total{")
                && l.contains("queue=\"gateway\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Through a gateway on `queue` with a shared secret: a genuine
/// notification is delivered; the entries `inject` writes into the queue
/// are dead-lettered as `unauthenticated` and never reach the upstream;
/// `dlq replay` refuses them unless `--force`.
async fn forged_entries_are_dead_lettered(queue: &[&str], inject: impl AsyncFnOnce(Vec<Vec<u8>>)) {
    let up = Upstream::start().await;
    let secret = secret_file();
    let metrics = free_addr().to_string();
    let token = crate::gateway_dead_api::token_file("sealed-admin-token");
    let args = [
        queue,
        &[
            "--admin-token-file",
            token.to_str().unwrap(),
            "--queue-secret-file",
            secret.to_str().unwrap(),
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
            "--route",
            "/alipay=alipay",
            "--metrics-listen",
            &metrics,
        ],
    ]
    .concat();
    let gw = Gateway::start(&up.url(), &args);
    let m: SocketAddr = metrics.parse().unwrap();
    let headers = [("content-type", "application/json")];
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &headers,
        wechat("EV-GENUINE-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS, "acknowledged");
    wait_until("the genuine delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") == 1
    })
    .await;

    inject(forged()).await;
    wait_until(
        "two unauthenticated entries",
        Duration::from_secs(30),
        || unauthenticated_count(m) >= 2.0,
    )
    .await;
    let (code, listed, _) = dlq(queue, &["list"]);
    assert_eq!(code, 0, "{listed}");
    let dead: Vec<&str> = listed.lines().collect();
    assert_eq!(dead.len(), 2, "{listed}");
    assert!(
        dead.iter().all(|l| l.ends_with("error=unauthenticated")),
        "{listed}"
    );
    assert!(listed.contains("path=/wx/notify"), "{listed}");
    assert!(listed.contains("path=/alipay/notify"), "{listed}");
    // Nothing of them reached the upstream.
    let seen = up.seen();
    assert_eq!(seen.len(), 1, "only the genuine notification: {seen:?}");
    assert!(
        String::from_utf8_lossy(&seen[0].body).contains("EV-GENUINE-1"),
        "{seen:?}"
    );
    assert!(
        gw.log().contains("failed authentication"),
        "logged: {}",
        gw.log()
    );
    // Refused by ID and left out of a bulk replay, unless forced.
    let id = dead[0].split('\t').next().unwrap();
    let (code, _, err) = dlq(queue, &["replay", id]);
    assert_eq!(code, 1, "refused: {err}");
    assert!(
        err.contains("unauthenticated") && err.contains("--force"),
        "{err}"
    );
    let (code, out, _) = dlq(queue, &["replay", "--all"]);
    assert_eq!((code, out.trim()), (0, "replayed 0"));
    let (code, out, _) = dlq(queue, &["replay", "--error", "unauthenticated"]);
    assert_eq!((code, out.trim()), (0, "replayed 0"));
    // The same through the running gateway's admin API (and `dlq` with the
    // token, its client).
    let (status, json) =
        crate::gateway_dead_api::admin_call(m, "POST", &format!("/admin/dead/{id}/replay")).await;
    assert_eq!(status, 403, "{json}");
    assert!(
        json["error"].as_str().unwrap().contains("unauthenticated"),
        "{json}"
    );
    let (status, json) = crate::gateway_dead_api::admin_call(m, "POST", "/admin/dead/replay").await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(
        (
            json["replayed"].as_u64(),
            json["refused_unauthenticated"].as_u64()
        ),
        (Some(0), Some(2)),
        "{json}"
    );
    let (code, _, err) = super::gateway_ack::admin_cli(m, &token, &["dlq", "replay", id]);
    assert_eq!(code, 1, "refused: {err}");
    assert!(
        err.contains("unauthenticated") && err.contains("--force"),
        "{err}"
    );
    // Forced: queued again, checked again, dead-lettered again.
    let (code, out, err) = dlq(queue, &["replay", "--force", id]);
    assert_eq!(code, 0, "{out}{err}");
    wait_until(
        "the replayed entry refused again",
        Duration::from_secs(30),
        || unauthenticated_count(m) >= 3.0,
    )
    .await;
    assert_eq!(up.seen().len(), 1, "{:?}", up.seen());
    drop(gw);
    let _ = std::fs::remove_file(secret);
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_entries_are_dead_lettered_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    forged_entries_are_dead_lettered(&["--queue", &url], async |entries| {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        for e in entries {
            let _: String = redis::cmd("XADD")
                .arg("{gateway}:s")
                .arg("*")
                .arg("m")
                .arg(e)
                .arg("a")
                .arg(0)
                .arg("t")
                .arg(0)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_entries_are_dead_lettered_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        eprintln!("skipped: no rabbitmq-server");
        return;
    };
    let url = broker.vhost(&format!("sealed-{}", std::process::id()));
    forged_entries_are_dead_lettered(&["--queue", &url], async |entries| {
        use lapin::options::BasicPublishOptions;
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        for (i, e) in entries.into_iter().enumerate() {
            let mut headers = FieldTable::default();
            headers.insert("x-attempts".into(), AMQPValue::LongLongInt(0));
            headers.insert(
                "x-enqueued-ms".into(),
                AMQPValue::LongLongInt(now.as_millis() as i64),
            );
            headers.insert(
                "x-idempotency-key".into(),
                AMQPValue::LongString(LongString::from(format!("forged-{i}"))),
            );
            let props = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(format!("forged-{i}").into())
                .with_headers(headers);
            ch.basic_publish(
                "".into(),
                "gateway".into(),
                BasicPublishOptions::default(),
                &e,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        let _ = conn.close(0, "done".into()).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_entries_are_dead_lettered_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = support_nats::own() else {
        eprintln!("skipped: no nats-server");
        return;
    };
    let url = nats.url();
    forged_entries_are_dead_lettered(&["--queue", &url], async |entries| {
        let client = async_nats::connect(url.trim_start_matches("nats://"))
            .await
            .unwrap();
        let js = async_nats::jetstream::new(client);
        for e in entries {
            js.publish("idem.gateway.q", e.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    })
    .await;
}

/// The embedded queue makes its key at first start, in the data directory,
/// readable by its owner only, and keeps it across restarts; its own
/// entries are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_makes_its_key_at_first_start() {
    let _beside = crate::gateway_support::beside_storms().await;
    let up = Upstream::start().await;
    let dir = temp_path("sealed-embedded");
    let args = [
        "--data-dir",
        dir.to_str().unwrap(),
        "--route",
        "/wx=wechatpay-v3",
        "--ack-then-deliver",
        "/wx",
        "--retry-backoff",
        "200ms",
    ];
    let mut gw = Gateway::start(&up.url(), &args);
    let key = dir.join("queue.key");
    assert!(key.exists(), "{}", gw.log());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let made = std::fs::read(&key).unwrap();
    assert!(made.len() >= 32);
    let headers = [("content-type", "application/json")];
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &headers,
        wechat("EV-EMBEDDED-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS);
    wait_until("the delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") >= 1
    })
    .await;
    gw.signal(libc::SIGTERM);
    gw.wait_exit(Duration::from_secs(10));
    let gw = Gateway::start(&up.url(), &args);
    assert_eq!(std::fs::read(&key).unwrap(), made, "the same key");
    drop(gw);
    let (code, listed, _) = dlq(&["--data-dir", dir.to_str().unwrap()], &["list"]);
    assert_eq!((code, listed.as_str()), (0, ""), "nothing dead-lettered");
    let _ = std::fs::remove_dir_all(dir);
}

/// `name{queue="gateway"} VALUE` of `/metrics`.
fn gauge(metrics: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("queue=\"gateway\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// During an upgrade (`--queue-accept-unsigned`), entries with no MAC, as
/// earlier versions wrote them, are delivered, but only to an
/// ack-then-deliver route: one naming a synchronous route is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_entries_are_delivered_while_accepted_to_ack_routes_only() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let up = Upstream::start().await;
    let secret = secret_file();
    let metrics = free_addr().to_string();
    let gw = Gateway::start(
        &up.url(),
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            secret.to_str().unwrap(),
            "--queue-accept-unsigned",
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
            "--route",
            "/alipay=alipay",
            "--metrics-listen",
            &metrics,
        ],
    );
    assert!(
        gw.log().contains("queue_accept_unsigned"),
        "warned: {}",
        gw.log()
    );
    let m: SocketAddr = metrics.parse().unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for e in forged() {
        let _: String = redis::cmd("XADD")
            .arg("{gateway}:s")
            .arg("*")
            .arg("m")
            .arg(e)
            .arg("a")
            .arg(0)
            .arg("t")
            .arg(0)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    wait_until(
        "the unsigned entry's delivery",
        Duration::from_secs(30),
        || up.calls("/wx/notify") == 1,
    )
    .await;
    wait_until(
        "the synchronous route's entry kept",
        Duration::from_secs(30),
        || gauge(m, "idempotency_queue_stranded") == Some(1.0),
    )
    .await;
    assert_eq!(up.calls("/alipay/notify"), 0, "{:?}", up.seen());
    assert_eq!(unauthenticated_count(m), 0.0);
    drop(gw);
    let _ = std::fs::remove_file(secret);
}

/// The secret comes from `queue_secret_file` in the config file or from
/// `IDEMPOTENCY_GATEWAY_QUEUE_SECRET_FILE`; one too short is refused at
/// start; with it, the embedded queue makes no key of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_secret_from_the_config_file_or_the_environment() {
    let dir = temp_path("sealed-config");
    let short = temp_path("short-secret");
    std::fs::write(&short, "too short\n").unwrap();
    owner_only(&short);
    let config = temp_path("sealed.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:1\"\ndata_dir = \"{}\"\n\
             queue_secret_file = \"{}\"\n\
             [[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\nmode = \"ack-then-deliver\"\n",
            dir.display(),
            short.display()
        ),
    )
    .unwrap();
    let out = Command::new(gateway_bin())
        .args(["--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("at least 32 bytes") && err.contains(short.to_str().unwrap()),
        "{err}"
    );

    let secret = secret_file();
    let up = Upstream::start().await;
    let gw = gateway_support::Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(),
            "--data-dir",
            dir.to_str().unwrap(),
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
        ],
        &[(
            "IDEMPOTENCY_GATEWAY_QUEUE_SECRET_FILE",
            secret.to_str().unwrap(),
        )],
        std::process::Stdio::null(),
    );
    let headers = [("content-type", "application/json")];
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &headers,
        wechat("EV-ENV-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS);
    wait_until("the delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") == 1
    })
    .await;
    assert!(!dir.join("queue.key").exists(), "the shared secret is used");
    drop(gw);
    for f in [short, config, secret] {
        let _ = std::fs::remove_file(f);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A gateway on a shared queue (Redis Streams, RabbitMQ, NATS) without a
/// secret would deliver whatever anyone who can write to the queue wrote:
/// it refuses to start, exit 2, saying how to make a secret, unless the
/// configuration says it trusts every writer (`queue_unauthenticated`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_queue_without_a_secret_refuses_to_start() {
    let route = ["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"];
    for queue in [
        "redis://127.0.0.1:1",
        "amqp://gateway:pw@127.0.0.1:1/payments",
        "nats://127.0.0.1:1",
    ] {
        for check in [true, false] {
            let mut cmd = Command::new(gateway_bin());
            cmd.args([
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
            ])
            .args(route)
            .args(["--queue", queue])
            .env_remove("IDEMPOTENCY_GATEWAY_QUEUE_SECRET_FILE");
            if check {
                cmd.arg("--check-config");
            }
            let out = cmd.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{queue} check={check}: {err}");
            assert!(
                err.contains("has no secret")
                    && err.contains("head -c 32 /dev/urandom > FILE")
                    && err.contains("chmod 600 FILE")
                    && err.contains("--queue-secret-file")
                    && err.contains("queue_unauthenticated"),
                "{queue}: {err}"
            );
        }
    }
    // Trusting every writer, said in the file (or with the flag): it starts.
    if !support_redis::redis_available() {
        eprintln!("skipped the rest: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let config = temp_path("unauthenticated.toml");
    std::fs::write(&config, "queue_unauthenticated = true\n").unwrap();
    let up = Upstream::start().await;
    let url = redis.url();
    let gw = Gateway::start(
        &up.url(),
        &[
            &["--config", config.to_str().unwrap(), "--queue", &url][..],
            &route,
        ]
        .concat(),
    );
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &[("content-type", "application/json")],
        wechat("EV-TRUSTED-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS);
    wait_until("the delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") == 1
    })
    .await;
    assert!(
        gw.log().contains("NOT AUTHENTICATED"),
        "the log says so: {}",
        gw.log()
    );
    drop(gw);
    let flagged = Gateway::start(
        &up.url(),
        &[&["--queue", &url, "--queue-unauthenticated"][..], &route].concat(),
    );
    drop(flagged);
    let _ = std::fs::remove_file(config);
}

/// A queued entry's path is read once, in its canonical form, before
/// anything decides on it: an entry whose path is not canonical
/// (`/wx/../alipay/notify` prefix-matches the ack-then-deliver `/wx`, and
/// an upstream resolves it to the synchronous `/alipay`) is dead-lettered,
/// never forwarded, on a queue whose unsigned entries are accepted and on
/// one that trusts every writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_path_that_is_not_canonical_is_dead_lettered() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let secret = secret_file();
    let trusting = temp_path("trusting.toml");
    std::fs::write(&trusting, "queue_unauthenticated = true\n").unwrap();
    let accepting = [
        "--queue-secret-file",
        secret.to_str().unwrap(),
        "--queue-accept-unsigned",
    ];
    let trusted = ["--config", trusting.to_str().unwrap()];
    for how in [&accepting[..], &trusted[..]] {
        let redis = support_redis::RedisServer::start();
        let url = redis.url();
        let up = Upstream::start().await;
        let args = [
            &["--queue", &url][..],
            how,
            &[
                "--route",
                "/wx=wechatpay-v3",
                "--ack-then-deliver",
                "/wx",
                "--route",
                "/alipay=alipay",
                "--max-attempts",
                "1",
            ],
        ]
        .concat();
        let gw = Gateway::start(&up.url(), &args);
        let json = [
            ("content-type", "application/json"),
            ("x-forwarded-for", "127.0.0.1"),
            ("x-forwarded-proto", "http"),
        ];
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        for (i, path) in ["/wx/../alipay/notify", "/wx/%2e%2e/alipay/notify"]
            .into_iter()
            .enumerate()
        {
            let id = format!("EV-DOTS-{i}");
            let key = format!("idem:wechatpay-v3:/wx::{id}");
            let e = entry(&key, path, &json, wechat(&id).as_bytes());
            let _: String = redis::cmd("XADD")
                .arg("{gateway}:s")
                .arg("*")
                .arg("m")
                .arg(e)
                .arg("a")
                .arg(0)
                .arg("t")
                .arg(0)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let queue = ["--queue", url.as_str()];
        let start = Instant::now();
        let listed = loop {
            let (code, listed, err) = dlq(&queue, &["list"]);
            assert_eq!(code, 0, "{err}");
            if listed.lines().count() >= 2 || !up.seen().is_empty() {
                break listed;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "not dead-lettered: {listed}\n{}",
                gw.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(
            up.seen().is_empty(),
            "{how:?}: a path that is not canonical reached the upstream: {:?}",
            up.seen()
        );
        assert_eq!(listed.lines().count(), 2, "{listed}");
        assert!(
            listed.lines().all(|l| l.contains("not canonical")),
            "{how:?}: {listed}"
        );
        // Later, still nothing.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(up.seen().is_empty(), "{:?}", up.seen());
        drop(gw);
    }
    let _ = std::fs::remove_file(secret);
    let _ = std::fs::remove_file(trusting);
}

/// One rule for the gateway's secret and data files: a queue secret file or
/// an existing `queue.key` that its group or others may read is refused
/// (exit 2, `chmod 600 FILE`), as the admin token file is; the files the
/// gateway makes in an existing data directory that others may read are
/// its owner's alone (0600).
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_files_readable_by_others_are_refused_and_data_files_are_made_0600() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let chmod = |p: &std::path::Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
    };
    let route = ["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"];
    // Its exit status (`None`: still running after 10 s, killed) and stderr.
    let start = |extra: &[&str]| {
        let log = temp_path("modes-log");
        let mut child = Command::new(gateway_bin())
            .args([
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
            ])
            .args(route)
            .args(extra)
            .env_remove("IDEMPOTENCY_GATEWAY_QUEUE_SECRET_FILE")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let began = Instant::now();
        let code = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if began.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(log);
        (code, err)
    };
    // The secret file of the queue, readable by others.
    let dir = temp_path("modes-data");
    let secret = secret_file();
    chmod(&secret, 0o644);
    let (code, err) = start(&[
        "--data-dir",
        dir.to_str().unwrap(),
        "--queue-secret-file",
        secret.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("0644") && err.contains(&format!("chmod 600 {}", secret.display())),
        "{err}"
    );
    // The embedded queue's key, made readable by others since.
    std::fs::create_dir_all(&dir).unwrap();
    chmod(&dir, 0o755);
    let key = dir.join("queue.key");
    std::fs::write(&key, "00".repeat(32)).unwrap();
    chmod(&key, 0o644);
    let (code, err) = start(&["--data-dir", dir.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("0644") && err.contains(&format!("chmod 600 {}", key.display())),
        "{err}"
    );
    // In an existing directory others may read, what the gateway makes is
    // its owner's alone.
    std::fs::remove_file(&key).unwrap();
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up.url(),
        &[
            &["--data-dir", dir.to_str().unwrap(), "--journal"][..],
            &route,
        ]
        .concat(),
    );
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &[("content-type", "application/json")],
        wechat("EV-MODES-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS);
    for file in ["queue.redb", "queue.key", "journal.redb"] {
        let path = dir.join(file);
        assert_eq!(mode(&path), 0o600, "{file}: {:o}", mode(&path));
    }
    drop(gw);
    let _ = std::fs::remove_file(secret);
    let _ = std::fs::remove_dir_all(dir);
}

/// Redis Streams with a shared secret and a 3 s window: a copy of a
/// delivered entry written back into the stream once the window has passed
/// never reaches the upstream (dead-lettered as `expired`); replayed
/// through the admin API, it is sealed afresh and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_written_back_after_the_window_is_expired_redis_streams() {
    use common::upstream::Replies;
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    // Slow: the entry stays in the stream while it is delivered.
    let up = Upstream::with(Replies::default().delay(Duration::from_millis(1500))).await;
    let secret = secret_file();
    let metrics = free_addr().to_string();
    let token = crate::gateway_dead_api::token_file("expired-admin-token");
    let gw = Gateway::start(
        &up.url(),
        &[
            "--queue",
            &url,
            "--admin-token-file",
            token.to_str().unwrap(),
            "--queue-secret-file",
            secret.to_str().unwrap(),
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/wx",
            "--window",
            "3s",
            "--metrics-listen",
            &metrics,
        ],
    );
    let m: SocketAddr = metrics.parse().unwrap();
    let headers = [("content-type", "application/json")];
    let a = post(
        &client(),
        gw.addr,
        "/wx/notify",
        &headers,
        wechat("EV-LATE-1"),
    )
    .await;
    assert_eq!(a.text(), WECHAT_SUCCESS, "acknowledged");
    let queued = Instant::now();
    // What anyone who can read the stream sees of the entry.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut sealed = None;
    while sealed.is_none() {
        assert!(queued.elapsed() < Duration::from_secs(10), "no entry seen");
        let rows: Vec<(String, std::collections::HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
            .arg("{gateway}:s")
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        sealed = rows.into_iter().next().map(|(_, f)| f["m"].clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_until("the delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") == 1
    })
    .await;
    // Past the window, the copy is written back.
    tokio::time::sleep(Duration::from_millis(3500).saturating_sub(queued.elapsed())).await;
    let _: String = redis::cmd("XADD")
        .arg("{gateway}:s")
        .arg("*")
        .arg("m")
        .arg(sealed.unwrap())
        .arg("a")
        .arg(0)
        .arg("t")
        .arg(0)
        .query_async(&mut conn)
        .await
        .unwrap();
    let queue = ["--queue", url.as_str()];
    let mut listed = String::new();
    wait_until("an expired dead letter", Duration::from_secs(30), || {
        listed = dlq(&queue, &["list"]).1;
        listed.contains("error=expired")
    })
    .await;
    assert_eq!(listed.lines().count(), 1, "{listed}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(up.calls("/wx/notify"), 1, "the copy was delivered");
    assert!(
        gw.log().contains("dead-lettered as `expired`"),
        "{}",
        gw.log()
    );
    // Replayed by an operator: sealed afresh, delivered.
    let id = listed.split('\t').next().unwrap();
    let (status, json) =
        crate::gateway_dead_api::admin_call(m, "POST", &format!("/admin/dead/{id}/replay")).await;
    assert_eq!(status, 200, "{json}");
    wait_until("the replayed delivery", Duration::from_secs(30), || {
        up.calls("/wx/notify") == 2
    })
    .await;
    assert_eq!(dlq(&queue, &["list"]).1.trim(), "");
    drop(gw);
    let _ = std::fs::remove_file(secret);
    let _ = std::fs::remove_file(token);
}
