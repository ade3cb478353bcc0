//! A route's `order` through the binary: the events of one object reach
//! the upstream only moving forward, in every order they arrive; a stale
//! event gets the channel's success, is journaled `stale`, and its copies
//! replay; an event the order cannot place is forwarded; two gateways on
//! one Redis or PostgreSQL store keep one object's events in order; on an
//! ack-then-deliver route a queued event its object has moved past is
//! settled as stale, never delivered (WeChat Pay v3's too, its resource
//! decrypted again at delivery), across an upstream outage and a `kill -9`
//! mid-delivery; `--check-config` names a bad `order` or `[[order]]` at its
//! line.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;
use test_support::support_sql;

use common::upstream::{Replies, Upstream};
use common::{client, free_addr, post, Answer};
use gateway_support::{exits_2, gateway_bin, temp_path, Gateway};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "s3cret-order-token-0123456789";

/// The three events of a payment intent's life, in order: `(type, created)`.
const LIFE: [(&str, u64); 3] = [
    ("payment_intent.created", 100),
    ("payment_intent.processing", 101),
    ("payment_intent.succeeded", 102),
];

/// A Stripe event `id` of `object`.
pub(crate) fn event(id: &str, object: &str, kind: &str, created: u64) -> String {
    format!(
        r#"{{"id":"{id}","object":"event","type":"{kind}","created":{created},"data":{{"object":{{"id":"{object}","object":"payment_intent"}}}}}}"#
    )
}

/// The `created` of each event the upstream accepted (200) about
/// `object`, in the order it saw them.
pub(crate) fn seen_created(up: &Upstream, object: &str) -> Vec<u64> {
    up.seen()
        .iter()
        .filter(|s| s.status == 200)
        .filter_map(|s| {
            let v: serde_json::Value = serde_json::from_slice(&s.body).ok()?;
            (v["data"]["object"]["id"] == object).then(|| v["created"].as_u64().unwrap())
        })
        .collect()
}

/// Every order of `0..3`.
pub(crate) const ORDERS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [0, 2, 1],
    [1, 0, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
];

/// Which of `order` reach the upstream: each one ahead of every earlier.
pub(crate) fn forward_moves(order: &[usize]) -> Vec<usize> {
    let mut best = None;
    let mut out = Vec::new();
    for &i in order {
        if best.is_none_or(|b| i > b) {
            best = Some(i);
            out.push(i);
        }
    }
    out
}

/// A gateway with `config` (TOML), the journal and the admin API on.
pub(crate) struct Ordered {
    pub(crate) gw: Gateway,
    pub(crate) admin: SocketAddr,
    token: PathBuf,
    dir: PathBuf,
    config: PathBuf,
}

