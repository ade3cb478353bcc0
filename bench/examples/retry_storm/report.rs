//! The results: one system's table, two systems side by side, the JSON
//! line.

use std::time::Duration;

use crate::args::Args;

/// One system's results under one storm.
#[derive(Debug)]
pub(crate) struct Summary {
    pub(crate) requests: usize,
    pub(crate) transactions: usize,
    pub(crate) handler_executions: u64,
    pub(crate) duplicate_executions: u64,
    pub(crate) lost: usize,
    pub(crate) gave_up_copies: usize,
    pub(crate) elapsed: Duration,
    pub(crate) throughput_rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) peak_rss_mb: f64,
    /// The `--repeat` pass (every notification once more), not the storm.
    pub(crate) repeat: bool,
}

pub(crate) fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

/// Peak resident set size (`VmHWM`) in MiB, or 0 where unknown.
pub(crate) fn peak_rss_mb() -> f64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0.0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// One line of the side-by-side table: its label and how to read it off a summary.
type Row = (&'static str, fn(&Summary) -> String);
fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// One system's results as a table of metrics.
pub(crate) fn print_table(args: &Args, s: &Summary) {
    println!(
        "retry storm: baseline={} transactions={} duplicates={} concurrency={} handler_ms={} failure_rate={}",
        args.baseline.name(),
        args.transactions,
        args.duplicates,
        args.concurrency,
        args.handler_ms,
        args.failure_rate
    );
    let rows: [(&str, String); 12] = [
        ("requests", s.requests.to_string()),
        ("transactions", s.transactions.to_string()),
        ("handler_executions", s.handler_executions.to_string()),
        ("duplicate_executions", s.duplicate_executions.to_string()),
        ("lost", s.lost.to_string()),
        ("copies_given_up", s.gave_up_copies.to_string()),
        ("elapsed_s", format!("{:.3}", s.elapsed.as_secs_f64())),
        ("throughput_rps", format!("{:.1}", s.throughput_rps)),
        ("p50_ms", format!("{:.3}", s.p50_ms)),
        ("p99_ms", format!("{:.3}", s.p99_ms)),
        ("max_ms", format!("{:.3}", s.max_ms)),
        ("peak_rss_mb", format!("{:.1}", s.peak_rss_mb)),
    ];
    println!("  {:<22} {:>14}", "metric", "value");
    println!("  {:-<22} {:->14}", "", "");
    for (name, value) in rows {
        println!("  {name:<22} {value:>14}");
    }
}

/// The naive handler and the guarded stack under the same storm, side by
/// side, for people.
pub(crate) fn print_side_by_side(args: &Args, naive: &Summary, guarded: &Summary) {
    println!(
        "retry storm: {} {} ({}), each sent {} times; {} in flight at most, {} ms of work per call{}",
        args.transactions,
        args.scenario.describe(),
        args.scenario.path(),
        args.duplicates,
        args.concurrency,
        args.handler_ms,
        if args.failure_rate > 0.0 {
            format!(", {} of calls fail", args.failure_rate)
        } else {
            String::new()
        },
    );
    println!();
    let rows: [Row; 8] = [
        ("double executions", |s| s.duplicate_executions.to_string()),
        ("lost", |s| s.lost.to_string()),
        ("handler executions", |s| s.handler_executions.to_string()),
        ("requests", |s| s.requests.to_string()),
        ("throughput (req/s)", |s| format!("{:.0}", s.throughput_rps)),
        ("p50 latency (ms)", |s| format!("{:.1}", s.p50_ms)),
        ("p99 latency (ms)", |s| format!("{:.1}", s.p99_ms)),
        ("elapsed (s)", |s| format!("{:.2}", s.elapsed.as_secs_f64())),
    ];
    println!(
        "  {:<20} {:>15} {:>15}",
        "", "naive handler", "guarded stack"
    );
    println!("  {:-<20} {:->15} {:->15}", "", "", "");
    for (name, value) in rows {
        println!("  {name:<20} {:>15} {:>15}", value(naive), value(guarded));
    }
    println!();
    println!(
        "  naive handler: reads the order's status, works, then runs doAfterPay if it read UNPAID;\n  \
         copies that arrive together all read UNPAID, so the business logic runs more than once."
    );
    println!(
        "  guarded stack: the same handler behind IdempotencyLayer ({} store): one copy runs it,\n  \
         the others wait and get its reply; \"double executions\" and \"lost\" must both be 0.",
        args.store.describe()
    );
}

/// The `--repeat` passes of the naive handler and the guarded stack, side
/// by side.
pub(crate) fn print_repeat_side_by_side(naive: &Summary, guarded: &Summary) {
    let rows: [Row; 6] = [
        ("double executions", |s| s.duplicate_executions.to_string()),
        ("handler executions", |s| s.handler_executions.to_string()),
        ("throughput (req/s)", |s| format!("{:.0}", s.throughput_rps)),
        ("p50 latency (ms)", |s| format!("{:.1}", s.p50_ms)),
        ("p99 latency (ms)", |s| format!("{:.1}", s.p99_ms)),
        ("elapsed (s)", |s| format!("{:.2}", s.elapsed.as_secs_f64())),
    ];
    println!(
        "  {:<20} {:>15} {:>15}",
        "", "naive handler", "guarded stack"
    );
    println!("  {:-<20} {:->15} {:->15}", "", "", "");
    for (name, value) in rows {
        println!("  {name:<20} {:>15} {:>15}", value(naive), value(guarded));
    }
}

/// `s` as one JSON object, the keys documented in the example's docs (and
/// `"phase":"repeat"` on a `--repeat` pass's).
pub(crate) fn json_line(s: &Summary) -> serde_json::Value {
    let mut line = json_fields(s);
    if s.repeat {
        line["phase"] = "repeat".into();
    }
    line
}

fn json_fields(s: &Summary) -> serde_json::Value {
    serde_json::json!({
        "requests": s.requests,
        "transactions": s.transactions,
        "handler_executions": s.handler_executions,
        "duplicate_executions": s.duplicate_executions,
        "lost": s.lost,
        "throughput_rps": round3(s.throughput_rps),
        "p50_ms": round3(s.p50_ms),
        "p99_ms": round3(s.p99_ms),
        "max_ms": round3(s.max_ms),
        "peak_rss_mb": round3(s.peak_rss_mb),
    })
}
