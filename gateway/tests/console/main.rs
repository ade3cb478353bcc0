//! The console at `/console/` in a real browser: headless Chromium driven
//! over WebDriver (Debian's `chromium` and `chromium-driver`). It logs in
//! with the token, pauses and resumes a route, replays a dead letter,
//! finds a journal record by id (a stale event's shown as `stale`), and
//! runs nothing a sender wrote (a body
//! holding `<script>` and `<img onerror>`, and an attempt's error holding
//! markup, show as text).

#[path = "../gateway_support/mod.rs"]
mod gateway_support;

use fantoccini::{ClientBuilder, Locator};
use gateway_support::{temp_path, Proc};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_support::common::upstream::{Replies, Upstream};
use test_support::common::vectors::fixture;
use test_support::common::{client, free_addr, post};

const TOKEN: &str = "s3cret-admin-token-0123456789";
const ATTACK: &str = r#"<script>window.__xss=1</script><img src=x onerror="window.__xss=2">"#;
/// An attempt's error holding markup (a queue others can write to carries
/// whatever they wrote).
const ATTEMPT_ATTACK: &str = r#"<img src=x onerror="window.__xss=3">"#;

/// Writes into the queue of `dir` a dead letter whose attempts failed with
/// [`ATTEMPT_ATTACK`] and another error, before the gateway opens it.
async fn seed_hostile_dead_letter(dir: &std::path::Path) {
    use std::os::unix::fs::DirBuilderExt as _;
    use tower_idempotency_queue::{Message, Queue, RedbQueue};
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(dir)
        .unwrap();
    let q = RedbQueue::open(dir.join("queue.redb")).unwrap();
    let m = Message::new(
        "seeded-hostile",
        tower_idempotency::Fingerprint::of(b"seeded"),
        "{}",
    );
    q.ingest(m).await.unwrap();
    let lease = Duration::from_secs(30);
    let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
    assert!(q.retry(&d, Duration::ZERO, ATTEMPT_ATTACK).await.unwrap());
    let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
    assert!(q.dead_letter(&d, "second <b>bold</b>").await.unwrap());
}

/// `chromedriver` and `chromium`, or `None` (said loudly) outside CI when
/// either is missing.
fn browser() -> Option<()> {
    let found = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if found("chromedriver") && found("chromium") {
        return Some(());
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "chromium or chromedriver is missing in CI: .ci/run installs Debian's chromium and chromium-driver"
    );
    eprintln!(
        "SKIPPED: chromium or chromedriver not found (apt-get install -y chromium chromium-driver)"
    );
    None
}