impl Drop for Ordered {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.token);
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The gateway with the config file `file`, the journal in `dir`, the
/// admin API on `admin`.
fn launch(
    upstream: &str,
    file: &Path,
    dir: &Path,
    token: &Path,
    admin: SocketAddr,
    extra: &[&str],
) -> Gateway {
    let admin_arg = admin.to_string();
    let mut args = vec![
        "--config",
        file.to_str().unwrap(),
        "--journal",
        "--data-dir",
        dir.to_str().unwrap(),
        "--admin-listen",
        &admin_arg,
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Gateway::start(upstream, &args)
}

impl Ordered {
    pub(crate) fn start(upstream: &str, config: &str, extra: &[&str]) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let (token, dir, file) = (
            temp_path("order-token"),
            temp_path("order-data"),
            temp_path("order.toml"),
        );
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&file, config).unwrap();
        let admin = free_addr();
        let gw = launch(upstream, &file, &dir, &token, admin, extra);
        Self {
            gw,
            admin,
            token,
            dir,
            config: file,
        }
    }

    /// `kill -9`, then the same gateway again (its config, data dir and
    /// `extra`).
    pub(crate) fn kill_and_restart(&mut self, upstream: &str, extra: &[&str]) {
        self.gw.signal(libc::SIGKILL);
        self.gw.wait_exit(Duration::from_secs(10));
        self.admin = free_addr();
        let (file, dir, token) = (&self.config, &self.dir, &self.token);
        self.gw = launch(upstream, file, dir, token, self.admin, extra);
    }

    /// The journal's records with `outcome`, as JSON.
    pub(crate) fn journal(&self, outcome: &str) -> Vec<serde_json::Value> {
        let out = Command::new(gateway_bin())
            .arg("--admin-token-file")
            .arg(&self.token)
            .args(["journal", "--outcome", outcome, "--format", "json"])
            .args(["--limit", "1000"])
            .arg("--admin")
            .arg(format!("http://{}", self.admin))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        json["records"].as_array().unwrap().clone()
    }

    /// Waits (up to 30 s) until the journal's `outcome` records hold the
    /// key of each of `ids`; their records.
    pub(crate) async fn journaled(&self, outcome: &str, ids: &[String]) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let records = self.journal(outcome);
            let has = |id: &String| {
                records.iter().any(|r| {
                    r["key"].as_str().unwrap().ends_with(&format!(":{id}"))
                        && r["outcomes"][outcome].as_u64().unwrap_or(0) > 0
                })
            };
            if ids.iter().all(has) {
                return records;
            }
            assert!(
                Instant::now() < deadline,
                "not journaled `{outcome}`: {ids:?} in {records:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn send(gw: SocketAddr, path: &str, body: String) -> Answer {
    let headers = [("content-type", "application/json")];
    post(&client(), gw, path, &headers, body).await
}

const STRIPE_ROUTE: &str =
    "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\norder = \"stripe\"\n";

/// Every order of three events of one object on a synchronous route: the
/// upstream sees each event that is ahead of every earlier one, and only
/// those; the others get 200 with `idempotent-stale: true`, are journaled
/// `stale`, and a copy of one replays that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_route_forwards_only_forward_moves() {
    let up = Upstream::start().await;
    let gw = Ordered::start(&up.url(), STRIPE_ROUTE, &[]);
    let run = std::process::id();
    let mut stale_ids = Vec::new();
    for (n, order) in ORDERS.iter().enumerate() {
        let object = format!("pi_{run}_{n}");
        let id = |i: usize| format!("evt_{run}_{n}_{i}");
        for &i in order {
            let (kind, created) = LIFE[i];
            let answer = send(gw.gw.addr, "/stripe", event(&id(i), &object, kind, created)).await;
            assert_eq!(answer.status, 200, "{order:?} event {i}: {}", answer.text());
        }
        let want: Vec<u64> = forward_moves(order).iter().map(|&i| LIFE[i].1).collect();
        assert_eq!(seen_created(&up, &object), want, "order {order:?}");
        for i in (0..3).filter(|i| !forward_moves(order).contains(i)) {
            stale_ids.push(id(i));
        }
    }
    // Each stale event journaled as such.
    gw.journaled("stale", &stale_ids).await;
    // A stale event's copy: the recorded answer, replayed; the upstream is
    // not called.
    let object = format!("pi_{run}_5");
    let calls = up.total();
    let copy = send(
        gw.gw.addr,
        "/stripe",
        event(&format!("evt_{run}_5_0"), &object, LIFE[0].0, LIFE[0].1),
    )
    .await;
    assert_eq!(copy.status, 200, "{}", copy.text());
    assert!(copy.replayed(), "{:?}", copy.headers);
    assert_eq!(copy.headers["idempotent-stale"], "true");
    assert_eq!(up.total(), calls);
    // Stale, the channel's success reply is the answer: 200.
    let fresh = send(
        gw.gw.addr,
        "/stripe",
        event(&format!("evt_{run}_5_late"), &object, LIFE[1].0, LIFE[1].1),
    )
    .await;
    assert_eq!(fresh.status, 200, "{}", fresh.text());
    assert_eq!(fresh.headers["idempotent-stale"], "true");
    assert!(!fresh.replayed());
    assert_eq!(up.total(), calls);
    // The access log says so: each stale event's line (not its copy's,
    // a replay) is `outcome="stale"`, and no other line is (a line is
    // written once the answer is sent).
    let stale_lines = |log: &str| {
        (log.lines())
            .filter(|l| l.contains("gateway::access") && l.contains("outcome=\"stale\""))
            .count()
    };
    let logged = Instant::now();
    while stale_lines(&gw.gw.log()) < stale_ids.len() + 1 && logged.elapsed().as_secs() < 5 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = gw.gw.log();
    assert_eq!(stale_lines(&log), stale_ids.len() + 1, "{log}");
}

