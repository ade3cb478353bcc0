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

/// Runs the storm of `args` (its notification ids and nonces drawn from
/// `run_seed`) against `baseline` and sums up what the client and the
/// upstream saw. `label` names the run on the progress line.
pub(crate) async fn run(
    args: &Args,
    baseline: Baseline,
    run_seed: u64,
    label: &'static str,
) -> Result<Summary, Box<dyn std::error::Error>> {
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

    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut transactions = JoinSet::new();
    let mut tally = Tally {
        acked: vec![false; ids.len()],
        latencies: Vec::with_capacity(ids.len().saturating_mul(args.duplicates).min(1 << 20)),
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
            client.clone(),
            uris.clone(),
            Arc::from(id.as_str()),
            args.duplicates,
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
    let Tally {
        acked,
        mut latencies,
        gave_up_copies,
    } = tally;
    let elapsed = start.elapsed();
    progress.finish();

    let mut handler_executions = 0u64;
    let mut duplicate_executions = 0u64;
    let mut lost = 0usize;
    for (id, acked) in ids.iter().zip(&acked) {
        let executions = upstream.executions(id);
        handler_executions += u64::from(executions);
        duplicate_executions += u64::from(executions.saturating_sub(1));
        if !acked || executions == 0 {
            lost += 1;
        }
    }

    latencies.sort_unstable();
    let requests = latencies.len();
    Ok(Summary {
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
    })
}
