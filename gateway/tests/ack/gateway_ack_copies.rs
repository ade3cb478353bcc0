//! Copies of one notification with other payloads on two gateways sharing
//! one Redis (store and Streams queue), each a real process: a forged copy
//! whose call is still running on one instance keeps the genuine copy
//! waiting on the other, never dead-letters it.

use crate::gateway_support;
use test_support::common;
use test_support::support_redis;

use common::upstream::{Replies, Upstream};
use common::vectors::{fixture, ALIPAY_FAIL, ALIPAY_SUCCESS};
use common::{client, free_addr, post};
use gateway_support::{gateway_bin, get, Gateway};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

const ALIPAY_BODY: &str = "alipay_notify_trade_status_sync_alipay-sdk-nodejs-all.form";
const FORM: [(&str, &str); 1] = [("content-type", "application/x-www-form-urlencoded")];
/// The forged copies' header: the recording upstream waits this long
/// before it answers.
const SLOW: (&str, &str) = ("x-delay-ms", "6000");

/// The Alipay fixture as notification `n`, with `total_amount` `amount`.
fn alipay(n: usize, amount: &str) -> String {
    let form = String::from_utf8(fixture(ALIPAY_BODY).to_vec()).unwrap();
    form.replace("total_amount=0.10", &format!("total_amount={amount}"))
        .replace(
            "notify_id=2019081500222155624068450559358070",
            &format!("notify_id=20190815002221556240684505593{n:05}"),
        )
}

/// The upstream: a forged copy (amount 999.00) fails with 503 (after its
/// own `x-delay-ms`), a genuine one gets 200.
async fn upstream() -> Upstream {
    Upstream::with(Replies::default().status(|seen| {
        if String::from_utf8_lossy(&seen.body).contains("total_amount=999.00") {
            503
        } else {
            200
        }
    }))
    .await
}

/// How many times the upstream answered 200 to notification `n`.
fn delivered(up: &Upstream, n: usize) -> usize {
    let id = format!("notify_id=20190815002221556240684505593{n:05}");
    up.seen()
        .iter()
        .filter(|s| s.status == 200 && String::from_utf8_lossy(&s.body).contains(&id))
        .count()
}

/// `name{queue="gateway"} VALUE` of `/metrics`.
fn gauge(metrics: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = get(metrics, "/metrics");
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("queue=\"gateway\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genuine_copy_meeting_a_forged_one_in_flight_on_another_gateway_is_delivered() {
    let _beside = gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        return;
    }
    let redis = support_redis::RedisServer::start();
    let up = upstream().await;
    let url = redis.url();
    let (ma, mb) = (free_addr().to_string(), free_addr().to_string());
    let gw = |metrics: &str| {
        Gateway::start(
            &up.url(),
            &[
                "--store",
                &url,
                "--queue",
                &url,
                "--queue-secret-file",
                crate::gateway_support::queue_secret(),
                "--route",
                "/ali=alipay",
                "--ack-then-deliver",
                "/ali",
                "--retry-backoff",
                "200ms",
                "--metrics-listen",
                metrics,
            ],
        )
    };
    let a = gw(&ma);
    const N: usize = 6;
    let http = client();
    for n in 0..N {
        let forged = [FORM[0], SLOW];
        let got = post(&http, a.addr, "/ali/notify", &forged, alipay(n, "999.00")).await;
        assert_eq!(got.text(), ALIPAY_SUCCESS, "the forged copy {n} is queued");
    }
    // Every forged copy's call is under way on A (each takes 6 s).
    let start = Instant::now();
    while up.total() < N {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the forged copies were never delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // They stay in flight while A is stopped; B, on the same Redis,
    // delivers the genuine copies meanwhile.
    let b = gw(&mb);
    a.signal(libc::SIGSTOP);
    for n in 0..N {
        let got = post(&http, b.addr, "/ali/notify", &FORM, alipay(n, "0.10")).await;
        assert_eq!(got.text(), ALIPAY_SUCCESS, "the genuine copy {n} is queued");
    }
    // B tries them meanwhile (its backoff is 200 ms).
    tokio::time::sleep(Duration::from_secs(2)).await;
    a.signal(libc::SIGCONT);
    // Every genuine copy reaches the upstream, once; none is dead-lettered
    // for meeting the forged one in flight.
    let start = Instant::now();
    loop {
        let missing: Vec<usize> = (0..N).filter(|n| delivered(&up, *n) == 0).collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "genuine copies never delivered: {missing:?}\nA: {}\nB: {}",
            a.log(),
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The forged copies end as dead letters (the key is done with the
    // genuine payload), and nothing more.
    let (ma, mb): (SocketAddr, SocketAddr) = (ma.parse().unwrap(), mb.parse().unwrap());
    let start = Instant::now();
    while gauge(ma, "idempotency_queue_dead_letters") != Some(N as f64)
        || gauge(mb, "idempotency_queue_dead_letters") != Some(N as f64)
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "dead letters: A {:?}, B {:?}",
            gauge(ma, "idempotency_queue_dead_letters"),
            gauge(mb, "idempotency_queue_dead_letters")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for n in 0..N {
        assert_eq!(delivered(&up, n), 1, "notification {n} delivered once");
    }
    // Each dead letter is a forged copy: the first of its key (the genuine
    // ones were queued beside them, as `KEY~copy1`).
    let out = Command::new(gateway_bin())
        .args([
            "dlq",
            "--offline",
            "list",
            "--queue",
            &url,
            "--queue-secret-file",
            crate::gateway_support::queue_secret(),
        ])
        .output()
        .unwrap();
    let listed = String::from_utf8(out.stdout).unwrap();
    let genuine: Vec<&str> = listed.lines().filter(|l| l.contains("~copy")).collect();
    assert!(
        genuine.is_empty(),
        "genuine copies dead-lettered: {genuine:#?}"
    );
    assert_eq!(listed.lines().count(), N, "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genuine_copy_meeting_a_forged_one_in_flight_on_a_synchronous_route_gets_the_failure_reply()
{
    let _beside = gateway_support::beside_storms().await;
    if !support_redis::redis_available() {
        return;
    }
    let redis = support_redis::RedisServer::start();
    let up = upstream().await;
    let url = redis.url();
    let args = ["--store", url.as_str(), "--route", "/ali=alipay"];
    let (a, b) = (
        Gateway::start(&up.url(), &args),
        Gateway::start(&up.url(), &args),
    );
    let forged = tokio::spawn({
        let addr = a.addr;
        async move {
            let headers = [FORM[0], SLOW];
            post(
                &client(),
                addr,
                "/ali/notify",
                &headers,
                alipay(0, "999.00"),
            )
            .await
        }
    });
    up.wait_for_call("/ali/notify").await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The genuine copy meets the forged one in flight: Alipay's failure
    // reply, so that Alipay sends it again.
    let got = post(&client(), b.addr, "/ali/notify", &FORM, alipay(0, "0.10")).await;
    assert_eq!(got.text(), ALIPAY_FAIL);
    assert_eq!(forged.await.unwrap().text(), ALIPAY_FAIL);
    // The forged call failed: Alipay's next try is delivered.
    let got = post(&client(), b.addr, "/ali/notify", &FORM, alipay(0, "0.10")).await;
    assert_eq!(got.text(), ALIPAY_SUCCESS);
    assert_eq!(delivered(&up, 0), 1);
}
