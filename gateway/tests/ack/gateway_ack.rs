//! The gateway's ack-then-deliver routes as a real process: the
//! channel's success reply only once the notification is durably queued,
//! then one delivery per notification to a real hyper upstream on loopback,
//! across an upstream outage, a `kill -9` of the gateway (embedded queue,
//! Redis Streams, RabbitMQ and NATS JetStream), a RabbitMQ broker or a
//! JetStream server killed and restarted mid-storm, and a dead letter
//! replayed with `gateway dlq replay`.

use crate::gateway_support;
use test_support::common;
use test_support::support_nats;
use test_support::support_rabbitmq;
use test_support::support_redis;

use common::upstream::Replies;
use common::vectors::{fixture, WECHAT_SUCCESS};
use common::{client, free_addr, post, HttpClient};
use gateway_support::{gateway_bin, get, temp_path, Proc};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const COPIES: usize = 7;

/// The recording upstream, answering 503 while `down`, else 200; counts the
/// 200s (the deliveries) per notification id.
#[derive(Clone)]
pub(crate) struct Upstream {
    pub(crate) down: Arc<AtomicBool>,
    recording: Arc<common::upstream::Upstream>,
}

impl Upstream {
    pub(crate) async fn start(down: bool) -> (Self, SocketAddr) {
        let down = Arc::new(AtomicBool::new(down));
        let flag = down.clone();
        let replies = Replies::default().status(move |_| {
            if flag.load(Ordering::SeqCst) {
                503
            } else {
                200
            }
        });
        let recording = common::upstream::Upstream::with(replies).await;
        let addr = recording.addr;
        let recording = Arc::new(recording);
        (Self { down, recording }, addr)
    }

    /// [`start`](Self::start), failing each notification's calls while
    /// `down` with 500, 502, 503 in turn (so that each attempt has an
    /// error of its own).
    pub(crate) async fn start_in_turn(down: bool) -> (Self, SocketAddr) {
        let down = Arc::new(AtomicBool::new(down));
        let (flag, calls) = (down.clone(), std::sync::Mutex::new(HashMap::new()));
        let replies = Replies::default().status(move |seen| {
            if !flag.load(Ordering::SeqCst) {
                return 200;
            }
            let v: serde_json::Value = serde_json::from_slice(&seen.body).unwrap_or_default();
            let id = v["id"].as_str().unwrap_or_default().to_owned();
            let mut calls = calls.lock().unwrap();
            let n: &mut usize = calls.entry(id).or_default();
            *n += 1;
            [500, 502, 503][(*n - 1) % 3]
        });
        let recording = common::upstream::Upstream::with(replies).await;
        let addr = recording.addr;
        let recording = Arc::new(recording);
        (Self { down, recording }, addr)
    }

    pub(crate) fn counts(&self) -> HashMap<String, usize> {
        let mut delivered = HashMap::new();
        for seen in self.recording.seen() {
            if seen.status == 200 {
                let v: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
                let id = v["id"].as_str().unwrap().to_owned();
                *delivered.entry(id).or_default() += 1;
            }
        }
        delivered
    }
}

/// The official WeChat Pay v3 notification with the id `id`.
pub(crate) fn notification(id: &str) -> String {
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = serde_json::Value::String(id.to_owned());
    v.to_string()
}

/// Starts the gateway with one ack-then-deliver WeChat Pay v3 route `/wx`.
pub(crate) fn gateway(
    upstream: SocketAddr,
    queue: &[&str],
    metrics: SocketAddr,
    extra: &[&str],
) -> Proc {
    let (upstream, metrics) = (format!("http://{upstream}"), metrics.to_string());
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--route",
        "/wx=wechatpay-v3",
        "--ack-then-deliver",
        "/wx",
        "--retry-backoff",
        "200ms",
        "--metrics-listen",
        &metrics,
    ];
    args.extend_from_slice(queue);
    args.extend_from_slice(extra);
    Proc::start(&args, &[], Stdio::inherit())
}

