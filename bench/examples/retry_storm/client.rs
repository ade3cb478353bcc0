//! The storm client: a pooled hyper-util client that delivers every copy
//! of a transaction as a channel (or a double-clicking shopper) would.

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

use crate::args::Scenario;
use crate::upstream::{xorshift, SUCCESS_BODY};

/// Attempts per delivered copy (WeChat's schedule has 15 retries).
const MAX_ATTEMPTS: u32 = 15;
/// Pause between two attempts of one copy (WeChat's is 15 s and up).
const BACKOFF: Duration = Duration::from_millis(20);
/// How long the channel waits for an answer.
const CHANNEL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The notification id of transaction `i`, shaped like WeChat's UUIDs.
pub(crate) fn notification_id(run: u64, i: usize) -> String {
    format!(
        "{:08x}-{:04x}-5eec-ab1e-{:012x}",
        run as u32,
        (run >> 32) as u16,
        i
    )
}

/// One delivery of the notification `id`: same business fields, a fresh
/// nonce and ciphertext every time, as WeChat re-encrypts each retry.
/// (`id` is hex and dashes, so it needs no JSON escaping.)
fn notification(id: &str, nonce: u64) -> Bytes {
    let ciphertext = format!("{:016x}{:016x}", xorshift(nonce), xorshift(!nonce));
    let nonce = format!("{:012x}", nonce & 0xFFFF_FFFF_FFFF);
    Bytes::from(format!(
        concat!(
            r#"{{"id":"{id}","create_time":"2021-06-24T16:37:26+08:00","#,
            r#""resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS","#,
            r#""summary":"支付成功","resource":{{"original_type":"transaction","#,
            r#""algorithm":"AEAD_AES_256_GCM","ciphertext":"{ciphertext}","#,
            r#""associated_data":"transaction","nonce":"{nonce}"}}}}"#,
        ),
        id = id,
        ciphertext = ciphertext,
        nonce = nonce,
    ))
}

/// What one transaction's storm produced.
#[derive(Debug, Default)]
pub(crate) struct TxReport {
    /// At least one copy was acknowledged with the success reply.
    pub(crate) acked: bool,
    /// Copies that used up every attempt without a success reply.
    pub(crate) gave_up: usize,
    /// Latency of every HTTP request sent for this transaction.
    pub(crate) latencies: Vec<Duration>,
}

/// Sends one copy until it is acknowledged or out of attempts, with
/// `cookie` (if any) on every attempt. Returns whether it was acknowledged
/// and the latency of each attempt.
async fn deliver(
    client: HttpClient,
    uris: Arc<[http::Uri]>,
    first: usize,
    id: Arc<str>,
    seed: u64,
    cookie: Option<http::HeaderValue>,
    scenario: Scenario,
) -> (bool, Vec<Duration>) {
    let mut latencies = Vec::with_capacity(1);
    for attempt in 0..MAX_ATTEMPTS {
        // Each retry may land on another instance, as behind a load balancer.
        let uri = &uris[(first + attempt as usize) % uris.len()];
        let mut req =
            Request::post(uri.clone()).header(http::header::CONTENT_TYPE, "application/json");
        let body = match scenario {
            Scenario::Burst | Scenario::Outage => {
                req = req.header(
                    "wechatpay-serial",
                    "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
                );
                notification(&id, seed.wrapping_add(u64::from(attempt)))
            }
            // A client resends the same bytes under the same key.
            Scenario::DoubleSubmit => {
                req = req
                    .header("idempotency-key", &*id)
                    .header(http::header::AUTHORIZATION, "Bearer shopper");
                Bytes::from(format!(r#"{{"id":"{id}","sku":"tea","qty":1}}"#))
            }
        };
        if let Some(cookie) = &cookie {
            req = req.header(http::header::COOKIE, cookie.clone());
        }
        let req = req.body(Full::new(body));
        let Ok(req) = req else {
            return (false, latencies);
        };
        let start = Instant::now();
        let answer = tokio::time::timeout(CHANNEL_TIMEOUT, async {
            let res = client.request(req).await.ok()?;
            let ok = res.status().is_success();
            let body = res.into_body().collect().await.ok()?.to_bytes();
            Some(ok && body == SUCCESS_BODY.as_bytes())
        })
        .await;
        latencies.push(start.elapsed());
        if let Ok(Some(true)) = answer {
            return (true, latencies);
        }
        tokio::time::sleep(BACKOFF).await;
    }
    (false, latencies)
}

/// Sends `duplicates` copies of transaction `id` at once, all with `cookie`
/// (if any).
pub(crate) async fn storm(
    client: HttpClient,
    uris: Arc<[http::Uri]>,
    id: Arc<str>,
    duplicates: usize,
    seed: u64,
    cookie: Option<http::HeaderValue>,
    scenario: Scenario,
) -> TxReport {
    let mut copies = JoinSet::new();
    for copy in 0..duplicates {
        let seed = xorshift(seed ^ ((copy as u64) << 48));
        // Copies spread over the instances.
        let first = copy + (seed as usize % uris.len());
        let deliver = deliver(
            client.clone(),
            uris.clone(),
            first,
            id.clone(),
            seed,
            cookie.clone(),
            scenario,
        );
        // Double clicks: the copies spread evenly over 100 ms.
        let delay = match scenario {
            Scenario::Burst | Scenario::Outage => Duration::ZERO,
            Scenario::DoubleSubmit => {
                Duration::from_millis(100) * copy as u32 / (duplicates.max(2) - 1) as u32
            }
        };
        copies.spawn(async move {
            tokio::time::sleep(delay).await;
            deliver.await
        });
    }
    let mut report = TxReport::default();
    while let Some(done) = copies.join_next().await {
        match done {
            Ok((acked, latencies)) => {
                report.acked |= acked;
                report.gave_up += usize::from(!acked);
                report.latencies.extend(latencies);
            }
            Err(_) => report.gave_up += 1,
        }
    }
    report
}
