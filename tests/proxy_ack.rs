//! The library's acknowledge-then-deliver routes in process: the success
//! reply only for a queued (or already queued) notification, the failure
//! reply for a queue error or a fingerprint mismatch, and delivery through
//! the dedup layer (an entry handed out twice reaches the upstream once).

mod common;

use common::upstream::Upstream;
use common::vectors::{check, Expect, WECHATPAY_V3};
use common::{read, request};
use std::time::Duration;
use tower::ServiceExt;
use tower_idempotency::proxy::{Forward, Gateway, RouteError, RouteOptions, Target};
use tower_idempotency::queue::{
    DeadLetter, Delivery, EntryId, Ingested, MemoryQueue, Message, Queue, QueueError, QueueStats,
    Worker,
};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Preset;

/// WeChat Pay's success reply.
const SUCCESS: Expect = match WECHATPAY_V3.success {
    Some(reply) => reply,
    None => panic!("WeChat Pay has a fixed success reply"),
};

fn wechat(id: &str, event: &str) -> String {
    format!(
        r#"{{"id":"{id}","event_type":"{event}","resource":{{"original_type":"transaction"}}}}"#
    )
}

/// The recording upstream and a [`Forward`] to it.
async fn upstream() -> (Forward, Upstream) {
    let up = Upstream::start().await;
    (Forward::new(up.url().parse().unwrap()), up)
}

fn acked() -> RouteOptions {
    RouteOptions::new().ack_then_deliver(true)
}

/// A queue whose every call fails.
#[derive(Clone)]
struct Broken;

impl Queue for Broken {
    async fn ingest(&self, _m: Message) -> Result<Ingested, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn fetch(&self, _n: usize, _l: Duration) -> Result<Vec<Delivery>, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn ack(&self, _d: &Delivery) -> Result<bool, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn retry(&self, _d: &Delivery, _a: Duration, _e: &str) -> Result<bool, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn dead_letter(&self, _d: &Delivery, _e: &str) -> Result<bool, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn dead_letters(&self, _n: usize) -> Result<Vec<DeadLetter>, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn replay(&self, _id: &EntryId) -> Result<bool, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn replay_all(&self) -> Result<usize, QueueError> {
        Err(QueueError::new("disk full"))
    }
    async fn stats(&self) -> Result<QueueStats, QueueError> {
        Err(QueueError::new("disk full"))
    }
}

#[tokio::test]
async fn queued_once_success_reply_then_delivered_once_through_dedup() {
    let (forward, up) = upstream().await;
    let queue = MemoryQueue::new();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    assert!(gateway.has_ack_routes());
    let body = wechat("EV-1", "TRANSACTION.SUCCESS");
    for _ in 0..7 {
        let req = request(
            "/wx/notify",
            &[("content-type", "application/json")],
            body.clone(),
        );
        let answer = read(gateway.clone().oneshot(req).await.unwrap()).await;
        check(&answer, SUCCESS, "a queued copy");
    }
    assert_eq!(queue.stats().await.unwrap().depth, 1);
    assert_eq!(up.total(), 0, "nothing is delivered before the worker runs");
    // The entry handed out twice (a redelivery after a crash): one upstream call.
    let message = queue.fetch(1, Duration::ZERO).await.unwrap()[0]
        .message
        .clone();
    assert_eq!(message.order.as_deref(), Some(message.key.as_str()));
    gateway.deliver(message.clone()).await.unwrap();
    gateway.deliver(message).await.unwrap();
    assert_eq!(up.total(), 1);
    // And through a worker: the lease ran out, the entry is delivered again, no new call.
    let mut worker = Worker::new(queue.clone(), gateway.deliverer());
    assert_eq!(worker.run_once().await.unwrap().delivered, 1);
    assert_eq!(up.total(), 1);
    assert_eq!(queue.stats().await.unwrap().depth, 0);
}

#[tokio::test]
async fn queue_error_and_mismatch_get_the_failure_reply_never_success() {
    let (forward, up) = upstream().await;
    let broken = Gateway::builder(forward.clone(), MemoryStore::new())
        .queue(Broken)
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    let req = request(
        "/wx",
        &[("content-type", "application/json")],
        wechat("EV-2", "TRANSACTION.SUCCESS"),
    );
    let answer = read(broken.oneshot(req).await.unwrap()).await;
    check(&answer, WECHATPAY_V3.failure, "a queue error");

    let queue = MemoryQueue::new();
    let gateway = Gateway::builder(forward, MemoryStore::new())
        .queue(queue.clone())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build()
        .unwrap();
    let first = request("/wx", &[], wechat("EV-3", "TRANSACTION.SUCCESS"));
    assert_eq!(
        read(gateway.clone().oneshot(first).await.unwrap())
            .await
            .status,
        200
    );
    let forged = request("/wx", &[], wechat("EV-3", "REFUND.SUCCESS"));
    let answer = read(gateway.clone().oneshot(forged).await.unwrap()).await;
    check(&answer, WECHATPAY_V3.failure, "a mismatch");
    // No key: refused before the queue.
    let keyless = request("/wx", &[], r#"{"event_type":"TRANSACTION.SUCCESS"}"#);
    assert_ne!(
        read(gateway.oneshot(keyless).await.unwrap()).await.status,
        200
    );
    assert_eq!(queue.stats().await.unwrap().depth, 1);
    assert_eq!(up.total(), 0);
}

#[test]
fn ack_route_needs_a_queue_and_a_channel_preset() {
    let forward = || Forward::new("http://127.0.0.1:1".parse().unwrap());
    let no_queue = Gateway::builder(forward(), MemoryStore::new())
        .route_with("/wx", Target::Preset(Preset::wechatpay_v3()), acked())
        .build();
    assert!(matches!(no_queue, Err(RouteError::AckThenDeliver(_))));
    let auto = Gateway::builder(forward(), MemoryStore::new())
        .queue(MemoryQueue::new())
        .route_with("/", Target::Auto, acked())
        .build();
    assert!(matches!(auto, Err(RouteError::AckThenDeliver(_))));
    let client = Gateway::builder(forward(), MemoryStore::new())
        .queue(MemoryQueue::new())
        .route_with("/api", Target::Preset(Preset::idempotency_key()), acked())
        .build();
    assert!(matches!(client, Err(RouteError::AckThenDeliver(_))));
}
