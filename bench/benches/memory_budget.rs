//! Does the memory store's budget bound the process's memory?
//!
//! `cargo bench --bench memory_budget` (Linux: reads `/proc/self/statm`).
//! Not a timed test: it prints numbers.
//!
//! For a small (37-byte, a WeChat Pay success answer) and a large (64 KiB)
//! body, in a fresh child process each, it fills a store of the default
//! budget (256 MiB; `MEMORY_BUDGET_MIB` to change) with twice as many
//! records as fit, through the `Store` API, replays a sample of the newest
//! ones (a replayed record keeps a small shared header), and prints the
//! budget, the resident growth of the process and their ratio, and the
//! store's own measure (`bytes_used`).

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::{
    Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoredResponse,
};
use tower_idempotency::Fingerprint;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn record(body_len: usize, i: usize) -> CompletedRecord {
    let mut headers = HeaderMap::with_capacity(2);
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("content-length", HeaderValue::from(body_len));
    let mut body = vec![b'x'; body_len];
    body[..8.min(body_len)].copy_from_slice(&i.to_be_bytes()[..8.min(body_len)]);
    CompletedRecord::new(
        Fingerprint::of(&i.to_be_bytes()),
        StoredResponse::new(StatusCode::OK, headers, Bytes::from(body)),
    )
}

fn key(i: usize) -> String {
    format!("idem:wechatpay-v3:/notify/wechatpay::{i:08x}-e649-5eec-ab1e-3412bc4d2e17")
}

async fn child(body_len: usize, budget: u64) {
    let store = MemoryStore::builder().max_bytes(budget).build();
    let before = rss_bytes();
    // Twice what the store can hold, by its own measure of one record.
    let fits = {
        let probe = MemoryStore::new();
        let t = OwnerToken::new();
        let rec = record(body_len, 0);
        probe
            .claim(&key(0), rec.fingerprint, t, Duration::from_secs(30))
            .await
            .unwrap();
        probe
            .complete(&key(0), t, Arc::new(rec), Duration::from_secs(90_000))
            .await
            .unwrap();
        budget / probe.bytes_used()
    };
    let n = (2 * fits) as usize;
    for i in 0..n {
        let k = key(i);
        let rec = record(body_len, i);
        let t = OwnerToken::new();
        let c = store
            .claim(&k, rec.fingerprint, t, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(matches!(c, Claim::Acquired(_)));
        store
            .complete(&k, t, Arc::new(rec), Duration::from_secs(90_000))
            .await
            .unwrap();
    }
    // Replay every newest record still held.
    let mut replayed = 0;
    for i in n.saturating_sub(fits as usize)..n {
        let k = key(i);
        if let Claim::Completed(r) = store
            .claim(
                &k,
                Fingerprint::of(b""),
                OwnerToken::new(),
                Duration::from_secs(30),
            )
            .await
            .unwrap()
        {
            replayed += usize::from(!r.response.body.is_empty());
        }
    }
    let growth = rss_bytes().saturating_sub(before);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "{body_len:>6} B | {:>8.1} MiB | {n:>9} | {:>9} | {replayed:>9} | {:>8.1} MiB | {:>8.1} MiB | {:.3}",
        mib(budget),
        store.len(),
        mib(store.bytes_used()),
        mib(growth),
        growth as f64 / budget as f64,
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let budget = std::env::var("MEMORY_BUDGET_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(256)
        << 20;
    if let Some(pos) = args.iter().position(|a| a == "--child") {
        let body_len = args[pos + 1].parse().expect("body length");
        child(body_len, budget).await;
        return;
    }
    println!(
        "  body |     budget |   written |      held |  replayed |  bytes_used | resident growth | growth/budget"
    );
    for body_len in [37usize, 64 * 1024] {
        let exe = std::env::current_exe().expect("own path");
        let status = Command::new(exe)
            .arg("--child")
            .arg(body_len.to_string())
            .status()
            .expect("child");
        assert!(status.success());
    }
}