/// Kills the chromedriver it holds when dropped.
struct Driver(std::process::Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn admin_get(metrics: std::net::SocketAddr, path: &str) -> serde_json::Value {
    use http_body_util::BodyExt as _;
    let req = http::Request::get(format!("http://{metrics}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let res = client().request(req).await.unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

async fn wait_until<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Opens the console at `page` and logs in with [`TOKEN`].
async fn log_in(c: &fantoccini::Client, page: &str) {
    c.goto(page).await.unwrap();
    let wait = c.wait().at_most(Duration::from_secs(30));
    wait.for_element(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(TOKEN)
        .await
        .unwrap();
    c.find(Locator::Id("login-button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_headless_chromium_pauses_replays_finds_and_runs_nothing_a_sender_wrote() {
    let Some(()) = browser() else { return };
    let started = Instant::now();
    // The upstream down until the dead letter is replayed.
    let down = Arc::new(AtomicBool::new(true));
    let flag = down.clone();
    let replies = Replies::default().status(move |_| {
        if flag.load(Ordering::SeqCst) {
            503
        } else {
            200
        }
    });
    let up = Upstream::with(replies).await;
    let token = temp_path("console-token");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let dir = temp_path("console-data");
    seed_hostile_dead_letter(&dir).await;
    let metrics = free_addr();
    let (upstream, metrics_arg) = (up.url(), metrics.to_string());
    // The WeChat Pay route acknowledges, then delivers; the Stripe route
    // keeps its payment intents in order (a stale event for the journal).
    let config = temp_path("console.toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/wx\"\npreset = \"wechatpay-v3\"\nmode = \"ack-then-deliver\"\n\
         [[route]]\nprefix = \"/stripe\"\npreset = \"stripe\"\norder = \"stripe\"\n",
    )
    .unwrap();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--config",
            config.to_str().unwrap(),
            "--max-attempts",
            "1",
            "--journal",
            "--data-dir",
            dir.to_str().unwrap(),
            "--metrics-listen",
            &metrics_arg,
            "--admin-token-file",
            token.to_str().unwrap(),
        ],
        &[],
        Stdio::inherit(),
    );
    // A notification whose body holds markup: it dies (one attempt).
    let id = format!("EV-CONSOLE-{}", std::process::id());
    let doc = fixture("wechatpay_v3_notify_official_doc_transaction_success.json");
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["id"] = id.clone().into();
    v["summary"] = ATTACK.into();
    let headers = [("content-type", "application/json")];
    let answer = post(&client(), gw.addr, "/wx/notify", &headers, v.to_string()).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    wait_until("the dead letter", || async {
        admin_get(metrics, "/admin/dead").await["dead_letters"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    })
    .await;

    // The page: only itself, by its policy.
    let raw = gateway_support::raw_http(
        metrics,
        "GET /console/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let status = &raw[9..12];
    assert_eq!(status, "200", "{raw}");
    let csp = raw
        .lines()
        .find_map(|l| l.strip_prefix("content-security-policy: "))
        .unwrap_or_else(|| panic!("no CSP in {raw}"));
    assert!(
        csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );
    assert!(
        !raw.contains("http://") && !raw.contains("https://"),
        "an outside reference: {raw}"
    );

    let port = free_addr().port();
    let profile = temp_path("console-chromium");
    let _driver = Driver(
        Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let caps: serde_json::Map<String, serde_json::Value> = serde_json::from_value(serde_json::json!({
        "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                format!("--user-data-dir={}", profile.display()),
            ]
        }
    }))
    .unwrap();
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let mut browser = None;
    for _ in 0..100 {
        let mut builder = ClientBuilder::new(connector.clone());
        builder.capabilities(caps.clone());
        match builder.connect(&format!("http://127.0.0.1:{port}")).await {
            Ok(c) => {
                browser = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let c = browser.expect("chromedriver did not start");
    log_in(&c, &format!("http://{metrics}/console/")).await;
    let wait = || c.wait().at_most(Duration::from_secs(30));
    // Pause, then resume, the route from its buttons.
    wait()
        .for_element(Locator::Id("pause-_wx"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait().for_element(Locator::Id("resume-_wx")).await.unwrap();
    let routes = admin_get(metrics, "/admin/routes").await;
    assert!(routes["routes"][0]["paused"].is_object(), "{routes}");
    c.find(Locator::Id("resume-_wx"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait().for_element(Locator::Id("pause-_wx")).await.unwrap();
    let routes = admin_get(metrics, "/admin/routes").await;
    assert!(routes["routes"][0]["paused"].is_null(), "{routes}");

    // The seeded dead letter's attempts show their markup as text.
    let row = |key: &str| format!("//table[@id='dead']/tbody/tr[td[contains(., '{key}')]]");
    let seeded = wait()
        .for_element(Locator::XPath(&format!("{}/td", row("seeded-hostile"))))
        .await
        .unwrap();
    seeded.click().await.unwrap();
    let detail = wait()
        .for_element(Locator::Css("#dead-detail"))
        .await
        .unwrap();
    wait_until("the seeded dead letter's detail", || async {
        detail
            .text()
            .await
            .unwrap_or_default()
            .contains("seeded-hostile")
    })
    .await;
    let shown = detail.text().await.unwrap();
    let attempts: Vec<&str> = (shown.lines())
        .filter(|l| l.starts_with("attempt "))
        .collect();
    assert_eq!(attempts.len(), 2, "{shown}");
    assert!(
        attempts[0].starts_with("attempt 1 at ") && attempts[0].ends_with(ATTEMPT_ATTACK),
        "{shown}"
    );
    assert!(attempts[1].ends_with("second <b>bold</b>"), "{shown}");

    // The dead letter's detail shows the markup as text, and runs none.
    let first = wait()
        .for_element(Locator::XPath(&format!("{}/td", row(&id))))
        .await
        .unwrap();
    first.click().await.unwrap();
    let detail = wait()
        .for_element(Locator::Css("#dead-detail"))
        .await
        .unwrap();
    wait_until("the dead letter's detail", || async {
        detail.text().await.unwrap_or_default().contains(&id)
    })
    .await;
    let shown = detail.text().await.unwrap();
    assert!(
        shown.contains(r#"<script>window.__xss=1</script>"#),
        "{shown}"
    );
    assert!(shown.contains("onerror="), "{shown}");
    // Replayed from its button: delivered once.
    down.store(false, Ordering::SeqCst);
    c.find(Locator::XPath(&format!("{}//button", row(&id))))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until("the replayed delivery", || async {
        up.seen().iter().any(|s| s.status == 200)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(up.seen().iter().filter(|s| s.status == 200).count(), 1);

    // The journal record, found by the channel's id.
    c.find(Locator::Id("journal-id"))
        .await
        .unwrap()
        .send_keys(&id)
        .await
        .unwrap();
    c.find(Locator::Id("journal-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let record = wait()
        .for_element(Locator::Css(".journal-record td"))
        .await
        .unwrap();
    assert!(record.text().await.unwrap().ends_with(&id));
    record.click().await.unwrap();
    let detail = c
        .find(Locator::Id("journal-detail"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(detail.contains("\"route\": \"/wx\""), "{detail}");

    // A stale event (its payment intent had moved past it) is shown as such.
    let stale = format!("evt_console_stale_{}", std::process::id());
    let intent = format!("pi_console_{}", std::process::id());
    for (event, kind, created) in [
        (
            format!("evt_console_ahead_{}", std::process::id()),
            "payment_intent.succeeded",
            2,
        ),
        (stale.clone(), "payment_intent.created", 1),
    ] {
        let body = format!(
            r#"{{"id":"{event}","object":"event","type":"{kind}","created":{created},"data":{{"object":{{"id":"{intent}","object":"payment_intent"}}}}}}"#
        );
        let answer = post(&client(), gw.addr, "/stripe", &headers, body).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    wait_until("the stale record", || async {
        admin_get(metrics, "/admin/journal?outcome=stale").await["records"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
    })
    .await;
    let field = c.find(Locator::Id("journal-id")).await.unwrap();
    field.clear().await.unwrap();
    field.send_keys(&stale).await.unwrap();
    c.find(Locator::Id("journal-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let shown = wait()
        .for_element(Locator::XPath(&format!(
            "//tr[@class='journal-record'][td[1][contains(., '{stale}')]]/td[@class='journal-outcomes']"
        )))
        .await
        .unwrap();
    assert_eq!(shown.text().await.unwrap(), "stale");

    // The charts read the instance's samples (one every 5 s).
    wait_until("two samples", || async {
        admin_get(metrics, "/admin/stats").await["samples"]
            .as_array()
            .is_some_and(|s| s.len() >= 2)
    })
    .await;
    let stats = admin_get(metrics, "/admin/stats").await;
    assert!(stats["samples"][0]["requests"].is_object(), "{stats}");
    let legend = c.find(Locator::Id("chart-ratio-legend")).await.unwrap();
    wait_until("the charts", || async {
        legend
            .text()
            .await
            .unwrap_or_default()
            .contains("duplicate ratio (")
    })
    .await;
    // The charts: a swatch of its own colour per series, axes with units
    // and times.
    let series = c
        .execute(
            "return [...document.querySelectorAll('#chart-rate-legend li.series')].map((li) => [li.textContent, li.dataset.color, getComputedStyle(li.querySelector('.swatch')).backgroundColor]);",
            vec![],
        )
        .await
        .unwrap();
    let series = series.as_array().unwrap().clone();
    assert!(!series.is_empty(), "no legend");
    let colors: std::collections::HashSet<String> = series
        .iter()
        .map(|s| s[1].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        colors.len(),
        series.len(),
        "two series share a colour: {series:?}"
    );
    for s in &series {
        let text = s[0].as_str().unwrap();
        assert!(!text.contains('#'), "a colour printed as text: {text}");
        let shown = s[2].as_str().unwrap();
        assert!(
            shown.starts_with("rgb(") && shown != "rgba(0, 0, 0, 0)",
            "no swatch: {s:?}"
        );
    }
    // Every outcome the layers count, and two this page does not know, each
    // a colour of its own.
    let all = c
        .execute(
            "const names = ['executed','failed','replayed','waited','in_flight_rejected','mismatch','key_missing','rejected_bad_input','store_error','lease_lost','passed_through','run_limit_exceeded','reply_deadline','completion_abandoned','unverified','panicked','shed','too_many_copies','stale','new_one','another']; const c = colorsFor(names); return names.map((n) => c[n]);",
            vec![],
        )
        .await
        .unwrap();
    let all: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let distinct: std::collections::HashSet<&str> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "{all:?}");
    let axes = c
        .execute(
            "return ['chart-rate', 'chart-ratio'].map((id) => [document.getElementById(id).dataset.yAxis, document.getElementById(id).dataset.xAxis]);",
            vec![],
        )
        .await
        .unwrap();
    let (rate_y, rate_x) = (axes[0][0].as_str().unwrap(), axes[0][1].as_str().unwrap());
    assert!(rate_y.starts_with("0.0 /s |"), "{axes}");
    assert_eq!(rate_x.split(" | ").count(), 3, "{axes}");
    assert!(
        rate_x
            .split(" | ")
            .all(|t| t.len() == 5 && t.as_bytes()[2] == b':'),
        "{axes}"
    );
    assert_eq!(axes[1][0], "0 % | 50 % | 100 %", "{axes}");
    // The first screen: is everything fine? Here it is not: dead letters.
    let health = c.find(Locator::Id("health")).await.unwrap();
    wait_until("the health line", || async {
        health
            .text()
            .await
            .unwrap_or_default()
            .starts_with("Needs attention")
    })
    .await;
    let row = c
        .find(Locator::Id("route-_wx"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(row.contains(&upstream) && row.contains("queued"), "{row}");
    // The first screen, as a person sees it.
    c.set_window_size(1280, 1000).await.unwrap();
    c.execute("window.scrollTo(0, 0); return 0;", vec![])
        .await
        .unwrap();
    let shot = c.screenshot().await.unwrap();
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console.png");
    std::fs::write(&out, &shot).unwrap();
    assert!(shot.starts_with(b"\x89PNG"), "not a PNG");
    eprintln!("console screenshot: {}", out.display());

    // Nothing a sender wrote ran, and no element came of it; the token
    // never went into a URL.
    let ran = c
        .execute("return [typeof window.__xss, document.querySelectorAll('img').length, document.querySelectorAll('#main script').length];", vec![])
        .await
        .unwrap();
    assert_eq!(ran, serde_json::json!(["undefined", 0, 0]));
    let url = c.current_url().await.unwrap();
    assert!(!url.as_str().contains(TOKEN), "{url}");

    // A gateway without a queue: no dead letters to show, and no error box.
    let sync_metrics = free_addr();
    let sync_metrics_arg = sync_metrics.to_string();
    let sync = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream,
            "--route",
            "/wx=wechatpay-v3",
            "--metrics-listen",
            &sync_metrics_arg,
            "--admin-token-file",
            token.to_str().unwrap(),
        ],
        &[],
        Stdio::inherit(),
    );
    // Another origin (port): the token is asked again.
    log_in(&c, &format!("http://{sync_metrics}/console/")).await;
    let health = wait().for_element(Locator::Id("health")).await.unwrap();
    wait_until("the health line of the synchronous gateway", || async {
        health
            .text()
            .await
            .unwrap_or_default()
            .starts_with("Everything is fine")
    })
    .await;
    let shown = c
        .execute(
            "return [document.getElementById('dead-section').hidden, document.body.innerText];",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(shown[0], true, "{shown}");
    let text = shown[1].as_str().unwrap();
    assert!(
        !text.contains("409") && !text.contains("no queue"),
        "{text}"
    );
    drop(sync);

    c.close().await.unwrap();
    drop(gw);
    eprintln!("console browser test took {:?}", started.elapsed());
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(profile);
    let _ = std::fs::remove_file(token);
    let _ = std::fs::remove_file(config);
}