/// `name{queue="gateway"} VALUE` of `/metrics`.
pub(crate) fn gauge(metrics: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("queue=\"gateway\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// [`wait_until`] on a blocking thread, off the runtime's workers.
pub(crate) async fn wait_for(
    what: &str,
    limit: Duration,
    done: impl FnMut() -> bool + Send + 'static,
) {
    let what = what.to_owned();
    tokio::task::spawn_blocking(move || wait_until(&what, limit, done))
        .await
        .unwrap();
}

/// The upstream down: waits until the queue holds one entry per id (every
/// copy acknowledged, each notification queued once) and checks that none
/// was delivered; then, the upstream back, until the queue is empty, and
/// that each was delivered once.
async fn queued_once_then_delivered_once(up: &Upstream, metrics: SocketAddr, ids: &[String]) {
    let depth = ids.len() as f64;
    wait_for(
        &format!("a depth of {}", ids.len()),
        Duration::from_secs(30),
        move || gauge(metrics, "idempotency_queue_depth") == Some(depth),
    )
    .await;
    assert!(up.counts().is_empty());
    up.down.store(false, Ordering::SeqCst);
    wait_for("the queue to empty", Duration::from_secs(120), move || {
        gauge(metrics, "idempotency_queue_depth") == Some(0.0)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_once(up, ids);
}

/// Waits (at most `within`) until each of `ids` was delivered, then
/// `settle` more for a second delivery to show; checks each was delivered
/// once.
async fn delivered_once(up: &Upstream, ids: &[String], within: Duration, settle: Duration) {
    let (probe, want) = (up.clone(), ids.len());
    wait_for("every delivery", within, move || {
        probe.counts().len() == want
    })
    .await;
    tokio::time::sleep(settle).await;
    assert_once(up, ids);
}

/// Sends every copy of every notification at once; asserts each answer is
/// WeChat Pay's success reply.
pub(crate) async fn send_all(http: &HttpClient, gw: SocketAddr, ids: &[String]) {
    let mut tasks = Vec::new();
    for id in ids {
        let body = notification(id);
        for _ in 0..COPIES {
            let (http, body) = (http.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let headers = [("content-type", "application/json")];
                post(&http, gw, "/wx/notify", &headers, body).await
            }));
        }
    }
    for t in tasks {
        let answer = t.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(answer.text(), WECHAT_SUCCESS);
    }
}

pub(crate) fn assert_once(up: &Upstream, ids: &[String]) {
    let counts = up.counts();
    for id in ids {
        assert_eq!(
            counts.get(id),
            Some(&1),
            "{id} delivered {:?} times",
            counts.get(id)
        );
    }
    assert_eq!(
        counts.len(),
        ids.len(),
        "deliveries of unknown ids: {counts:?}"
    );
}

fn dlq(data_dir: &Path, args: &[&str]) -> (i32, String) {
    dlq_at(&["--data-dir", data_dir.to_str().unwrap()], args)
}

/// `gateway dlq --offline ARGS QUEUE`: exit status and stdout.
fn dlq_at(queue: &[&str], args: &[&str]) -> (i32, String) {
    let out = Command::new(gateway_bin())
        .args(["dlq", "--offline"])
        .args(args)
        .args(queue)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_down_200_notifications_7_copies_each_acked_queued_once_delivered_once() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let (up, up_addr) = Upstream::start(true).await;
    let dir = temp_path("ack-storm");
    let metrics = free_addr();
    let gw = gateway(
        up_addr,
        &["--data-dir", dir.to_str().unwrap()],
        metrics,
        &[],
    );
    let ids: Vec<String> = (0..200).map(|i| format!("EV-ACK-{i:04}")).collect();
    send_all(&client(), gw.addr, &ids).await;
    // Every copy was acknowledged while the upstream was down: 200 entries.
    queued_once_then_delivered_once(&up, metrics, &ids).await;
    let (_, text) = get(metrics, "/metrics");
    assert!(text.contains("idempotency_queue_attempts_total"), "{text}");
    assert!(text.contains("idempotency_queue_oldest_seconds"), "{text}");
    assert!(text.contains("idempotency_queue_dead_letters"), "{text}");
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// Acknowledged, then `kill -9` before the upstream is back: the restarted
/// gateway delivers it once.
async fn killed_after_ack_delivered_once_after_restart(queue: &[&str]) {
    let (up, up_addr) = Upstream::start(true).await;
    let ids = vec!["EV-ACK-KILL-1".to_owned(), "EV-ACK-KILL-2".to_owned()];
    let gw = gateway(up_addr, queue, free_addr(), &[]);
    send_all(&client(), gw.addr, &ids).await;
    gw.signal(libc::SIGKILL);
    drop(gw);
    assert!(up.counts().is_empty());
    up.down.store(false, Ordering::SeqCst);
    let gw = gateway(up_addr, queue, free_addr(), &[]);
    delivered_once(&up, &ids, Duration::from_secs(60), Duration::from_secs(2)).await;
    drop(gw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_ack_delivered_once_after_restart_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    let dir = temp_path("ack-kill");
    killed_after_ack_delivered_once_after_restart(&["--data-dir", dir.to_str().unwrap()]).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_ack_delivered_once_after_restart_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    killed_after_ack_delivered_once_after_restart(&[
        "--queue",
        &redis.url(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ])
    .await;
}

/// A Redis server of the test's own; `None` when Redis is not installed.
pub(crate) fn own_redis() -> Option<support_redis::RedisServer> {
    support_redis::redis_available().then(support_redis::RedisServer::start)
}

/// A virtual host of its own on the broker this binary shares (queues of
/// one name, `gateway`, in every test): the broker and the vhost's URL.
/// `None` when RabbitMQ is not installed.
pub(crate) fn rabbitmq_queue(tag: &str) -> Option<(Arc<support_rabbitmq::RabbitServer>, String)> {
    let broker = support_rabbitmq::shared_rabbitmq()?;
    let url = broker.vhost(&format!("{tag}-{}", std::process::id()));
    Some((broker, url))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_ack_delivered_once_after_restart_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = rabbitmq_queue("kill") else {
        return;
    };
    killed_after_ack_delivered_once_after_restart(&[
        "--queue",
        &url,
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ])
    .await;
}

/// Copies of `ids` (`copies` of each) sent at once, each retried every
/// 200 ms until it gets WeChat Pay's success reply (as the channel
/// does); copy `c` of notification `n` starts `n * spread`. The longest a
/// copy took to be acknowledged, and how many failure replies were seen.
async fn send_until_acked(
    gw: SocketAddr,
    ids: &[String],
    copies: usize,
    spread: Duration,
) -> (Duration, usize) {
    let http = client();
    let failures = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let body = notification(id);
        for _ in 0..copies {
            let (http, body, failures) = (http.clone(), body.clone(), failures.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(spread * n as u32).await;
                let headers = [("content-type", "application/json")];
                let started = Instant::now();
                for _ in 0..600 {
                    let a = post(&http, gw, "/wx/notify", &headers, body.clone()).await;
                    if a.status == 200 && a.text() == WECHAT_SUCCESS {
                        return Some(started.elapsed());
                    }
                    failures.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                None
            }));
        }
    }
    let mut longest = Duration::ZERO;
    for t in tasks {
        let took = t.await.unwrap().expect("a copy never acknowledged");
        longest = longest.max(took);
    }
    (longest, failures.load(Ordering::SeqCst))
}

/// 100 notifications x 5 copies at once on RabbitMQ while the upstream
/// fails: every copy gets the success reply at its first try, within 1 s,
/// and each notification is delivered once when the upstream is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_100_notifications_5_copies_acked_at_once_delivered_once_through_failures() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let Some((_broker, url)) = rabbitmq_queue("storm") else {
        return;
    };
    let (up, up_addr) = Upstream::start(true).await;
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        free_addr(),
        &[],
    );
    let ids: Vec<String> = (0..100).map(|i| format!("EV-AMQP-{i:04}")).collect();
    let (longest, failures) = send_until_acked(gw.addr, &ids, 5, Duration::ZERO).await;
    assert_eq!(failures, 0, "copies answered with a failure");
    assert!(
        longest < Duration::from_secs(1),
        "a copy acknowledged after {longest:?}"
    );
    // The upstream fails what reaches it (the breaker holds the rest back);
    // nothing is delivered.
    let probe = up.clone();
    wait_for("failed attempts", Duration::from_secs(60), move || {
        probe.recording.seen().len() >= 3
    })
    .await;
    assert!(up.counts().is_empty());
    up.down.store(false, Ordering::SeqCst);
    delivered_once(&up, &ids, Duration::from_secs(120), Duration::from_secs(2)).await;
    eprintln!("rabbitmq: 500 copies acknowledged, the slowest after {longest:?}");
    drop(gw);
}