/// An event the order cannot place (a type outside the object's life, no
/// object) is forwarded as if there were no order, even once its object
/// has moved on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_order_cannot_place_is_forwarded() {
    let up = Upstream::start().await;
    let gw = Ordered::start(&up.url(), STRIPE_ROUTE, &[]);
    let run = std::process::id();
    let object = format!("pi_unplaced_{run}");
    let done = event(&format!("evt_u_{run}_0"), &object, LIFE[2].0, 500);
    assert_eq!(send(gw.gw.addr, "/stripe", done).await.status, 200);
    let updated = event(&format!("evt_u_{run}_1"), &object, "charge.updated", 1);
    let answer = send(gw.gw.addr, "/stripe", updated).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(answer.headers.get("idempotent-stale").is_none());
    let nobody = format!(
        r#"{{"id":"evt_u_{run}_2","object":"event","type":"payment_intent.created","created":1}}"#
    );
    assert_eq!(send(gw.gw.addr, "/stripe", nobody).await.status, 200);
    assert_eq!(up.calls("/stripe"), 3);
}

/// Two gateways on one Redis store, many events of one object at once
/// through both: the upstream sees their positions strictly increasing
/// (one event of the object at a time, across the instances), and the
/// last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_keep_an_object_in_order() {
    if !support_redis::redis_available() {
        eprintln!("skipped: no redis-server");
        return;
    }
    let redis = support_redis::RedisServer::start();
    two_gateways_keep_an_object_in_order(&redis.url()).await;
}

/// The same on one PostgreSQL store (the SQL store's position upsert).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_postgres_keep_an_object_in_order() {
    let Some(pg) = support_sql::shared_postgres() else {
        eprintln!("skipped: no postgres");
        return;
    };
    two_gateways_keep_an_object_in_order(pg.url()).await;
}

/// Two gateways on `store`, 24 events of one object at once through both.
async fn two_gateways_keep_an_object_in_order(store: &str) {
    let up = Upstream::with(Replies::default().delay(Duration::from_millis(5))).await;
    let store = ["--store", store];
    let (a, b) = (
        Ordered::start(&up.url(), STRIPE_ROUTE, &store),
        Ordered::start(&up.url(), STRIPE_ROUTE, &store),
    );
    // An object of its own: a shared server keeps the objects of earlier runs.
    let run = format!(
        "{:x}",
        tower_idempotency::store::OwnerToken::new().as_u128()
    );
    let object = format!("pi_storm_{run}");
    let n = 24;
    let gws = [a.gw.addr, b.gw.addr];
    let answers = common::all_at_once(n, |i| {
        let (gw, object, run) = (gws[i % 2], object.clone(), run.clone());
        // Every other one in reverse: the newest and the oldest race.
        let created = if i % 2 == 0 { 1000 + i } else { 1000 + n - i };
        async move {
            let body = event(
                &format!("evt_storm_{run}_{created}"),
                &object,
                LIFE[1].0,
                created as u64,
            );
            // The channel sends again what was not accepted (an object
            // busy past the wait).
            for _ in 0..20 {
                let answer = send(gw, "/stripe", body.clone()).await;
                if answer.status == 200 {
                    return answer.status;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            0
        }
    })
    .await;
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
    let seen = seen_created(&up, &object);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "the upstream saw an object move back: {seen:?}"
    );
    assert_eq!(seen.last().copied(), Some(1000 + n as u64 - 1), "{seen:?}");
}

/// `--check-config` with `config`: exit 2 with `hint`.
fn refused(config: &str, hint: &str) {
    let file = temp_path("order-check.toml");
    std::fs::write(&file, config).unwrap();
    let mut cmd = Command::new(gateway_bin());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:1",
    ])
    .args(["--check-config", "--config"])
    .arg(&file);
    exits_2(cmd, &format!("{}:{hint}", file.display()));
    let _ = std::fs::remove_file(&file);
}

