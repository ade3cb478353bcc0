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

/// Takes the one message of `queue` off the broker (waiting up to 10 s).
async fn take_one(channel: &lapin::Channel, queue: &str) -> lapin::message::BasicGetMessage {
    let start = std::time::Instant::now();
    loop {
        let got = channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap();
        if let Some(got) = got {
            return got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nothing in {queue}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A retry due after more than the longest delay queue (2^20 ms, 17.5
/// min) goes round the delay queues until it is due, instead of coming
/// due when the longest one hands it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_retry_longer_than_the_longest_delay_queue_does_not_come_due_early() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let name = format!("delay-{:x}", OwnerToken::new().as_u128());
    let queue = AmqpQueue::open(&broker.url(), &name, MemoryStore::new())
        .await
        .unwrap();
    queue
        .ingest(Message::new("k-1", Fingerprint::of(b"k-1"), "{}"))
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let delivery = loop {
        if let Some(d) = queue.fetch(1, Duration::from_secs(30)).await.unwrap().pop() {
            break d;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never fetched");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let wait = Duration::from_secs(30 * 60);
    assert!(queue.retry(&delivery, wait, "later").await.unwrap());
    // The longest delay queue hands it back (here at once, by hand, as the
    // broker would 17.5 minutes on).
    let conn = Connection::connect(&broker.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let longest = format!("{name}.delay.{}", 1u64 << 20);
    let entry = take_one(&channel, &longest).await;
    channel
        .basic_publish(
            "".into(),
            name.as_str().into(),
            BasicPublishOptions::default(),
            &entry.delivery.data,
            entry.properties.clone(),
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
    // Not due for another 30 minutes: not handed out, but waiting again.
    for _ in 0..10 {
        let got = queue.fetch(1, Duration::from_secs(30)).await.unwrap();
        assert!(got.is_empty(), "a retry due in {wait:?} came due at once");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = take_one(&channel, &longest).await;
    assert_eq!(again.delivery.data, entry.delivery.data);
}