/// The broker killed with `kill -9` while copies arrive, and started again
/// a second later: copies are answered with a failure meanwhile (and
/// retried by the channel), every notification is acknowledged in the
/// end, and each is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_killed_and_restarted_mid_storm_loses_nothing_and_runs_nothing_twice() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    if !support_rabbitmq::rabbitmq_available() {
        return;
    }
    let mut broker = support_rabbitmq::RabbitServer::start();
    let (up, up_addr) = Upstream::start(false).await;
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &broker.url(),
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        free_addr(),
        &[],
    );
    let ids: Vec<String> = (0..100)
        .map(|i| format!("EV-AMQP-RESTART-{i:04}"))
        .collect();
    let gw_addr = gw.addr;
    let sent = {
        let ids = ids.clone();
        tokio::spawn(
            async move { send_until_acked(gw_addr, &ids, 3, Duration::from_millis(30)).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let delivered_before = up.counts().len();
    let broker = tokio::task::spawn_blocking(move || {
        broker.kill();
        std::thread::sleep(Duration::from_secs(1));
        broker.restart();
        broker
    })
    .await
    .unwrap();
    let (_, failures) = sent.await.unwrap();
    delivered_once(&up, &ids, Duration::from_secs(120), Duration::from_secs(3)).await;
    eprintln!(
        "rabbitmq restart: {delivered_before} delivered before the kill, {failures} failure replies while it was down"
    );
    drop(gw);
    drop(broker);
}

/// The broker frozen (SIGSTOP: the gateway's connection stays open and
/// nothing on it is answered) while notifications arrive: each copy gets
/// WeChat Pay's failure reply within the bound on one exchange with the
/// broker, not when the broker comes back; once it is thawed, the channel's
/// retries are acknowledged and each notification is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_frozen_mid_storm_answers_failures_in_bounded_time_and_recovers() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    if !support_rabbitmq::rabbitmq_available() {
        return;
    }
    let broker = support_rabbitmq::RabbitServer::start();
    let (up, up_addr) = Upstream::start(false).await;
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &broker.url(),
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        free_addr(),
        &[],
    );
    let http = client();
    let json = [("content-type", "application/json")];
    // One notification through first: the connection is up and used.
    let first = vec!["EV-AMQP-FROZEN-FIRST".to_owned()];
    send_until_acked(gw.addr, &first, 1, Duration::ZERO).await;
    delivered_once(&up, &first, Duration::from_secs(60), Duration::ZERO).await;

    broker.freeze();
    // Ten copies at once, then ten more once those were answered: the
    // first wave finds the connection up and waits for confirms that never
    // come, the second finds it dropped and has to connect again.
    let mut ids = Vec::new();
    for wave in 0..2 {
        let wave_ids: Vec<String> = (0..10)
            .map(|i| format!("EV-AMQP-FROZEN-{wave}-{i:02}"))
            .collect();
        let started = Instant::now();
        let answers = futures_util::future::join_all(wave_ids.iter().map(|id| {
            let http = http.clone();
            let body = notification(id);
            async move {
                // Bounded here too: on a gateway that waits for the broker,
                // the copy would be answered only after the thaw below.
                let answer = post(&http, gw.addr, "/wx/notify", &json, body);
                tokio::time::timeout(Duration::from_secs(30), answer).await
            }
        }))
        .await;
        let took = started.elapsed();
        for (id, a) in wave_ids.iter().zip(&answers) {
            let Ok(a) = a else {
                broker.thaw();
                panic!("{id}: no answer within 30 s of a frozen broker");
            };
            assert_eq!(
                (a.status, a.text().as_str()),
                (500, common::vectors::WECHAT_FAIL),
                "{id}"
            );
        }
        eprintln!(
            "rabbitmq frozen: wave {wave}, 10 copies answered with a failure within {took:?}"
        );
        ids.extend(wave_ids);
    }
    broker.thaw();
    // Thawed: the retries are acknowledged, and each is delivered once.
    send_until_acked(gw.addr, &ids, 2, Duration::ZERO).await;
    let mut all = ids.clone();
    all.extend(first);
    delivered_once(&up, &all, Duration::from_secs(120), Duration::from_secs(2)).await;
    drop(gw);
    drop(broker);
}

