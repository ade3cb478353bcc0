//! The library's routes with several destinations in process: a queue that
//! fails to store one destination's entry answers the channel's failure,
//! and the channel's retry queues only what is missing (the destinations
//! already stored are duplicates): each destination is delivered once.

use test_support::common;

use common::upstream::Upstream;
use common::{read, request};
use idempotency_gateway::proxy::{Destination, Forward, Gateway, RouteOptions, Target};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Preset;
use tower_idempotency_queue::{
    DeadLetter, Delivery, EntryId, Ingested, MemoryQueue, Message, Queue, QueueError,
    QueueErrorKind, QueueStats, Worker,
};

/// A memory queue that cannot store the ledger's entries while `down`.
#[derive(Clone)]
struct LedgerDown {
    inner: MemoryQueue,
    down: Arc<AtomicBool>,
}

impl Queue for LedgerDown {
    async fn ingest(&self, m: Message) -> Result<Ingested, QueueError> {
        if self.down.load(Ordering::SeqCst) && m.destination.as_deref() == Some("ledger") {
            return Err(QueueError::new(QueueErrorKind::Other, "disk full"));
        }
        self.inner.ingest(m).await
    }
    async fn fetch(&self, n: usize, l: Duration) -> Result<Vec<Delivery>, QueueError> {
        self.inner.fetch(n, l).await
    }
    async fn renew(&self, d: &Delivery, l: Duration) -> Result<bool, QueueError> {
        self.inner.renew(d, l).await
    }
    async fn ack(&self, d: &Delivery) -> Result<bool, QueueError> {
        self.inner.ack(d).await
    }
    async fn retry(&self, d: &Delivery, a: Duration, e: &str) -> Result<bool, QueueError> {
        self.inner.retry(d, a, e).await
    }
    async fn dead_letter(&self, d: &Delivery, e: &str) -> Result<bool, QueueError> {
        self.inner.dead_letter(d, e).await
    }
    async fn dead_letters(&self, n: usize) -> Result<Vec<DeadLetter>, QueueError> {
        self.inner.dead_letters(n).await
    }
    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        self.inner.replay(id).await
    }
    async fn replay_all(&self) -> Result<usize, QueueError> {
        self.inner.replay_all().await
    }
    async fn stats(&self) -> Result<QueueStats, QueueError> {
        self.inner.stats().await
    }
}

#[tokio::test]
async fn a_destination_not_stored_answers_the_failure_and_the_retry_stores_it_alone() {
    let (orders, ledger) = (Upstream::start().await, Upstream::start().await);
    let forward = |up: &Upstream| Forward::new(up.url().parse().unwrap());
    let down = Arc::new(AtomicBool::new(true));
    let queue = LedgerDown {
        inner: MemoryQueue::new(),
        down: down.clone(),
    };
    let options = RouteOptions::new()
        .ack_then_deliver(true)
        .deliver_to(Destination::new("orders", forward(&orders)))
        .deliver_to(Destination::new("ledger", forward(&ledger)));
    let gateway = Gateway::builder(forward(&orders), MemoryStore::new())
        .queue(queue.clone())
        .route_with("/stripe", Target::Preset(Preset::stripe()), options)
        .build()
        .unwrap();
    let body = r#"{"id":"evt_partial","object":"event","type":"charge.refunded"}"#;
    let send = || async {
        let req = request(
            "/stripe/hook",
            &[("content-type", "application/json")],
            body.to_owned(),
        );
        read(gateway.clone().oneshot(req).await.unwrap()).await
    };
    let failed = send().await;
    assert_eq!(
        failed.status,
        500,
        "the channel's failure: {}",
        failed.text()
    );
    assert_eq!(queue.stats().await.unwrap().depth, 1, "the orders' entry");
    // The channel retries once the queue can store the ledger's entry.
    down.store(false, Ordering::SeqCst);
    let retried = send().await;
    assert_eq!(retried.status, 200, "{}", retried.text());
    assert_eq!(
        queue.stats().await.unwrap().depth,
        2,
        "the ledger's added, no other"
    );
    let mut worker = Worker::new(queue.clone(), gateway.deliverer());
    assert_eq!(worker.run_once().await.unwrap().delivered, 2);
    assert_eq!((orders.total(), ledger.total()), (1, 1));
    // Each once, however often the channel sends it again.
    assert_eq!(send().await.status, 200);
    assert_eq!(worker.run_once().await.unwrap().delivered, 0);
    assert_eq!((orders.total(), ledger.total()), (1, 1));
}
