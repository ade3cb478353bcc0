//! Memory per completed record in the memory store, and its behaviour at
//! capacity.
//!
//! `cargo bench --bench record_size` (Linux: reads `/proc/self/statm`).
//!
//! Writes N records through the `Store` API (claim, then complete, as the
//! dedup layer does) with a typical stored response (status, two headers, the
//! 43-byte WeChat success body), measures the resident set before and after,
//! and prints the bytes each record costs beyond its body. Then fills a small
//! store past its capacity and prints the evictions it counted.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_idempotency::store::{
    Claim, CompletedRecord, MemoryStore, OwnerToken, Store, StoredResponse,
};
use tower_idempotency::Fingerprint;

const BODY: &str = r#"{"code":"SUCCESS","message":"成功"}"#;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn record() -> CompletedRecord {
    // Sized exactly, as the dedup layer stores a response's headers.
    let mut headers = HeaderMap::with_capacity(2);
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("content-length", HeaderValue::from_static("43"));
    CompletedRecord::new(
        Fingerprint::of(b"TRANSACTION.SUCCESS"),
        StoredResponse::new(StatusCode::OK, headers, Bytes::from_static(BODY.as_bytes())),
    )
}

/// A key as the layer builds it for a WeChat Pay v3 notification.
fn key(i: usize) -> String {
    format!("idem:wechatpay-v3:/notify/wechatpay::{i:08x}-e649-5eec-ab1e-3412bc4d2e17")
}

async fn fill(store: &MemoryStore, from: usize, n: usize, distinct_bodies: bool) {
    let shared = Arc::new(record());
    for i in from..from + n {
        let k = key(i);
        let token = OwnerToken::new();
        let claim = store
            .claim(&k, shared.fingerprint, token, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Acquired(_)));
        // Each real record is its own allocation with its own body copy.
        let rec = if distinct_bodies {
            let mut r = record();
            r.response.body = Bytes::copy_from_slice(BODY.as_bytes());
            Arc::new(r)
        } else {
            shared.clone()
        };
        store
            .complete(&k, token, rec, Duration::from_secs(25 * 3600))
            .await
            .unwrap();
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // Criterion-style flags (e.g. --bench) are accepted and ignored.
    const N: usize = 1_000_000;
    let store = MemoryStore::builder().max_bytes(u64::MAX / 2).build();
    let before = rss_bytes();
    let start = Instant::now();
    fill(&store, 0, N, true).await;
    let elapsed = start.elapsed();
    let after = rss_bytes();
    let per_record = (after.saturating_sub(before)) as f64 / N as f64;
    println!("records:                      {N}");
    println!(
        "claim+complete:               {:.0} ns/record",
        elapsed.as_nanos() as f64 / N as f64
    );
    println!(
        "resident growth:              {:.1} MiB",
        (after - before) as f64 / (1 << 20) as f64
    );
    println!("bytes per record:             {per_record:.0}");
    println!("  of which body:              {}", BODY.len());
    println!(
        "  beyond the body:            {:.0}",
        per_record - BODY.len() as f64
    );
    println!("held (len):                   {}", store.len());
    println!(
        "store's own measure:          {:.0} bytes per record",
        store.bytes_used() as f64 / store.len() as f64
    );

    // At capacity: 4 MiB for records of about 450 weighed bytes each.
    let small = MemoryStore::builder().max_bytes(4 << 20).build();
    fill(&small, 0, 100_000, false).await;
    println!(
        "capacity 4 MiB, 100,000 writes: held {}, evicted early {}, bytes used {}",
        small.len(),
        small.evicted_early(),
        small.bytes_used()
    );
}
