//! A WeChat Pay v3 retry storm against a naive "check status, then act"
//! handler, with and without the dedup stack in front of it.
//!
//! With no flags it runs the naive handler alone and then the same handler
//! behind `IdempotencyLayer::wechatpay_v3()`, on the same storm (the same
//! notification ids and nonces), and prints the two side by side: double
//! executions, lost transactions, throughput and latency. A run longer than
//! a few seconds shows a progress line on stderr.
//!
//! ```text
//! cargo run --release --example retry_storm                      # naive handler vs guarded stack
//! cargo run --release --example retry_storm -- --baseline dedup  # with IdempotencyLayer only
//! cargo run --release --example retry_storm -- --baseline none   # the handler alone
//! cargo run --release --example retry_storm -- --baseline axum-idempotent          # the Rust peer
//! cargo run --release --example retry_storm -- --baseline axum-idempotent-nocookie # … as a channel sees it
//! cargo run --release --example retry_storm -- --failure-rate 0.2 --json
//! cargo run --release --example retry_storm -- --baseline dedup --store postgres://me@127.0.0.1:5432/shop --duplicates 1 --repeat
//! ```
//!
//! The upstream keeps an in-memory order table (one `UNPAID` order per
//! notification `id`, standing in for the decrypted `out_trade_no`). Its
//! handler reads the order's status, sleeps `--handler-ms` of simulated
//! work, and then, if the status it read was `UNPAID`, runs `doAfterPay`:
//! it counts one execution for the transaction and sets the order `PAID`.
//! The handler is racy on purpose: concurrent copies of one notification all
//! read `UNPAID` and all run `doAfterPay`, which is the bug this crate exists
//! to prevent. With `--failure-rate F` the handler answers 500 before touching
//! the table, with probability `F` (a deterministic xorshift PRNG seeded by the
//! request counter, so runs are repeatable).
//!
//! The upstream is served over a real loopback hyper server (HTTP/1 and
//! HTTP/2 on `127.0.0.1:0`), either as
//! `ServiceBuilder::new().layer(IdempotencyLayer::wechatpay_v3()).service(handler)`
//! (`--baseline dedup`, the default) or as the bare handler (`--baseline
//! none`), which answers WeChat's `{"code":"SUCCESS","message":"成功"}` itself.
//!
//! For comparison, `--baseline axum-idempotent` serves the same handler in
//! an axum `Router` behind the published Rust peer, [axum-idempotent] 0.6:
//! `IdempotentLayer` inside ruts' `SessionLayer` (an in-memory `MokaStore`)
//! inside tower-cookies' `CookieManagerLayer`, as its README prescribes.
//! axum-idempotent keeps its cache in the client's session, and caches nothing
//! for a request without one, so this mode gives it its best case: the storm
//! client sends one session cookie per transaction, shared by every copy and
//! retry of that notification. ruts accepts any well-formed id a client
//! presents, so the client makes one with `ruts::Id::default()` instead of
//! asking the server first. Its default key hashes the body, which WeChat
//! re-encrypts for every copy (a fresh `nonce` and `ciphertext`), so no two
//! copies would ever share a key; the mode therefore keys on method and path
//! only (`ignore_body(true)`, `ignore_all_headers()`), which within one
//! transaction's session names exactly that transaction. Window 25 h, as the
//! channel presets. `--baseline axum-idempotent-nocookie` is the same stack
//! with no cookie, which is what a payment channel sends: it never returns
//! cookies. (axum-idempotent does not coordinate copies in flight: a cached
//! response only helps copies that arrive after the first one completed.)
//!
//! [axum-idempotent]: https://crates.io/crates/axum-idempotent
//!
//! The storm client behaves like the channel: a pooled hyper-util client
//! sends each transaction's notification `--duplicates` times at once, every
//! copy with a fresh `resource.nonce` (real retries are re-encrypted and
//! re-signed). A copy answered with anything but a 2xx whose body is exactly
//! the success JSON (or not answered within WeChat's 5 s) is retried after
//! 20 ms, up to 15 attempts. At most `--concurrency` transactions are in
//! flight at a time.
//!
//! # Flags
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--transactions N` | 2000 | distinct notifications (orders) |
//! | `--duplicates K` | 7 | copies of each notification sent at the same instant |
//! | `--concurrency C` | 64 | transactions in flight at most |
//! | `--handler-ms MS` | 5 | simulated work between reading and writing the status (0: a bare yield) |
//! | `--failure-rate F` | 0 | probability in `[0, 1]` that one handler call answers 500 |
//! | `--baseline B` | compare (dedup with `--json`) | `compare` (`none`, then `dedup`, side by side), `none` (the handler alone), `dedup` (behind `IdempotencyLayer::wechatpay_v3()`), `axum-idempotent` (behind axum-idempotent 0.6, one session cookie per transaction) or `axum-idempotent-nocookie` (the same, no cookie) |
//! | `--store S` | memory | `memory`, `redis://HOST:PORT`, `redis+cluster://HOST:PORT[,HOST:PORT...]`, a SQL database (`postgres://USER@HOST:PORT/DB`, `mysql://USER@HOST:PORT/DB`, `sqlite:PATH`; the table is created on connect) or Redis in front of one (`tiered:redis://HOST:PORT+postgres://…`: `TieredStore`; the SQL URL starts at the first `+` followed by its scheme) (`dedup` and `compare` only; the axum-idempotent modes keep their sessions in memory) |
//! | `--scenario burst\|double-submit` | burst | a channel's storm (copies at once, WeChat Pay v3), or a client's double click (copies of one request with `Idempotency-Key` spread over 100 ms, route `/orders`) |
//! | `--scenario outage` | | the storm after an outage: `--transactions` (default 600) distinct WeChat Pay v3 notifications x `--duplicates` (default 3) copies released at once against a fragile upstream (50 ms calls; above 20 at once every extra call hangs 3 s, then 503), through the library's `Gateway`, with no limit and then with `--limit` upstream calls at once, then acknowledging first and delivering `--limit` at once from the embedded queue; with `--store redis://HOST:PORT`, one more row: `--instances` (default 3 here) gateways on one Redis Streams queue sharing the limit and the breaker; the client retries each copy every second until acknowledged (120 s at most) |
//! | `--limit N` | 20 | the outage scenario's `CallLimit` in its shed mode |
//! | `--instances N` | 1 | independent stacks (each on its own server) sharing the store; copies and retries spread over them |
//! | `--repeat` | off | after the storm, send every notification once more (one copy, fresh nonces): each is a replay of its completed record; measured and printed apart (not with `--scenario outage`) |
//! | `--json` | off | also print one JSON object as the last line |
//!
//! # Output
//!
//! For one system a table of metrics, for `compare` the two systems side by
//! side. With `--json`, the output ends with one JSON line per system run
//! (`compare`: the naive handler's, then the guarded stack's, so the last
//! line is always the guarded stack's when it ran), with the keys `requests`,
//! `transactions`, `handler_executions`, `duplicate_executions`, `lost`,
//! `throughput_rps`, `p50_ms`, `p99_ms`, `max_ms` and `peak_rss_mb`.
//! With `--repeat`, each system's line is followed by its repeat pass's,
//! which has `"phase":"repeat"` besides.
//!
//! - `requests`: HTTP requests sent, retries included.
//! - `handler_executions`: `doAfterPay` runs over all transactions.
//! - `duplicate_executions`: the sum over transactions of `executions - 1`
//!   where a transaction ran more than once. With the dedup stack it must be 0.
//! - `lost`: transactions that no copy ever saw acknowledged with success, or
//!   whose `doAfterPay` never ran. With the dedup stack it must be 0.
//! - latencies are per HTTP request; `peak_rss_mb` is `VmHWM` from
//!   `/proc/self/status` (0 where that file does not exist): the process's
//!   peak so far, so under `compare` the guarded stack's figure covers both
//!   runs.
//!
//! Bad flags print a message to stderr and exit with status 2.