/// `--check-config` with `config`: exit 0; what it printed.
fn accepted(config: &str) -> String {
    let file = temp_path("order-check.toml");
    std::fs::write(&file, config).unwrap();
    let out = Command::new(gateway_bin())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .args(["--check-config", "--config"])
        .arg(&file)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{config}\n{stderr}");
    assert!(stderr.contains("the configuration is valid"), "{stderr}");
    stderr.into_owned()
}

const SHIPMENTS: &str = "[[order]]\nname = \"shipments\"\nobject = \"json:/order_id\"\n\
     version = \"json:/seq\"\nstate = \"json:/status\"\n\
     states = [\"created\", \"paid\", \"shipped\"]\n";

/// A route's `order` and the `[[order]]` tables are checked where they are
/// written: FILE:LINE and the reason.
#[test]
fn check_config_names_a_bad_order_at_its_line() {
    let route = |order: &str| {
        format!("[[route]]\nprefix = \"/p\"\npreset = \"stripe\"\norder = \"{order}\"\n")
    };
    accepted(&format!("{}{SHIPMENTS}", route("shipments")));
    // Another channel's built-in order places nothing of this one's: a warning.
    for builtin in ["alipay", "paypal", "wechatpay-v3"] {
        let said = accepted(&route(builtin));
        let warning = format!("warning: route `/p`: order `{builtin}` is another channel's");
        assert!(said.contains(&warning), "{said}");
    }
    assert!(!accepted(&route("stripe")).contains("warning: route `/p`: order"));
    let wechat =
        "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\norder = \"wechatpay-v3\"\n";
    let said = accepted(wechat);
    assert!(
        said.contains("order `wechatpay-v3` reads the resource the route's `verify` decrypts"),
        "{said}"
    );
    refused(
        &route("nope"),
        "4: `order`: unknown order `nope`; expected a built-in order (stripe, alipay, paypal, wechatpay-v3)",
    );
    refused(
        &format!("{}{SHIPMENTS}", route("nope")),
        "4: `order`: unknown order `nope`; expected a built-in order (stripe, alipay, paypal, \
         wechatpay-v3), or an [[order]] of this file (shipments)",
    );
    refused(
        "[[order]]\nname = \"s\"\nobject = \"jsn:/id\"\nversion = \"json:/seq\"\n",
        "3: `object`: unknown key source `jsn:/id`",
    );
    refused(
        "[[order]]\nname = \"s\"\nobject = \"json:/id\"\nstate = \"json:/status\"\n",
        "4: `state` needs `states`",
    );
    refused(
        "[[order]]\nname = \"s\"\nobject = \"json:/id\"\nstates = [\"a\", \"b\"]\n",
        "4: `states` needs `state`",
    );
    refused(
        &format!("{SHIPMENTS}{SHIPMENTS}"),
        "8: order `shipments` is defined twice",
    );
    refused(
        "[[order]]\nname = \"s\"\nobject = \"json:/id\"\ncolour = \"red\"\n",
        "4: unknown field `colour`",
    );
    refused(
        "[[order]]\nname = \"s\"\nobject = \"json:/id\"\n",
        "2: order s: neither a version nor a state to order the events by",
    );
    refused(
        "[[order]]\nname = \"stripe\"\nobject = \"json:/id\"\nversion = \"json:/v\"\n",
        "2: order name \"stripe\" is a built-in order's",
    );
    refused(
        "[[route]]\nprefix = \"/\"\npreset = \"auto\"\norder = \"stripe\"\n",
        "4: `order` needs the route's preset, not `auto`",
    );
}

