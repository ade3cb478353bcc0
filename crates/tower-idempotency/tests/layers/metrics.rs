//! Every outcome is counted by preset through the `metrics` facade, and
//! every request is a trace: its spans (exported through OpenTelemetry)
//! carry the preset, the key's hash and the outcome, never the key, and the
//! upstream gets the trace's `traceparent`.
#![cfg(feature = "metrics")]

use test_support::common;

use bytes::Bytes;
use common::request;
use http::Response;
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::collections::HashMap;
use std::convert::Infallible;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::IdempotencyLayer;

#[test]
fn outcomes_and_store_latency_are_recorded_by_preset() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let svc = ServiceBuilder::new()
                .layer(IdempotencyLayer::stripe())
                .service(service_fn(|_req| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }));
            let paid = r#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
            let other = r#"{"id":"evt_1","type":"charge.refunded"}"#;
            for body in [paid, paid, paid, other, "{}"] {
                svc.clone()
                    .oneshot(request("/stripe", &[], body))
                    .await
                    .unwrap();
            }
        })
    });
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut latency_samples = 0;
    let mut timed_ops = std::collections::BTreeSet::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        match (key.name(), value) {
            ("idempotency_requests_total", DebugValue::Counter(n)) => {
                let labels: HashMap<_, _> = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                assert_eq!(labels["preset"], "stripe");
                *counts.entry(labels["outcome"].clone()).or_default() += n;
            }
            ("idempotency_store_seconds", DebugValue::Histogram(v)) => {
                latency_samples += v.len();
                timed_ops.extend(key.labels().map(|l| l.value().to_owned()));
            }
            _ => {}
        }
    }
    assert_eq!(counts.get("executed"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("replayed"), Some(&2), "{counts:?}");
    assert_eq!(counts.get("mismatch"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("key_missing"), Some(&1), "{counts:?}");
    assert!(
        latency_samples >= 5,
        "store calls are timed: {latency_samples}"
    );
    assert!(
        timed_ops.contains("claim") && timed_ops.contains("complete"),
        "{timed_ops:?}"
    );
}