mod args;
mod client;
mod outage;
mod progress;
mod report;
mod run;
mod server;
mod upstream;

use std::process::ExitCode;

use args::{parse_args, Args, Baseline, Parsed, USAGE};
use report::{json_line, print_repeat_side_by_side, print_side_by_side, print_table, Summary};

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Parsed::Run(args)) => args,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("retry_storm: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match storm(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retry_storm: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs what `args` asks for and prints the results.
async fn storm(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    // One seed for the run: under `compare` both systems get the same storm.
    let run_seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x5eed, |d| d.as_nanos() as u64);
    if args.scenario == args::Scenario::Outage {
        return outage::run(args).await;
    }
    let summaries: Vec<Summary> = if args.compare {
        let (naive, naive_again) =
            run::run(args, Baseline::None, run_seed, "naive handler").await?;
        let (guarded, guarded_again) =
            run::run(args, Baseline::Dedup, run_seed, "guarded stack").await?;
        print_side_by_side(args, &naive, &guarded);
        let mut all = vec![naive];
        all.extend(naive_again.inspect(|naive| {
            if let Some(guarded) = &guarded_again {
                println!("\nthen every notification once more (--repeat):\n");
                print_repeat_side_by_side(naive, guarded);
            }
        }));
        all.push(guarded);
        all.extend(guarded_again);
        all
    } else {
        let (summary, again) =
            run::run(args, args.baseline, run_seed, args.baseline.name()).await?;
        print_table(args, &summary);
        let mut all = vec![summary];
        if let Some(again) = again {
            println!("\nthen every notification once more (--repeat):");
            print_table(args, &again);
            all.push(again);
        }
        all
    };
    if args.json {
        for summary in &summaries {
            println!("{}", json_line(summary));
        }
    }
    Ok(())
}
