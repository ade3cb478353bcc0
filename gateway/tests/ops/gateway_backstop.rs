//! The gateway with Redis in front of a SQL database (`--store redis://…
//! --backstop postgres://…`): a Redis restarted without persistence after a
//! storm replays every notification from the database and runs none again
//! (Redis alone runs them all again); `/readyz` stays ready on the database
//! while Redis is away (Redis alone is not ready then); the admin
//! API inspects and forgets through both; a `--backstop` without a Redis
//! store, or that is no SQL database, exits 2.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;
use test_support::support_sql;

use common::upstream::Upstream;
use common::{all_at_once, client, free_addr, post};
use gateway_support::{exits_2, gateway_bin, get, temp_path, Gateway};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;
use support_redis::{redis_available, RedisServer};
use support_sql::{shared_postgres, SqliteFile};

const IDS: usize = 12;
const COPIES: usize = 3;
const PATH: &str = "/notify/stripe";
const TOKEN: &str = "s3cret-admin-token-0123456789";

/// A Stripe event's body.
fn event(id: &str) -> String {
    format!(r#"{{"id":"{id}","object":"event","type":"charge.succeeded"}}"#)
}

/// `COPIES` copies of each of `IDS` events, all at once: each id's answer
/// (every copy's, which must agree) and whether every copy was a replay.
async fn storm(gw: SocketAddr, run: &str) -> HashMap<String, (String, bool)> {
    let client = client();
    let answers = all_at_once(IDS * COPIES, |i| {
        let (client, id) = (client.clone(), format!("evt_{run}_{}", i % IDS));
        async move {
            let headers = [("content-type", "application/json")];
            let a = post(&client, gw, PATH, &headers, event(&id)).await;
            (id, a)
        }
    })
    .await;
    let mut by_id: HashMap<String, (String, bool)> = HashMap::new();
    for (id, a) in answers {
        assert_eq!(a.status, 200, "{id}: {}", a.text());
        let (text, replayed) = by_id.entry(id.clone()).or_insert_with(|| (a.text(), true));
        assert_eq!(*text, a.text(), "{id}: every copy gets the same answer");
        *replayed &= a.replayed();
    }
    assert_eq!(by_id.len(), IDS);
    by_id
}

/// Polls `/readyz` until it answers `want` (at most 10 s).
fn wait_ready(metrics: SocketAddr, want: u16) {
    wait_readyz(metrics, want, "");
}

/// Polls `/readyz` until it answers `want` with a body containing `says`
/// (at most 10 s).
fn wait_readyz(metrics: SocketAddr, want: u16, says: &str) {
    for _ in 0..100 {
        let (status, body) = get(metrics, "/readyz");
        if status == want && body.contains(says) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "/readyz never answered {want} {says:?}: {:?}",
        get(metrics, "/readyz")
    );
}

/// A gateway over `redis` (and `backstop`), with no local tier (every
/// repeat asks Redis), metrics and the admin API; the token file's path.
fn start(up: &Upstream, redis: &RedisServer, backstop: Option<&str>) -> (Gateway, SocketAddr) {
    let metrics = free_addr();
    let token_file = temp_path("backstop-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    // Readable by its owner only: the gateway refuses a token others can read.
    let owner_only = std::os::unix::fs::PermissionsExt::from_mode(0o600);
    std::fs::set_permissions(&token_file, owner_only).unwrap();
    let (redis_url, metrics_arg) = (redis.url(), metrics.to_string());
    let mut args = vec![
        "--store",
        &redis_url,
        "--local-max-memory",
        "0",
        "--route",
        "/notify/stripe=stripe",
        "--metrics-listen",
        &metrics_arg,
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ];
    if let Some(url) = backstop {
        args.extend(["--backstop", url]);
    }
    let gw = Gateway::start(&up.url(), &args);
    wait_ready(metrics, 200);
    (gw, metrics)
}

/// Storm, restart Redis without persistence, storm again: the upstream's
/// calls after each storm, and the two storms' answers.
type Storms = (
    usize,
    usize,
    HashMap<String, (String, bool)>,
    HashMap<String, (String, bool)>,
);

async fn storms_across_a_redis_data_loss(backstop: Option<&str>) -> Storms {
    let up = Upstream::start().await;
    let mut redis = RedisServer::start();
    let (gw, metrics) = start(&up, &redis, backstop);
    let run = format!(
        "{:x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    );
    let first = storm(gw.addr, &run).await;
    let before = up.calls(PATH);
    redis.stop_without_saving();
    if backstop.is_some() {
        // Still ready while Redis is away: the database serves alone.
        wait_readyz(metrics, 200, "serving from the backstop database");
        // And it does: every copy replays from the database alone.
        let away = storm(gw.addr, &run).await;
        assert!(
            away.values().all(|(_, replayed)| *replayed),
            "every copy replayed while Redis was away: {away:?}"
        );
    } else {
        wait_ready(metrics, 503);
    }
    redis.restart();
    // Back to Redis in front (the plain "ready").
    wait_readyz(metrics, 200, "ready\n");
    let second = storm(gw.addr, &run).await;
    (before, up.calls(PATH), first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_without_persistence_replays_from_the_backstop() {
    if !redis_available() {
        return;
    }
    let Some(pg) = shared_postgres() else {
        return;
    };
    let (before, after, first, second) = storms_across_a_redis_data_loss(Some(pg.url())).await;
    assert_eq!(before, IDS, "one upstream call per notification");
    assert_eq!(after, IDS, "the database answered what Redis lost");
    for (id, (text, _)) in &first {
        let (again, replayed) = &second[id];
        assert!(replayed, "{id}: every copy after the restart replayed");
        assert_eq!(again, text, "{id}: the same answer as the first time");
    }
}

/// The control: Redis alone forgets, and every notification runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_backstop_a_redis_data_loss_runs_everything_again() {
    if !redis_available() {
        return;
    }
    let (before, after, _, second) = storms_across_a_redis_data_loss(None).await;
    assert_eq!(before, IDS);
    assert_eq!(after, 2 * IDS);
    assert!(second.values().all(|(_, replayed)| !replayed));
}

/// `gateway ARGS --admin URL` with the token: exit code, stdout, stderr.
fn admin(metrics: SocketAddr, args: &[&str]) -> (i32, String, String) {
    let token_file = temp_path("backstop-cli-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    // Readable by its owner only: the gateway refuses a token others can read.
    let owner_only = std::os::unix::fs::PermissionsExt::from_mode(0o600);
    std::fs::set_permissions(&token_file, owner_only).unwrap();
    let out = Command::new(gateway_bin())
        .arg("--admin-token-file")
        .arg(&token_file)
        .args(args)
        .arg("--admin")
        .arg(format!("http://{metrics}"))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&token_file);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Inspect and forget find the record in the database once Redis lost it;
/// after the forget the next copy runs once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_forget_go_through_both_stores() {
    if !redis_available() {
        return;
    }
    let Some(pg) = shared_postgres() else {
        return;
    };
    let up = Upstream::start().await;
    let mut redis = RedisServer::start();
    let (gw, metrics) = start(&up, &redis, Some(pg.url()));
    let id = format!(
        "evt_admin_{:x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    );
    let send = || async {
        let headers = [("content-type", "application/json")];
        post(&client(), gw.addr, PATH, &headers, event(&id)).await
    };
    assert_eq!(send().await.status, 200);
    redis.stop_without_saving();
    redis.restart();
    wait_ready(metrics, 200);
    let key = format!("idem:stripe:{PATH}::{id}");
    let (code, out, err) = admin(metrics, &["inspect", &key]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("record: completed: status 200"), "{out}");
    let (code, out, err) = admin(metrics, &["forget", &key, "--by", "oncall"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("forgotten"), "{out}");
    let (code, _, err) = admin(metrics, &["forget", &key]);
    assert_eq!(code, 1, "a second forget finds nothing: {err}");
    let again = send().await;
    assert_eq!(again.status, 200);
    assert!(!again.replayed());
    assert_eq!(
        up.calls(PATH),
        2,
        "the forgotten notification ran once more"
    );
    assert!(send().await.replayed());
    assert_eq!(up.calls(PATH), 2);
}

fn gateway(args: &[&str]) -> Command {
    let mut cmd = Command::new(gateway_bin());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
    ])
    .args(args);
    cmd
}

#[test]
fn a_backstop_needs_a_redis_store_and_a_sql_url() {
    let file = SqliteFile::new();
    let sqlite = file.url();
    // Without a Redis store in front.
    for store in ["memory", sqlite.as_str()] {
        exits_2(
            gateway(&["--store", store, "--backstop", &sqlite]),
            "`--backstop` goes behind a Redis store",
        );
    }
    exits_2(
        gateway(&["--backstop", &sqlite]),
        "`--backstop` goes behind a Redis store",
    );
    // Not a SQL database.
    for bad in ["redis://127.0.0.1:1", "memory", "sqlite:", "http://x"] {
        exits_2(
            gateway(&["--store", "redis://127.0.0.1:1", "--backstop", bad]),
            "expected a SQL database behind the Redis store",
        );
    }
    // The config file's key and the environment variable, checked alike.
    let config = temp_path("backstop.toml");
    std::fs::write(&config, format!("backstop = \"{sqlite}\"\n")).unwrap();
    let mut cmd = gateway(&["--config", config.to_str().unwrap()]);
    cmd.env_remove("IDEMPOTENCY_GATEWAY_STORE");
    exits_2(cmd, "`--backstop` goes behind a Redis store");
    std::fs::write(
        &config,
        "store = \"redis://127.0.0.1:1\"\nbackstop = \"redis://h:1\"\n",
    )
    .unwrap();
    exits_2(
        gateway(&["--config", config.to_str().unwrap()]),
        "expected a SQL database behind the Redis store",
    );
    let _ = std::fs::remove_file(&config);
    let mut cmd = gateway(&["--store", "redis://127.0.0.1:1"]);
    cmd.env("IDEMPOTENCY_GATEWAY_BACKSTOP", "redis://:pw@h:1");
    exits_2(cmd, "expected a SQL database behind the Redis store");
    // A password in either URL is never printed.
    let out = gateway(&["--store", "memory"])
        .args(["--backstop", "postgres://app:s3cret-pw@127.0.0.1:9/shop"])
        .output()
        .unwrap();
    let bad = gateway(&["--store", "redis://127.0.0.1:1"])
        .args(["--backstop", "redis://:s3cret-pw@127.0.0.1:9"])
        .output()
        .unwrap();
    for out in [out, bad] {
        assert_eq!(out.status.code(), Some(2));
        let all = String::from_utf8_lossy(&out.stderr);
        assert!(!all.contains("s3cret-pw"), "{all}");
    }
}

/// A database that cannot be reached stops the start (exit 1) without
/// printing its password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_backstop_stops_the_start_without_its_password() {
    if !redis_available() {
        return;
    }
    let redis = RedisServer::start();
    let out = gateway(&["--store", &redis.url()])
        .args(["--backstop", "postgres://app:s3cret-pw@127.0.0.1:9/shop"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("cannot open the postgres backstop"), "{all}");
    assert!(!all.contains("s3cret-pw"), "{all}");
}

/// A password given as a query parameter of the backstop's URL
/// (`?password=`, as libpq takes it) is redacted in the start-up log, like
/// one in the userinfo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_the_backstop_query_is_not_logged() {
    if !redis_available() {
        return;
    }
    let Some(pg) = shared_postgres() else {
        return;
    };
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let url = format!("{}?password=hunter2", pg.url());
    let (gw, _metrics) = start(&up, &redis, Some(&url));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !gw.log().contains("gateway started") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = gw.log();
    assert!(log.contains("gateway started"), "{log}");
    assert!(!log.contains("hunter2"), "the password was logged:\n{log}");
    assert!(log.contains("password=***"), "{log}");
}