/// The value of the `/metrics` series `name` whose labels hold each of `labels`.
fn metric(admin: SocketAddr, name: &str, labels: &[&str]) -> Option<f64> {
    let (_, body) = gateway_support::get(admin, "/metrics");
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Every order of three events of one object on an ack-then-deliver route:
/// each is acknowledged; at delivery the upstream gets only the forward
/// moves, and each event its object had moved past is settled as stale:
/// journaled `stale`, acked (the queue empties), never delivered, not a
/// dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_then_deliver_route_delivers_only_forward_moves() {
    let up = Upstream::start().await;
    let config = "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\norder = \"stripe\"\n\
                  mode = \"ack-then-deliver\"\ndeliver_concurrency = 1\n";
    let gw = Ordered::start(&up.url(), config, &[]);
    let run = std::process::id();
    let (mut stale_ids, mut delivered_ids) = (Vec::new(), Vec::new());
    for (n, order) in ORDERS.iter().enumerate() {
        let object = format!("pi_ack_{run}_{n}");
        let id = |i: usize| format!("evt_ack_{run}_{n}_{i}");
        for &i in order {
            let (kind, created) = LIFE[i];
            let answer = send(gw.gw.addr, "/stripe", event(&id(i), &object, kind, created)).await;
            assert_eq!(answer.status, 200, "{order:?} event {i}: {}", answer.text());
        }
        for i in 0..3 {
            match forward_moves(order).contains(&i) {
                true => delivered_ids.push(id(i)),
                false => stale_ids.push(id(i)),
            }
        }
    }
    gw.journaled("stale", &stale_ids).await;
    gw.journaled("delivered", &delivered_ids).await;
    for (n, order) in ORDERS.iter().enumerate() {
        let want: Vec<u64> = forward_moves(order).iter().map(|&i| LIFE[i].1).collect();
        let object = format!("pi_ack_{run}_{n}");
        assert_eq!(seen_created(&up, &object), want, "order {order:?}");
    }
    // Stale ones were never delivered, nor failed, nor dead-lettered.
    for r in gw.journal("stale") {
        assert!(r["outcomes"].get("delivered").is_none(), "{r:#}");
        assert!(r["outcomes"].get("delivery_failed").is_none(), "{r:#}");
    }
    let settled = Instant::now();
    while metric(gw.admin, "idempotency_queue_depth", &[]) != Some(0.0) {
        assert!(
            settled.elapsed() < Duration::from_secs(10),
            "the queue did not empty"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        metric(gw.admin, "idempotency_queue_dead_letters", &[]),
        Some(0.0)
    );
    assert_eq!(
        metric(
            gw.admin,
            "idempotency_order_events_total",
            &["order=\"stripe\"", "result=\"stale\""]
        ),
        Some(stale_ids.len() as f64)
    );
}

/// The ids of the events the upstream saw whose id starts with `prefix`,
/// in the order it saw them.
fn seen_ids(up: &Upstream, prefix: &str) -> Vec<String> {
    up.seen()
        .iter()
        .filter_map(|s| {
            let v: serde_json::Value = serde_json::from_slice(&s.body).ok()?;
            let id = v["id"].as_str()?;
            id.starts_with(prefix).then(|| id.to_owned())
        })
        .collect()
}

/// Every order of three WeChat Pay v3 notifications of one `out_trade_no`
/// (`NOTPAY`, `USERPAYING`, `SUCCESS`) on an ack-then-deliver route: each
/// is acknowledged, and at delivery the route decrypts the resource again
/// (the order reads `trade_state` there): the upstream gets only the
/// forward moves, and the others are settled as stale, never delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wechatpay_v3_on_an_ack_then_deliver_route_delivers_only_forward_moves() {
    use test_support::verify_support::{self, signed};
    let up = Upstream::start().await;
    let pem = temp_path("order-wx.pem");
    std::fs::write(
        &pem,
        verify_support::fixture("alipay_gbk_test_public_key.pem"),
    )
    .unwrap();
    let config = format!(
        "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\norder = \"wechatpay-v3\"\n\
         mode = \"ack-then-deliver\"\ndeliver_concurrency = 1\n\
         verify = {{ platform_keys = {{ \"{}\" = \"{}\" }}, api_v3_key = \"{}\" }}\n",
        signed::WECHAT_V3_SERIAL,
        pem.display(),
        signed::WECHAT_V3_KEY
    );
    let gw = Ordered::start(&up.url(), &config, &[]);
    const STATES: [&str; 3] = ["NOTPAY", "USERPAYING", "SUCCESS"];
    let run = std::process::id();
    let (mut stale_ids, mut delivered_ids) = (Vec::new(), Vec::new());
    for (n, order) in ORDERS.iter().enumerate() {
        let trade = format!("wx_ack_{run}_{n}");
        let id = |i: usize| format!("EV-wx-{run}-{n}-{i}");
        for &i in order {
            let resource = format!(
                r#"{{"mchid":"1230000109","out_trade_no":"{trade}","transaction_id":"42000{run}{n}","trade_state":"{}","amount":{{"total":100}}}}"#,
                STATES[i]
            );
            let (headers, body) = signed::wechat_v3(&id(i), &resource);
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let answer = post(&client(), gw.gw.addr, "/wx", &h, body).await;
            assert_eq!(answer.status, 200, "{order:?} event {i}: {}", answer.text());
        }
        for i in 0..3 {
            match forward_moves(order).contains(&i) {
                true => delivered_ids.push(id(i)),
                false => stale_ids.push(id(i)),
            }
        }
    }
    gw.journaled("stale", &stale_ids).await;
    gw.journaled("delivered", &delivered_ids).await;
    for (n, order) in ORDERS.iter().enumerate() {
        let want: Vec<String> = forward_moves(order)
            .iter()
            .map(|i| format!("EV-wx-{run}-{n}-{i}"))
            .collect();
        let seen = seen_ids(&up, &format!("EV-wx-{run}-{n}-"));
        assert_eq!(seen, want, "order {order:?}");
    }
    for r in gw.journal("stale") {
        assert!(r["outcomes"].get("delivered").is_none(), "{r:#}");
    }
    assert_eq!(
        metric(
            gw.admin,
            "idempotency_order_events_total",
            &["order=\"wechatpay-v3\"", "result=\"stale\""]
        ),
        Some(stale_ids.len() as f64)
    );
    assert_eq!(
        metric(gw.admin, "idempotency_queue_dead_letters", &[]),
        Some(0.0)
    );
    let _ = std::fs::remove_file(pem);
}

