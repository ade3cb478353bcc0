//! `[[upstreams]]` through the binary: each route reaches its own upstream,
//! and a hung upstream never sheds another upstream's calls.

use crate::gateway_support;
use test_support::common;

use common::upstream::{Replies, Upstream};
use common::{client, post};
use gateway_support::{gateway_bin, get, temp_path, Proc};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sample(text: &str, name: &str, want: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            series
                .strip_prefix(name)
                .is_some_and(|r| r.starts_with('{'))
                && want.iter().all(|w| series.contains(w))
        })
        .and_then(|(_, v)| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn each_route_reaches_its_upstream_and_a_hung_one_sheds_only_its_own() {
    let _storms = gateway_support::beside_storms().await;
    let default = Upstream::start().await;
    let hung = Upstream::with(Replies::default().delay(Duration::from_secs(120))).await;
    let orders = Upstream::start().await;
    let metrics = common::free_addr();
    let dir = temp_path("upstreams");
    std::fs::create_dir_all(&dir).unwrap();
    let text = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{}\"\nmetrics_listen = \"{metrics}\"\n\
         max_upstream_calls = 4\nqueue_wait = \"50ms\"\n\
         [[upstreams]]\nname = \"slow\"\nurl = \"{}\"\nmax_calls = 4\ntimeout = \"300s\"\n\
         [[upstreams]]\nname = \"orders\"\nurl = \"{}/base\"\n\
         [[route]]\nprefix = \"/api/slow\"\npreset = \"idempotency-key\"\nupstream = \"slow\"\n\
         [[route]]\nprefix = \"/api/orders\"\npreset = \"idempotency-key\"\nupstream = \"orders\"\n\
         [[route]]\nprefix = \"/api/plain\"\npreset = \"idempotency-key\"\n",
        default.url(),
        hung.url(),
        orders.url(),
    );
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    let gw = Proc::start(
        &["--config", dir.join("gateway.toml").to_str().unwrap()],
        &[],
        Stdio::null(),
    );
    let client = client();
    // Two calls hang on the slow upstream (the route's half of its cap of
    // 4); two more are shed by that cap alone.
    let mut hanging = Vec::new();
    for i in 0..2 {
        let (client, addr) = (client.clone(), gw.addr);
        hanging.push(tokio::spawn(async move {
            let key = format!("slow-{i}");
            post(
                &client,
                addr,
                "/api/slow",
                &[("idempotency-key", &key)],
                "{}",
            )
            .await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while hung.calls("/api/slow") < 2 {
        assert!(
            Instant::now() < deadline,
            "the slow upstream never saw both calls"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 2..4 {
        let key = format!("slow-{i}");
        let a = post(
            &client,
            gw.addr,
            "/api/slow",
            &[("idempotency-key", &key)],
            "{}",
        )
        .await;
        assert_eq!(
            a.status,
            503,
            "the slow upstream's cap sheds its own calls: {}",
            a.text()
        );
    }
    // The other upstream's calls all go through, more than the slow one's
    // cap and more than the default's.
    for i in 0..6 {
        let key = format!("order-{i}");
        let a = post(
            &client,
            gw.addr,
            "/api/orders",
            &[("idempotency-key", &key)],
            "{}",
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(
            a.text(),
            format!("upstream call {} for /base/api/orders", i + 1)
        );
    }
    assert_eq!(orders.calls("/base/api/orders"), 6);
    // Routes without an upstream, and unrouted paths, go to the default.
    let a = post(
        &client,
        gw.addr,
        "/api/plain",
        &[("idempotency-key", "p-1")],
        "{}",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let (status, _) = get(gw.addr, "/health");
    assert_eq!(status, 200);
    assert_eq!(default.calls("/api/plain"), 1);
    assert_eq!(default.calls("/health"), 1);
    assert_eq!(hung.total(), 2);
    assert_eq!(orders.total(), 6);
    let (status, ready) = get(metrics, "/readyz");
    assert_eq!(status, 200, "{ready}");
    assert!(ready.starts_with("ready\n"), "{ready}");
    assert!(
        ready.contains(&format!(
            "upstream slow (http://{}): 2 of 4 calls in flight",
            hung.addr
        )),
        "{ready}"
    );
    assert!(ready.contains("upstream orders (http://"), "{ready}");
    assert!(ready.contains("/base): 0 of 4 calls in flight"), "{ready}");
    let (_, text) = get(metrics, "/metrics");
    let shed = sample(
        &text,
        "gateway_upstream_errors_total",
        &["upstream=\"slow\"", "kind=\"shed\""],
    );
    assert_eq!(shed, Some(2.0), "{text}");
    assert!(
        sample(
            &text,
            "gateway_upstream_errors_total",
            &["upstream=\"orders\""]
        )
        .is_none(),
        "{text}"
    );
    for h in hanging {
        h.abort();
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_route_naming_an_unknown_upstream_is_refused_with_its_line() {
    let dir = temp_path("upstreams-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let text = "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9\"\n\
                [[upstreams]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9001\"\n\
                [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\nupstream = \"order\"\n";
    std::fs::write(dir.join("gateway.toml"), text).unwrap();
    let out = Command::new(gateway_bin())
        .arg("--check-config")
        .arg("--config")
        .arg(dir.join("gateway.toml"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("gateway.toml:9: route `/api`: unknown upstream `order`"),
        "{err}"
    );
    let dup = text.replace("upstream = \"order\"", "upstream = \"orders\"")
        + "[[upstreams]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9002\"\n";
    std::fs::write(dir.join("gateway.toml"), dup).unwrap();
    let out = Command::new(gateway_bin())
        .arg("--check-config")
        .arg("--config")
        .arg(dir.join("gateway.toml"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("gateway.toml:11: upstream `orders` is defined twice"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A `ca` file (or `upstream_ca`) whose PEM block is not a certificate
/// trusts nothing: `--check-config` refuses it, naming the file, exit 2.
#[test]
fn a_ca_whose_pem_block_is_not_a_certificate_fails_check_config() {
    use base64::Engine;
    let dir = temp_path("upstreams-ca");
    std::fs::create_dir_all(&dir).unwrap();
    let junk = base64::engine::general_purpose::STANDARD.encode(b"this is no certificate at all");
    let files = [
        (
            "junk.pem",
            format!("-----BEGIN CERTIFICATE-----\n{junk}\n-----END CERTIFICATE-----\n"),
        ),
        (
            "key.pem",
            format!("-----BEGIN PRIVATE KEY-----\n{junk}\n-----END PRIVATE KEY-----\n"),
        ),
    ];
    for (name, pem) in files {
        std::fs::write(dir.join(name), pem).unwrap();
        for text in [
            format!(
                "listen = \"127.0.0.1:0\"\nupstream = \"https://127.0.0.1:9\"\n\
                 [[upstreams]]\nname = \"orders\"\nurl = \"https://127.0.0.1:9001\"\nca = \"{name}\"\n\
                 [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\nupstream = \"orders\"\n"
            ),
            format!(
                "listen = \"127.0.0.1:0\"\nupstream = \"https://127.0.0.1:9\"\n\
                 upstream_ca = \"{}\"\n",
                dir.join(name).display()
            ),
        ] {
            std::fs::write(dir.join("gateway.toml"), &text).unwrap();
            let out = Command::new(gateway_bin())
                .arg("--check-config")
                .arg("--config")
                .arg(dir.join("gateway.toml"))
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{name}: {text}\n{err}");
            assert!(err.contains(name), "{name}: {err}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
