//! Broker headers that anyone who can publish may set: counts that do not
//! fit are refused (taken as the last attempt), never added with overflow.

use test_support::support_rabbitmq;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use std::time::Duration;
use tower_idempotency::store::{MemoryStore, OwnerToken};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{AmqpQueue, Ingested, Message, Queue};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_an_attempt_count_past_what_fits_is_the_last_attempt() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let name = format!("headers-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(&broker.url(), &name, MemoryStore::new())
        .await
        .unwrap();
    let got = queue
        .ingest(Message::new("k-1", Fingerprint::of(b"k-1"), "{}"))
        .await
        .unwrap();
    assert!(matches!(got, Ingested::Queued(_)), "{got:?}");
    // Someone with write access puts it back with a count of u64::MAX.
    let conn = Connection::connect(&broker.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let start = std::time::Instant::now();
    let entry = loop {
        let got = channel
            .basic_get(name.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap();
        if let Some(got) = got {
            break got;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut headers = entry
        .properties
        .headers()
        .clone()
        .unwrap_or_default()
        .inner()
        .clone();
    headers.insert("x-attempts".into(), AMQPValue::Timestamp(u64::MAX));
    headers.insert("x-delivery-count".into(), AMQPValue::Timestamp(u64::MAX));
    let props = entry
        .properties
        .clone()
        .with_headers(FieldTable::from(headers));
    channel
        .basic_publish(
            "".into(),
            name.as_str().into(),
            BasicPublishOptions::default(),
            &entry.delivery.data,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    entry
        .delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let fetched = loop {
        let mut got = queue.fetch(1, Duration::from_secs(30)).await.unwrap();
        if let Some(d) = got.pop() {
            break d;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never fetched");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        fetched.attempt,
        u32::MAX,
        "the last attempt, not a wrapped count"
    );
}