/// On a broker's queue (`--queue URL`), while the gateway runs: past
/// `--max-attempts` the entry is a dead letter that `gateway dlq` lists;
/// a copy arriving while it is dead is a duplicate; `replay` brings it back
/// once (a second replay finds nothing) and it is delivered once; copies
/// arriving afterwards, when `again_after`, are duplicates too; the list is
/// empty in the end. The dead letter's line, for more checks.
async fn dead_letter_replayed_once_while_running(
    queue: &[&str],
    ids: &[String],
    again_after: bool,
) -> String {
    let (up, up_addr) = Upstream::start(true).await;
    let metrics = free_addr();
    let gw = gateway(up_addr, queue, metrics, &["--max-attempts", "2"]);
    send_all(&client(), gw.addr, ids).await;
    wait_for("a dead letter", Duration::from_secs(60), move || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    let (code, listed) = dlq_at(queue, &["list"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 1, "{listed}");
    assert!(lines[0].contains("attempts=2"), "{listed}");
    assert!(lines[0].contains("path=/wx/notify"), "{listed}");
    // A copy arriving while it is dead is a duplicate.
    send_all(&client(), gw.addr, ids).await;
    let id = lines[0].split('\t').next().unwrap().to_owned();
    up.down.store(false, Ordering::SeqCst);
    let (code, out) = dlq_at(queue, &["replay", &id]);
    assert_eq!((code, out.trim()), (0, format!("replayed {id}").as_str()));
    let (code, _) = dlq_at(queue, &["replay", &id]);
    assert_eq!(code, 1, "replayed twice");
    let (code, out) = dlq_at(queue, &["replay", "--all"]);
    assert_eq!((code, out.trim()), (0, "replayed 0"));
    let probe = up.clone();
    wait_for("the delivery", Duration::from_secs(60), move || {
        probe.counts().len() == 1
    })
    .await;
    if again_after {
        send_all(&client(), gw.addr, ids).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_once(&up, ids);
    let (code, out) = dlq_at(queue, &["list"]);
    assert_eq!((code, out.as_str()), (0, ""));
    drop(gw);
    lines[0].to_owned()
}

/// On RabbitMQ: past `--max-attempts` the entry is a dead letter, `gateway
/// dlq` lists it while the gateway runs, `replay` brings it back once (a
/// second replay finds nothing), and it is delivered once; copies arriving
/// afterwards are duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_dead_letter_replayed_once_with_dlq_subcommands() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = rabbitmq_queue("dlq") else {
        return;
    };
    let ids = vec!["EV-AMQP-DEAD-1".to_owned()];
    let line = dead_letter_replayed_once_while_running(
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        &ids,
        true,
    )
    .await;
    assert!(!line.ends_with("error="), "the last error: {line}");
}

/// `gateway ARGS --admin http://METRICS` with the admin token file: exit
/// code, stdout and stderr.
pub(crate) fn admin_cli(metrics: SocketAddr, token: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(gateway_bin())
        .arg("--admin-token-file")
        .arg(token)
        .args(args)
        .arg("--admin")
        .arg(format!("http://{metrics}"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Sends one copy of notification `id`; asserts WeChat Pay's success reply.
pub(crate) async fn send_one(gw: SocketAddr, id: &str) {
    let headers = [("content-type", "application/json")];
    let answer = post(&client(), gw, "/wx/notify", &headers, notification(id)).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.text(), WECHAT_SUCCESS);
}

/// `forget` on an acknowledge-then-deliver route forgets the queue's marker
/// of the key too: the next copy is acknowledged and delivered again. While
/// the entry is still queued, `forget` answers an error and forgets nothing.
async fn forgotten_key_is_delivered_again(queue: &[&str]) {
    let (up, up_addr) = Upstream::start(false).await;
    let dir = temp_path("ack-forget");
    let token = temp_path("ack-forget-token");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(&token, "s3cret-admin-token-0123456789\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let metrics = free_addr();
    let admin = [
        "--journal",
        "--data-dir",
        dir.to_str().unwrap(),
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    let gw = gateway(up_addr, queue, metrics, &admin);
    let id = format!("EV-ACK-FORGET-{}", std::process::id());
    // Delivered `n` times and settled in the queue (within 30 s).
    let delivered = |n: usize| {
        let (probe, id) = (up.clone(), id.clone());
        tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(30)
                && (probe.counts().get(&id) != Some(&n)
                    || gauge(metrics, "idempotency_queue_depth") != Some(0.0))
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            probe.counts()
        })
    };
    send_one(gw.addr, &id).await;
    assert_eq!(delivered(1).await.unwrap().get(&id), Some(&1));
    let (code, out, err) = admin_cli(metrics, &token, &["inspect", "--id", &id]);
    assert_eq!(code, 0, "{err}");
    let key = (out.lines().find_map(|l| l.strip_prefix("key: ")))
        .unwrap_or_else(|| panic!("no key in {out}"))
        .to_owned();
    // Forgotten: the next copy is delivered again.
    let (code, out, err) = admin_cli(metrics, &token, &["forget", &key]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("the next copy runs again"), "{out}");
    send_one(gw.addr, &id).await;
    let counts = delivered(2).await.unwrap();
    assert_eq!(
        counts.get(&id),
        Some(&2),
        "the copy after `forget` was not delivered again: {counts:?}"
    );
    // Forgotten again, and the next copy queued while the upstream is down:
    // `forget` refuses, and says why.
    let (code, out, err) = admin_cli(metrics, &token, &["forget", &key]);
    assert_eq!(code, 0, "{out}{err}");
    up.down.store(true, Ordering::SeqCst);
    send_one(gw.addr, &id).await;
    let (code, out, err) = admin_cli(metrics, &token, &["forget", &key]);
    assert_eq!(code, 1, "forget of a queued entry: {out}{err}");
    assert!(err.contains("still queued"), "{err}");
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_on_an_ack_route_delivers_the_next_copy_again_embedded() {
    let _beside = crate::gateway_support::beside_storms().await;
    let dir = temp_path("ack-forget-queue");
    forgotten_key_is_delivered_again(&["--queue", dir.to_str().unwrap()]).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_on_an_ack_route_delivers_the_next_copy_again_redis_streams() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(redis) = own_redis() else {
        return;
    };
    forgotten_key_is_delivered_again(&[
        "--queue",
        &redis.url(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_on_an_ack_route_delivers_the_next_copy_again_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = rabbitmq_queue("forget") else {
        return;
    };
    forgotten_key_is_delivered_again(&[
        "--queue",
        &url,
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_listed_and_replayed_once_with_dlq_subcommands() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, up_addr) = Upstream::start(true).await;
    let dir = temp_path("ack-dlq");
    let queue = ["--data-dir", dir.to_str().unwrap()];
    let metrics = free_addr();
    let gw = gateway(up_addr, &queue, metrics, &["--max-attempts", "2"]);
    let ids = vec!["EV-ACK-DEAD-1".to_owned()];
    send_all(&client(), gw.addr, &ids).await;
    wait_for("a dead letter", Duration::from_secs(60), move || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    // The embedded queue is one process's file: stop the gateway first.
    gw.signal(libc::SIGTERM);
    drop(gw);
    let (code, listed) = dlq(&dir, &["list"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 1, "{listed}");
    assert!(lines[0].contains("attempts=2"), "{listed}");
    assert!(lines[0].contains("path=/wx/notify"), "{listed}");
    let id = lines[0].split('\t').next().unwrap().to_owned();
    let (code, out) = dlq(&dir, &["replay", &id]);
    assert_eq!((code, out.trim()), (0, format!("replayed {id}").as_str()));
    // Never queued twice.
    let (code, _) = dlq(&dir, &["replay", &id]);
    assert_eq!(code, 1);
    let (code, out) = dlq(&dir, &["replay", "--all"]);
    assert_eq!((code, out.trim()), (0, "replayed 0"));
    let (code, out) = dlq(&dir, &["list"]);
    assert_eq!((code, out.as_str()), (0, ""));
    // A copy arriving now is a duplicate, not a second entry.
    up.down.store(false, Ordering::SeqCst);
    let metrics = free_addr();
    let gw = gateway(up_addr, &queue, metrics, &[]);
    send_all(&client(), gw.addr, &ids).await;
    delivered_once(&up, &ids, Duration::from_secs(60), Duration::from_secs(2)).await;
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ack_then_deliver_on_auto_or_unknown_prefix_exits_2() {
    for args in [
        &["--route", "/=auto", "--ack-then-deliver", "/"][..],
        &[
            "--route",
            "/wx=wechatpay-v3",
            "--ack-then-deliver",
            "/other",
        ][..],
        &[
            "--route",
            "/api=idempotency-key",
            "--ack-then-deliver",
            "/api",
        ][..],
        &["--route", "/wx=wechatpay-v3", "--queue", "ftp://x"][..],
    ] {
        let status = Command::new(gateway_bin())
            .args([
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn config_file_mode_ack_then_deliver_is_checked() {
    let cases = [
        ("/wx", "wechatpay-v3", "ack-then-deliver", 0),
        ("/wx", "wechatpay-v3", "synchronous", 0),
        ("/wx", "wechatpay-v3", "later", 2),
        ("/", "auto", "ack-then-deliver", 2),
        ("/api", "idempotency-key", "ack-then-deliver", 2),
    ];
    for (prefix, preset, mode, code) in cases {
        let path = temp_path("ack.toml");
        let text = format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:1\"\nmax_attempts = 3\n\
             [[route]]\nprefix = \"{prefix}\"\npreset = \"{preset}\"\nmode = \"{mode}\"\n"
        );
        std::fs::write(&path, text).unwrap();
        let out = Command::new(gateway_bin())
            .arg("--config")
            .arg(&path)
            .arg("--check-config")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{mode} on {preset}: {stderr}"
        );
        if code == 2 {
            assert!(stderr.contains(":7:"), "names the line: {stderr}");
        }
        let _ = std::fs::remove_file(path);
    }
}

/// `dlq replay` by filter: `--dry-run` counts what `--since`, `--route`
/// and `--error` select, then the same filters replay exactly those, and
/// each is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_replayed_in_bulk_by_filter() {
    let _beside = crate::gateway_support::beside_storms().await;
    let (up, up_addr) = Upstream::start(true).await;
    let dir = temp_path("ack-dlq-bulk");
    let queue = ["--data-dir", dir.to_str().unwrap()];
    let metrics = free_addr();
    let before =
        humantime::format_rfc3339_seconds(std::time::SystemTime::now() - Duration::from_secs(1))
            .to_string();
    let gw = gateway(up_addr, &queue, metrics, &["--max-attempts", "1"]);
    let ids: Vec<String> = (0..3).map(|i| format!("EV-ACK-BULK-{i}")).collect();
    send_all(&client(), gw.addr, &ids).await;
    wait_for("three dead letters", Duration::from_secs(60), move || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(3.0)
    })
    .await;
    gw.signal(libc::SIGTERM);
    drop(gw);
    let (_, listed) = dlq(&dir, &["list"]);
    let error = listed
        .lines()
        .next()
        .and_then(|l| l.split("error=").nth(1))
        .unwrap_or_else(|| panic!("no error in {listed}"))
        .to_owned();
    let count = |args: &[&str]| {
        let mut all = vec!["replay", "--dry-run"];
        all.extend_from_slice(args);
        dlq(&dir, &all)
    };
    assert_eq!(
        count(&["--route", "/elsewhere"]).1.trim(),
        "would replay 0 of 3 dead letters"
    );
    assert_eq!(
        count(&["--route", "/w"]).1.trim(),
        "would replay 0 of 3 dead letters",
        "a prefix of a segment is not the route"
    );
    assert_eq!(
        count(&["--error", "no such text"]).1.trim(),
        "would replay 0 of 3 dead letters"
    );
    assert_eq!(
        count(&["--since", "2999-01-01T00:00:00Z"]).1.trim(),
        "would replay 0 of 3 dead letters"
    );
    assert_eq!(
        count(&["--until", &before]).1.trim(),
        "would replay 0 of 3 dead letters"
    );
    let (code, out) = count(&["--since", &before, "--route", "/wx", "--error", &error]);
    assert_eq!((code, out.trim()), (0, "would replay 3 of 3 dead letters"));
    // A dry run replays nothing.
    assert_eq!(dlq(&dir, &["list"]).1.lines().count(), 3);
    let (code, _) = dlq(&dir, &["replay", "--since", "yesterday"]);
    assert_eq!(code, 1, "a time that is not RFC 3339 is refused");
    let (code, out) = dlq(
        &dir,
        &[
            "replay", "--since", &before, "--route", "/wx", "--error", &error,
        ],
    );
    assert_eq!((code, out.trim()), (0, "replayed 3"));
    assert_eq!(dlq(&dir, &["list"]).1, "");
    up.down.store(false, Ordering::SeqCst);
    let metrics = free_addr();
    let gw = gateway(up_addr, &queue, metrics, &[]);
    delivered_once(&up, &ids, Duration::from_secs(60), Duration::from_secs(1)).await;
    drop(gw);
    let _ = std::fs::remove_dir_all(dir);
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop;
/// `None`, said loudly, where mounting is refused (the tests run as root).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Option<Self> {
        let dir = temp_path("tmpfs");
        std::fs::create_dir_all(&dir).unwrap();
        let opts = format!("size={size}");
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &opts, "tmpfs"])
            .arg(&dir)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Self(dir)),
            other => {
                eprintln!(
                    "\n**** SKIPPED: cannot mount a {size} tmpfs for the full-disk test (it needs root): {other:?} ****\n"
                );
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    /// Bytes free on it.
    fn free(&self) -> u64 {
        let out = Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(&self.0)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines().nth(1).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A WeChat Pay v3 notification of about 12 KB.
fn padded(id: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&notification(id)).unwrap();
    v["padding"] = serde_json::Value::String("x".repeat(12_000));
    v.to_string()
}

/// A gateway on `data` with one ack-then-deliver WeChat Pay v3 route whose
/// failed deliveries are tried again within a second, its stderr in `log`.
fn disk_gateway(
    upstream: SocketAddr,
    data: &Path,
    metrics: SocketAddr,
    env: &[(&str, &str)],
    log: &Path,
) -> Proc {
    let config = log.with_extension("toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\nmode = \"ack-then-deliver\"\n\
         retry_schedule = [\"1s\"]\nbreaker_cooldown = \"1s\"\n",
    )
    .unwrap();
    let (upstream, metrics) = (format!("http://{upstream}"), metrics.to_string());
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--config",
        config.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
        "--max-attempts",
        "1000",
        "--metrics-listen",
        &metrics,
    ];
    let stderr = Stdio::from(std::fs::File::create(log).unwrap());
    Proc::start(&args, env, stderr)
}

/// Sends each id once, 8 at a time: the ids acknowledged with WeChat Pay's
/// success reply, and those answered its failure reply.
async fn send_each(
    http: &HttpClient,
    gw: SocketAddr,
    ids: &[String],
) -> (Vec<String>, Vec<String>) {
    let (mut acked, mut refused) = (Vec::new(), Vec::new());
    for chunk in ids.chunks(8) {
        let mut tasks = Vec::new();
        for id in chunk {
            let (http, body) = (http.clone(), padded(id));
            tasks.push(tokio::spawn(async move {
                let headers = [("content-type", "application/json")];
                post(&http, gw, "/wx/notify", &headers, body).await
            }));
        }
        for (id, t) in chunk.iter().zip(tasks) {
            let answer = t.await.unwrap();
            match (answer.status, answer.text()) {
                (200, text) if text == WECHAT_SUCCESS => acked.push(id.clone()),
                (500, text) if text == common::vectors::WECHAT_FAIL => refused.push(id.clone()),
                (status, text) => panic!("{id}: unexpected answer {status} {text}"),
            }
        }
    }
    (acked, refused)
}

/// The `WARN` lines of a gateway's log from its queue, or from the
/// ingests it failed.
fn queue_warnings(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("WARN"))
        .filter(|l| {
            ["queue::health", "queue::worker", "proxy::ingest"]
                .iter()
                .any(|from| l.contains(from))
        })
        .map(str::to_owned)
        .collect()
}

/// The disk of `--data-dir` fills while the upstream is down: every
/// acknowledged notification was stored, the gateway says it cannot write
/// (`/readyz`, the gauge, the error counter, a warning a minute); once
/// space is freed it reopens its file by itself, delivers every
/// acknowledged notification once and acknowledges new copies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_disk_freed_then_every_acked_notification_delivered_once_without_restart() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let Some(disk) = Tmpfs::mount("3m") else {
        return;
    };
    let filler = disk.0.join("filler");
    std::fs::write(&filler, vec![7u8; 1 << 20]).unwrap();
    let data = disk.0.join("data");
    let log = temp_path("full-disk.log");
    let (up, up_addr) = Upstream::start(true).await;
    let metrics = free_addr();
    // No reserve: the disk really fills.
    let env = [("IDEMPOTENCY_GATEWAY_DATA_DIR_RESERVE", "0")];
    let gw = disk_gateway(up_addr, &data, metrics, &env, &log);
    let http = client();
    let ids: Vec<String> = (0..400).map(|i| format!("EV-FULL-{i:04}")).collect();
    let (acked, refused) = send_each(&http, gw.addr, &ids).await;
    eprintln!(
        "{} acknowledged, {} refused; {} bytes free",
        acked.len(),
        refused.len(),
        disk.free()
    );
    assert!(
        !acked.is_empty() && refused.len() > 100,
        "the disk did not fill"
    );
    // While it lasts, the gateway says so.
    let mut wrong = Vec::new();
    let m = metrics;
    let said = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let unwritable = gauge(m, "idempotency_queue_writable") == Some(0.0);
            let counted =
                gauge(m, "idempotency_queue_write_errors_total").is_some_and(|n| n >= 1.0);
            let (status, _) = get(m, "/readyz");
            if (unwritable && counted && status == 503) || Instant::now() > deadline {
                break (unwritable, counted, status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap();
    if said != (true, true, 503) {
        wrong.push(format!(
            "while the disk is full: writable gauge at 0 {}, write errors counted {}, /readyz {} (want 503)",
            said.0, said.1, said.2
        ));
    }
    // A few seconds of the worker polling a queue that cannot write.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let warnings = queue_warnings(&log);
    if warnings.len() > 3 {
        wrong.push(format!(
            "{} queue warnings in a few seconds (want one a minute): {:#?}",
            warnings.len(),
            &warnings[..warnings.len().min(4)]
        ));
    }
    // Space is freed and the upstream comes back: no restart.
    std::fs::remove_file(&filler).unwrap();
    up.down.store(false, Ordering::SeqCst);
    let (probe, want) = (up.clone(), acked.clone());
    let freed = Instant::now();
    let delivered = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let counts = probe.counts();
            let all = want.iter().all(|id| counts.contains_key(id));
            if all || Instant::now() > deadline {
                break want.iter().filter(|id| counts.contains_key(*id)).count();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await
    .unwrap();
    eprintln!(
        "{delivered} of {} delivered {:?} after space was freed",
        acked.len(),
        freed.elapsed()
    );
    if delivered < acked.len() {
        wrong.push(format!(
            "{delivered} of the {} acknowledged notifications delivered within 30 s of freeing space",
            acked.len()
        ));
    }
    // New copies are acknowledged again, and delivered once.
    let again: Vec<String> = refused.iter().take(5).cloned().collect();
    let (acked_again, refused_again) = send_each(&http, gw.addr, &again).await;
    if !refused_again.is_empty() {
        wrong.push(format!(
            "after freeing space, {} of 5 new copies still got the failure reply",
            refused_again.len()
        ));
    }
    let (status, _) = get(metrics, "/readyz");
    if status != 200 {
        wrong.push(format!("/readyz {status} after recovery"));
    }
    let (probe, want) = (up.clone(), acked_again.clone());
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && !want.iter().all(|id| probe.counts().contains_key(id)) {
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let counts = up.counts();
    for id in acked.iter().chain(&acked_again) {
        if counts.get(id).is_some_and(|n| *n > 1) {
            wrong.push(format!("{id} delivered {} times", counts[id]));
        }
    }
    for id in &acked_again {
        if !counts.contains_key(id) {
            wrong.push(format!("{id}, acknowledged after recovery, not delivered"));
        }
    }
    drop(gw);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(log.with_extension("toml"));
    drop(disk);
    if !wrong.is_empty() {
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        panic!("{wrong:#?}\nlast lines of the gateway's log: {tail:#?}");
    }
}

/// `--data-dir-reserve` larger than the free space: every notification
/// gets the failure reply (nothing is acknowledged that was not stored),
/// `/readyz` answers 503, and nothing reaches the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_dir_reserve_over_the_free_space_refuses_ingests_with_the_failure_reply() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(disk) = Tmpfs::mount("3m") else {
        return;
    };
    let data = disk.0.join("data");
    let log = temp_path("reserve.log");
    let (up, up_addr) = Upstream::start(false).await;
    let metrics = free_addr();
    let env = [("IDEMPOTENCY_GATEWAY_DATA_DIR_RESERVE", "4MiB")];
    let gw = disk_gateway(up_addr, &data, metrics, &env, &log);
    let ids: Vec<String> = (0..16).map(|i| format!("EV-RESERVE-{i:02}")).collect();
    let (acked, refused) = send_each(&client(), gw.addr, &ids).await;
    let (status, body) = get(metrics, "/readyz");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let depth = gauge(metrics, "idempotency_queue_depth");
    let writable = gauge(metrics, "idempotency_queue_writable");
    let warnings = queue_warnings(&log);
    drop(gw);
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(log.with_extension("toml"));
    assert!(
        acked.is_empty(),
        "acknowledged under the reserve: {acked:?}"
    );
    assert_eq!(refused.len(), ids.len());
    assert_eq!((status, body.contains("queue")), (503, true), "{body}");
    assert_eq!((depth, writable), (Some(0.0), Some(0.0)));
    assert!(up.counts().is_empty(), "{:?}", up.counts());
    assert!(warnings.len() <= 1, "{warnings:#?}");
    drop(disk);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_ack_delivered_once_after_restart_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = support_nats::own() else {
        return;
    };
    killed_after_ack_delivered_once_after_restart(&[
        "--queue",
        &nats.url(),
        "--queue-secret-file",
        crate::gateway_support::queue_secret(),
    ])
    .await;
}

/// One copy, sent again every 200 ms until it gets the success reply (a
/// channel's retries): how long its first try took to be answered, whether
/// it was acknowledged within `give_up`, and how many tries it took.
async fn copy_until_acknowledged(
    http: HttpClient,
    gw: SocketAddr,
    body: String,
    give_up: Duration,
) -> (Duration, bool, usize) {
    let start = Instant::now();
    let mut first = None;
    let mut tries = 0;
    while start.elapsed() < give_up {
        let sent = Instant::now();
        let headers = [("content-type", "application/json")];
        let answer = post(&http, gw, "/wx/notify", &headers, body.clone()).await;
        tries += 1;
        first.get_or_insert(sent.elapsed());
        if answer.status == 200 && answer.text() == WECHAT_SUCCESS {
            return (first.unwrap_or_default(), true, tries);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (first.unwrap_or_default(), false, tries)
}

/// On JetStream: 100 notifications x 5 copies at once, while the upstream
/// fails: every copy acknowledged within a second, 100 entries, and once
/// the upstream is back each delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_down_100_notifications_5_copies_acked_within_1s_delivered_once_jetstream() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let Some(nats) = support_nats::own() else {
        return;
    };
    let (up, up_addr) = Upstream::start(true).await;
    let metrics = free_addr();
    let url = nats.url();
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        metrics,
        &[],
    );
    let ids: Vec<String> = (0..100).map(|i| format!("EV-JS-{i:04}")).collect();
    let http = client();
    let mut tasks = Vec::new();
    for id in &ids {
        for _ in 0..5 {
            let (http, body) = (http.clone(), notification(id));
            tasks.push(tokio::spawn(copy_until_acknowledged(
                http,
                gw.addr,
                body,
                Duration::from_secs(1),
            )));
        }
    }
    let mut slowest = Duration::ZERO;
    for t in tasks {
        let (took, acked, _) = t.await.unwrap();
        assert!(acked, "a copy was not acknowledged within 1 s");
        slowest = slowest.max(took);
    }
    assert!(
        slowest < Duration::from_secs(1),
        "slowest answer {slowest:?}"
    );
    queued_once_then_delivered_once(&up, metrics, &ids).await;
    eprintln!("jetstream: 500 copies, slowest answer {slowest:?}");
    drop(gw);
}

/// The JetStream server killed with `kill -9` in the middle of a storm and
/// started again: copies sent meanwhile get the failure reply and come
/// back; every notification acknowledged is delivered, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_server_killed_mid_storm_loses_nothing_acknowledged_runs_nothing_twice() {
    let _storm = crate::gateway_support::one_storm_at_a_time().await;
    let Some(mut nats) = support_nats::own() else {
        return;
    };
    let (up, up_addr) = Upstream::start(false).await;
    let url = nats.url();
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        free_addr(),
        &[],
    );
    let ids: Vec<String> = (0..60).map(|i| format!("EV-JS-KILL-{i:04}")).collect();
    let http = client();
    let mut tasks = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        for copy in 0..3 {
            let (http, body, addr) = (http.clone(), notification(id), gw.addr);
            tasks.push(tokio::spawn(async move {
                // Spread over about 2 s, across the kill and the restart.
                tokio::time::sleep(Duration::from_millis((n * 30 + copy * 7) as u64)).await;
                let start = Instant::now();
                let (_, acked, tries) =
                    copy_until_acknowledged(http, addr, body, Duration::from_secs(60)).await;
                (acked, tries, start.elapsed())
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    nats.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    nats.restart();
    let (mut refused, mut longest) = (0, Duration::ZERO);
    for t in tasks {
        let (acked, tries, took) = t.await.unwrap();
        assert!(acked, "a copy was never acknowledged");
        refused += tries - 1;
        longest = longest.max(took);
    }
    // The kill was felt: copies sent while it lasted were refused, or
    // answered only once the restarted server confirmed their entry.
    assert!(
        refused > 0 || longest > Duration::from_millis(1000),
        "no copy waited for the server: {refused} refused, longest {longest:?}"
    );
    delivered_once(&up, &ids, Duration::from_secs(90), Duration::from_secs(2)).await;
    eprintln!("jetstream server killed mid-storm: {refused} tries refused, the longest acknowledged after {longest:?}; all delivered once");
    drop(gw);
}

/// A JetStream server that wants a user and password: the gateway queues
/// and delivers through it, and no log line or start error shows the
/// password (an unreachable server stops the start, exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_credentials_in_the_url_work_and_are_never_printed() {
    let _beside = crate::gateway_support::beside_storms().await;
    if !support_nats::nats_available() {
        return;
    }
    let nats = support_nats::NatsServer::start_with(&["--user", "app", "--pass", "s3cret-pw"]);
    let url = format!("nats://app:s3cret-pw@127.0.0.1:{}", nats.port());
    let (up, up_addr) = Upstream::start(false).await;
    let log = temp_path("ack-nats-auth.log");
    let file = std::fs::File::create(&log).unwrap();
    let upstream = format!("http://{up_addr}");
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
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        &[],
        Stdio::from(file),
    );
    let ids = vec!["EV-JS-AUTH-1".to_owned()];
    send_all(&client(), gw.addr, &ids).await;
    let probe = up.clone();
    wait_for("the delivery", Duration::from_secs(30), move || {
        probe.counts().len() == 1
    })
    .await;
    assert_once(&up, &ids);
    drop(gw);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains("s3cret-pw"),
        "the password was logged:\n{text}"
    );
    assert!(text.contains("nats://app:***@127.0.0.1"), "{text}");
    let _ = std::fs::remove_file(&log);
    // Unreachable: the start fails with the URL redacted.
    let out = Command::new(gateway_bin())
        .args(["--listen", "127.0.0.1:0", "--upstream", &upstream])
        .args(["--route", "/wx=wechatpay-v3", "--ack-then-deliver", "/wx"])
        .args(["--queue", "nats://app:s3cret-pw@127.0.0.1:1"])
        .args([
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(!all.contains("s3cret-pw"), "{all}");
    assert!(
        all.contains("cannot open the queue at nats://app:***@127.0.0.1:1"),
        "{all}"
    );
}

/// On JetStream: past `--max-attempts` in the dead letters (the server's
/// stream), listed and replayed once with `gateway dlq` while the gateway
/// runs, then delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_replayed_once_with_dlq_subcommands_jetstream() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some(nats) = support_nats::own() else {
        return;
    };
    let url = nats.url();
    let ids = vec!["EV-JS-DEAD-1".to_owned()];
    dead_letter_replayed_once_while_running(
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        &ids,
        false,
    )
    .await;
}

#[path = "../../../crates/tower-idempotency-queue/examples/amqp_consumer.rs"]
#[allow(dead_code)]
mod amqp_consumer_example;

/// `examples/amqp_consumer` consumes what a gateway queued on RabbitMQ
/// (the upstream down, so the gateway delivered none of it, then the
/// gateway stopped): each notification is handled once, though every one
/// was sent three times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_consumer_example_handles_each_notification_the_gateway_queued_once_rabbitmq() {
    let _beside = crate::gateway_support::beside_storms().await;
    let Some((_broker, url)) = rabbitmq_queue("example") else {
        return;
    };
    let (up, up_addr) = Upstream::start(true).await;
    let gw = gateway(
        up_addr,
        &[
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ],
        free_addr(),
        &[],
    );
    let ids: Vec<String> = (0..20).map(|i| format!("EV-EXAMPLE-{i:04}")).collect();
    let (_, failures) = send_until_acked(gw.addr, &ids, 3, Duration::ZERO).await;
    assert_eq!(failures, 0, "copies answered with a failure");
    // Stopped: what it held unacknowledged goes back to the queue, what it
    // retried comes back from the delay queues.
    drop(gw);
    let handled = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let record = handled.clone();
    let consumer = tokio::spawn(async move {
        amqp_consumer_example::consume(
            &url,
            "gateway",
            tower_idempotency::store::MemoryStore::new(),
            move |n, _| {
                let v: serde_json::Value = serde_json::from_slice(&n.body).unwrap();
                let id = v["id"].as_str().unwrap().to_owned();
                *record.lock().unwrap().entry(id).or_default() += 1;
            },
        )
        .await
        .map_err(|e| e.to_string())
    });
    let probe = handled.clone();
    tokio::task::spawn_blocking(move || {
        wait_until(
            "every notification handled",
            Duration::from_secs(60),
            || probe.lock().unwrap().len() == ids.len(),
        )
    })
    .await
    .unwrap();
    // Late redeliveries would show now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    consumer.abort();
    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), 20);
    assert!(
        handled.values().all(|&n| n == 1),
        "handled more than once: {handled:?}"
    );
    assert!(up.counts().is_empty(), "the gateway delivered some");
}

/// A delivery whose upstream refuses the connection is recorded as what
/// happened (`connect refused`), not as an answer the upstream never gave
/// (the route's failure reply, `upstream answered 500`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_dead_lettered_as_refused() {
    let _beside = crate::gateway_support::beside_storms().await;
    let dir = temp_path("ack-refused");
    let metrics = free_addr();
    // Nothing listens there.
    let nobody = free_addr();
    let queue = ["--data-dir", dir.to_str().unwrap()];
    let gw = gateway(nobody, &queue, metrics, &["--max-attempts", "1"]);
    send_one(gw.addr, "EV-REFUSED-1").await;
    wait_for("a dead letter", Duration::from_secs(60), move || {
        gauge(metrics, "idempotency_queue_dead_letters") == Some(1.0)
    })
    .await;
    // The embedded queue is one process's file: stop the gateway first.
    gw.signal(libc::SIGTERM);
    drop(gw);
    let (code, listed) = dlq(&dir, &["list"]);
    assert_eq!(code, 0);
    assert!(
        listed.contains("connect refused") && !listed.contains("answered"),
        "{listed}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