/// An ack-then-deliver Stripe route with an order, delivering one at a
/// time and retrying every 100 ms, and `extra` keys.
fn ack_route(extra: &str) -> String {
    format!(
        "[[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\norder = \"stripe\"\n\
         mode = \"ack-then-deliver\"\ndeliver_concurrency = 1\nretry_schedule = [\"100ms\"]\n{extra}"
    )
}

/// Sends the three events of object `pi_{tag}_{n}` in each of [`ORDERS`]
/// (event `i` of order `n` is `evt_{tag}_{n}_{i}`); each is acknowledged.
async fn send_every_order(gw: SocketAddr, tag: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for (n, order) in ORDERS.iter().enumerate() {
        let object = format!("pi_{tag}_{n}");
        for &i in order {
            let (kind, created) = LIFE[i];
            let id = format!("evt_{tag}_{n}_{i}");
            let answer = send(gw, "/stripe", event(&id, &object, kind, created)).await;
            assert_eq!(answer.status, 200, "{order:?} event {i}: {}", answer.text());
            ids.push(id);
        }
    }
    ids
}

/// Waits (up to `limit`) until the queue is empty and every one of `ids`
/// is journaled `delivered` or `stale`; the ids delivered.
async fn settled(gw: &Ordered, ids: &[String], limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let (delivered, stale) = (gw.journal("delivered"), gw.journal("stale"));
        let has = |records: &[serde_json::Value], outcome: &str, id: &String| {
            records.iter().any(|r| {
                r["key"].as_str().unwrap().ends_with(&format!(":{id}"))
                    && r["outcomes"][outcome].as_u64().unwrap_or(0) > 0
            })
        };
        let done = ids
            .iter()
            .all(|id| has(&delivered, "delivered", id) || has(&stale, "stale", id));
        if done && metric(gw.admin, "idempotency_queue_depth", &[]) == Some(0.0) {
            return (ids.iter())
                .filter(|id| has(&delivered, "delivered", id))
                .cloned()
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "not settled: {ids:?} in {delivered:#?} {stale:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the upstream accepted of each object of [`send_every_order`]: never
/// a move back (an event again, after a crash, is the same event), the
/// last event always (nothing is ahead of it), and each id it accepted is
/// one `settled` found delivered.
fn only_forward_moves(up: &Upstream, tag: &str, delivered: &[String]) {
    for n in 0..ORDERS.len() {
        let object = format!("pi_{tag}_{n}");
        let seen = seen_created(up, &object);
        assert!(
            seen.windows(2).all(|w| w[0] <= w[1]),
            "the upstream saw {object} move back: {seen:?}"
        );
        assert_eq!(seen.last().copied(), Some(LIFE[2].1), "{object}: {seen:?}");
        for (i, (_, created)) in LIFE.iter().enumerate() {
            let id = format!("evt_{tag}_{n}_{i}");
            assert_eq!(
                seen.contains(created),
                delivered.contains(&id),
                "{id}: accepted by the upstream {seen:?}, journaled delivered {delivered:?}"
            );
        }
    }
}

/// An upstream outage while the events of one object queue, out of order,
/// on an ack-then-deliver route: every attempt fails (500) for a while,
/// then the upstream is back; each event is delivered or settled stale,
/// the upstream accepts only forward moves, nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_outage_while_events_queue_loses_nothing_and_moves_only_forward() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let down = Arc::new(AtomicBool::new(true));
    let flag = down.clone();
    let up = Upstream::with(Replies::default().status(move |_| {
        if flag.load(Ordering::SeqCst) {
            500
        } else {
            200
        }
    }))
    .await;
    let gw = Ordered::start(&up.url(), &ack_route("breaker_cooldown = \"200ms\"\n"), &[]);
    let tag = format!("outage_{}", std::process::id());
    let ids = send_every_order(gw.gw.addr, &tag).await;
    let failing = Instant::now();
    while up.seen().iter().filter(|s| s.status == 500).count() < 20 {
        assert!(failing.elapsed() < Duration::from_secs(30), "no attempts");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    down.store(false, Ordering::SeqCst);
    let delivered = settled(&gw, &ids, Duration::from_secs(60)).await;
    only_forward_moves(&up, &tag, &delivered);
    assert_eq!(
        metric(gw.admin, "idempotency_queue_dead_letters", &[]),
        Some(0.0)
    );
}

/// `kill -9` of a gateway while it delivers (the upstream answers slowly),
/// on an ack-then-deliver route with the embedded queue and a SQLite store,
/// then the same gateway again: each event is delivered or settled stale,
/// the upstream accepts only forward moves (the event it was given when the
/// gateway died may come again, never one behind it), nothing is
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_delivery_moves_only_forward_after_restart() {
    let up = Upstream::with(Replies::default().delay(Duration::from_millis(300))).await;
    let file = support_sql::SqliteFile::new();
    let url = file.url();
    let store = ["--store", url.as_str()];
    let mut gw = Ordered::start(&up.url(), &ack_route("lease = \"1s\"\n"), &store);
    let tag = format!("kill_{}", std::process::id());
    let ids = send_every_order(gw.gw.addr, &tag).await;
    let started = Instant::now();
    while up.total() < 3 {
        assert!(started.elapsed() < Duration::from_secs(30), "no delivery");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Mid-delivery: the upstream is answering one now.
    tokio::time::sleep(Duration::from_millis(100)).await;
    gw.kill_and_restart(&up.url(), &store);
    let delivered = settled(&gw, &ids, Duration::from_secs(90)).await;
    only_forward_moves(&up, &tag, &delivered);
    assert_eq!(
        metric(gw.admin, "idempotency_queue_dead_letters", &[]),
        Some(0.0)
    );
}
