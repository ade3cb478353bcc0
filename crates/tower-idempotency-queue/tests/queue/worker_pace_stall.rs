//! Shared pacing that stalls (its store stops answering) neither keeps a
//! running delivery's entry from being renewed nor stops the delivery:
//! RabbitMQ's shared slots are claims in the store every gateway shares.

use test_support::common::faults::{FaultStore, Faults, Op};
use test_support::support_rabbitmq;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency::store::{OwnerToken, StoreError};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{AmqpQueue, Ingested, Message, Pace, Queue, Worker};

/// Renewals of the shared slots hang, once `stalled`.
#[derive(Clone, Default)]
struct StalledSlots {
    stalled: Arc<AtomicBool>,
    hung: Arc<AtomicUsize>,
}

impl Faults for StalledSlots {
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError> {
        if op == Op::Renew && key.contains(":slot:") && self.stalled.load(Ordering::SeqCst) {
            self.hung.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pacing_store_neither_loses_the_entry_nor_stops_its_delivery() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let store = FaultStore::new(StalledSlots::default());
    let name = format!("stall-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    let got = queue
        .ingest(Message::new("k-1", Fingerprint::of(b"k-1"), "{}"))
        .await
        .unwrap();
    assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    // The delivery runs five leases; the store stalls once it started.
    let lease = Duration::from_millis(300);
    let (calls, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let svc = {
        let (calls, done, stalled) = (calls.clone(), done.clone(), store.stalled.clone());
        tower::service_fn(move |_m: Message| {
            calls.fetch_add(1, Ordering::SeqCst);
            stalled.store(true, Ordering::SeqCst);
            let done = done.clone();
            async move {
                tokio::time::sleep(lease * 5).await;
                done.fetch_add(1, Ordering::SeqCst);
                Ok::<_, crate::Down>(())
            }
        })
    };
    let worker = Worker::new(queue.clone(), svc)
        .pace(Pace::new().concurrency(1))
        .lease(lease)
        .poll_interval(Duration::from_millis(20))
        .shared_pacing();
    let running = tokio::spawn(worker.run(std::future::pending()));
    let start = std::time::Instant::now();
    while queue.stats().await.unwrap().depth > 0 || done.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not delivered: {} calls, {} ended, {} slot renewals hung",
            calls.load(Ordering::SeqCst),
            done.load(Ordering::SeqCst),
            store.hung.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.abort();
    assert!(store.hung.load(Ordering::SeqCst) > 0, "the store stalled");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "delivered once");
}
