//! One system under one storm: serve it, send the storm, count.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::args::{Args, Baseline};
use crate::client::{notification_id, storm, HttpClient, TxReport};
use crate::progress::Progress;
use crate::report::{peak_rss_mb, percentile_ms, Summary};
use crate::server::{serve_baseline, SESSION_COOKIE};
use crate::upstream::{Handler, Upstream};

/// The client's view of the storm so far.
#[derive(Debug)]
struct Tally {
    /// Per transaction: whether any copy was acknowledged with success.
    acked: Vec<bool>,
    /// Latency of every HTTP request sent.
    latencies: Vec<Duration>,
    /// Copies that used up every attempt.
    gave_up_copies: usize,
}

impl Tally {
    fn add(&mut self, (i, report): (usize, TxReport)) {
        self.acked[i] = report.acked;
        self.gave_up_copies += report.gave_up;
        self.latencies.extend(report.latencies);
    }
}

/// The servers and the client of one system's runs.
struct Target {
    uris: Arc<[http::Uri]>,
    client: HttpClient,
}

/// Runs the storm of `args` (its notification ids and nonces drawn from
/// `run_seed`) against `baseline` and sums up what the client and the
/// upstream saw; with `--repeat`, then every notification once more (one
/// copy, fresh nonces), summed up apart. `label` names the run on the
/// progress line.
pub(crate) async fn run(
    args: &Args,
    baseline: Baseline,
    run_seed: u64,
    label: &'static str,
) -> Result<(Summary, Option<Summary>), Box<dyn std::error::Error>> {
    let ids: Vec<String> = (0..args.transactions)
        .map(|i| notification_id(run_seed, i))
        .collect();
    let upstream = Arc::new(Upstream::new(&ids, args.handler_ms, args.failure_rate));
    let handler = Handler(upstream.clone());

    let addrs = serve_baseline(
        baseline,
        &args.store,
        &handler,
        args.instances,
        args.scenario,
    )
    .await?;
    let path = args.scenario.path();
    let uris: Arc<[http::Uri]> = addrs
        .iter()
        .map(|addr| format!("http://{addr}{path}").parse())
        .collect::<Result<Vec<_>, _>>()?
        .into();

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    let target = Target { uris, client };
    let before = vec![0; ids.len()];
    let (tally, elapsed) = pass(
        args,
        baseline,
        &target,
        &ids,
        args.duplicates,
        run_seed,
        label,
    )
    .await?;
    let storm = summary(tally, elapsed, &ids, &upstream, &before, false);
    if !args.repeat {
        return Ok((storm, None));
    }
    let before: Vec<u32> = ids.iter().map(|id| upstream.executions(id)).collect();
    // Other nonces than the storm's copies: a channel's retry is re-encrypted.
    let seed = run_seed.rotate_left(17) ^ 0xA5A5_5A5A;
    let (tally, elapsed) = pass(args, baseline, &target, &ids, 1, seed, "repeat").await?;
    let repeat = summary(tally, elapsed, &ids, &upstream, &before, true);
    Ok((storm, Some(repeat)))
}

/// Sends each of `ids` `duplicates` times at once, at most
/// `--concurrency` transactions in flight.
async fn pass(
    args: &Args,
    baseline: Baseline,
    target: &Target,
    ids: &[String],
    duplicates: usize,
    run_seed: u64,
    label: &'static str,
) -> Result<(Tally, Duration), Box<dyn std::error::Error>> {
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut transactions = JoinSet::new();
    let mut tally = Tally {
        acked: vec![false; ids.len()],
        latencies: Vec::with_capacity(ids.len().saturating_mul(duplicates).min(1 << 20)),
        gave_up_copies: 0,
    };
    let progress = Progress::start(label, ids.len());
    let finished = progress.counter();
    let start = Instant::now();
    for (i, id) in ids.iter().enumerate() {
        let permit = permits.clone().acquire_owned().await?;
        // axum-idempotent's best case: a fresh, well-formed session id per
        // transaction, which ruts accepts as a (new) session.
        let cookie = match baseline {
            Baseline::AxumIdempotent => Some(http::HeaderValue::from_str(&format!(
                "{SESSION_COOKIE}={}",
                ruts::Id::default()
            ))?),
            _ => None,
        };
        let fut = storm(
            target.client.clone(),
            target.uris.clone(),
            Arc::from(id.as_str()),
            duplicates,
            run_seed ^ (i as u64).wrapping_mul(0x9E37_79B9),
            cookie,
            args.scenario,
        );
        let finished = finished.clone();
        transactions.spawn(async move {
            let report = fut.await;
            drop(permit);
            finished.fetch_add(1, Ordering::Relaxed);
            (i, report)
        });
        // Collect finished transactions as we go, so their results do not
        // pile up in the join set.
        while let Some(done) = transactions.try_join_next() {
            tally.add(done?);
        }
    }
    while let Some(done) = transactions.join_next().await {
        tally.add(done?);
    }
    let elapsed = start.elapsed();
    progress.finish();
    Ok((tally, elapsed))
}

/// What one pass did: `before` holds each transaction's executions before
/// it (a transaction that had run and runs again is a duplicate).
fn summary(
    tally: Tally,
    elapsed: Duration,
    ids: &[String],
    upstream: &Upstream,
    before: &[u32],
    repeat: bool,
) -> Summary {
    let Tally {
        acked,
        mut latencies,
        gave_up_copies,
    } = tally;
    let mut handler_executions = 0u64;
    let mut duplicate_executions = 0u64;
    let mut lost = 0usize;
    for ((id, acked), before) in ids.iter().zip(&acked).zip(before) {
        let total = upstream.executions(id);
        let executions = total.saturating_sub(*before);
        handler_executions += u64::from(executions);
        duplicate_executions += u64::from(total.saturating_sub(1) - before.saturating_sub(1));
        if !acked || total == 0 {
            lost += 1;
        }
    }

    latencies.sort_unstable();
    let requests = latencies.len();
    Summary {
        requests,
        transactions: ids.len(),
        handler_executions,
        duplicate_executions,
        lost,
        gave_up_copies,
        elapsed,
        throughput_rps: requests as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
        p50_ms: percentile_ms(&latencies, 0.50),
        p99_ms: percentile_ms(&latencies, 0.99),
        max_ms: latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        peak_rss_mb: peak_rss_mb(),
        repeat,
    }
}
