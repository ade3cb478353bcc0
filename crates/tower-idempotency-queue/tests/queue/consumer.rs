//! The idempotent consumer: one suite of cases, run against every store
//! (memory, a standalone Redis and a 3-master Redis Cluster started here),
//! its RabbitMQ adapter on a real broker and its JetStream adapter on a
//! real `nats-server -js`.

use test_support::support_nats;
use test_support::support_rabbitmq;
use test_support::support_redis;

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower::{service_fn, Service, ServiceExt};
use tower_idempotency::consumer::{ConsumeError, Consumer, ConsumerLayer, Once};
use tower_idempotency::store::{MemoryStore, OwnerToken, Store};
use tower_idempotency::Fingerprint;
use tower_layer::Layer;

type Guard = Option<Arc<dyn Any + Send + Sync>>;

/// A key no other test (or earlier run against the same server) uses.
fn unique(case: &str) -> String {
    format!("{case}:{:032x}", OwnerToken::new().as_u128())
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(s.as_bytes())
}

use crate::Down;

mod cases {
    use super::*;

    pub(super) async fn copies_run_once_and_get_the_receipt<S: Store>(store: S) {
        let consumer = Consumer::new(store);
        let key = unique("seq");
        let runs = AtomicUsize::new(0);
        for i in 0..5 {
            let once = consumer
                .once(&key, fp("p"), async {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    Ok::<_, Down>(format!("run {n}"))
                })
                .await
                .unwrap();
            assert_eq!(once.ran(), i == 0);
            assert_eq!(once.into_inner(), "run 1");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    pub(super) async fn concurrent_copies_run_once<S: Store>(store: S) {
        let consumer = Consumer::new(store).wait(Duration::from_secs(10));
        let key = unique("concurrent");
        let runs = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (consumer, key, runs) = (consumer.clone(), key.clone(), runs.clone());
                tokio::spawn(async move {
                    consumer
                        .once(&key, fp("p"), async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            Ok::<_, Down>(())
                        })
                        .await
                })
            })
            .collect();
        let mut ran = 0;
        for t in tasks {
            // Every copy waited for the first and got its success.
            ran += usize::from(t.await.unwrap().unwrap().ran());
        }
        assert_eq!(ran, 1);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    pub(super) async fn failures_are_not_recorded<S: Store>(store: S) {
        let consumer = Consumer::new(store);
        let key = unique("fail");
        let got = consumer
            .once(&key, fp("p"), async { Err::<(), _>(Down) })
            .await;
        assert!(matches!(got, Err(ConsumeError::Handler(Down))), "{got:?}");
        let got = consumer
            .once(&key, fp("p"), async { Ok::<_, Down>(()) })
            .await;
        assert_eq!(got.unwrap(), Once::Ran(()));
    }

    pub(super) async fn panics_release_the_claim<S: Store>(store: S) {
        let consumer = Consumer::new(store);
        let key = unique("panic");
        let got = consumer
            .once(&key, fp("p"), async {
                if key.len() > 1 {
                    panic!("handler bug");
                }
                Ok::<(), Down>(())
            })
            .await;
        assert!(matches!(got, Err(ConsumeError::Panicked)), "{got:?}");
        let got = consumer
            .once(&key, fp("p"), async { Ok::<_, Down>(()) })
            .await;
        assert_eq!(got.unwrap(), Once::Ran(()));
    }

    pub(super) async fn a_cancelled_run_releases_the_claim<S: Store>(store: S) {
        let consumer = Consumer::new(store).wait(Duration::from_secs(10));
        let key = unique("cancel");
        let started = Arc::new(tokio::sync::Notify::new());
        let run = {
            let (consumer, key, started) = (consumer.clone(), key.clone(), started.clone());
            tokio::spawn(async move {
                consumer
                    .once(&key, fp("p"), async move {
                        started.notify_one();
                        std::future::pending::<Result<(), Down>>().await
                    })
                    .await
            })
        };
        started.notified().await;
        run.abort();
        // The copy waits for the release (not for the 30 s lease) and runs.
        let got = consumer
            .once(&key, fp("p"), async { Ok::<_, Down>(()) })
            .await;
        assert_eq!(got.unwrap(), Once::Ran(()));
    }

    pub(super) async fn another_fingerprint_never_runs<S: Store>(store: S) {
        let consumer = Consumer::new(store);
        let key = unique("mismatch");
        consumer
            .once(&key, fp("paid 100"), async { Ok::<_, Down>(()) })
            .await
            .unwrap();
        let runs = AtomicUsize::new(0);
        let got = consumer
            .once(&key, fp("paid 1"), async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Down>(())
            })
            .await;
        assert!(matches!(got, Err(ConsumeError::Mismatch)), "{got:?}");
        assert!(!got.unwrap_err().is_retryable());
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }

    pub(super) async fn the_lease_is_renewed_while_the_handler_runs<S: Store>(store: S) {
        // A lease of 600 ms, a handler of 2 s: without renewal (every 200 ms)
        // the copy below would claim the key and run a second time.
        let consumer = Consumer::new(store).lease(Duration::from_millis(600));
        let key = unique("renew");
        let runs = Arc::new(AtomicUsize::new(0));
        let first = {
            let (consumer, key, runs) = (consumer.clone(), key.clone(), runs.clone());
            tokio::spawn(async move {
                consumer
                    .once(&key, fp("p"), async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        Ok::<_, Down>(())
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let copy = consumer
            .once(&key, fp("p"), async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Down>(())
            })
            .await;
        assert!(matches!(copy, Err(ConsumeError::InFlight)), "{copy:?}");
        assert!(first.await.unwrap().unwrap().ran());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    pub(super) async fn the_layer_guards_any_message<S: Store>(store: S) {
        #[derive(Clone)]
        struct Paid {
            id: Option<String>,
            amount: u64,
        }
        let key = |m: &Paid| {
            m.id.clone()
                .map(|id| (id, Fingerprint::of(&m.amount.to_le_bytes())))
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let counter = runs.clone();
        let mut svc = ConsumerLayer::new(Consumer::new(store).scope("points"), key).layer(
            service_fn(move |m: Paid| {
                counter.fetch_add(1, Ordering::SeqCst);
                async move { Ok::<_, Down>(format!("credited {}", m.amount)) }
            }),
        );
        let id = unique("layer");
        let msg = Paid {
            id: Some(id.clone()),
            amount: 7,
        };
        for i in 0..3 {
            let once = svc.ready().await.unwrap().call(msg.clone()).await.unwrap();
            assert_eq!(once.ran(), i == 0);
            assert_eq!(once.into_inner(), "credited 7");
        }
        let missing = svc
            .ready()
            .await
            .unwrap()
            .call(Paid {
                id: None,
                amount: 7,
            })
            .await;
        assert!(matches!(missing, Err(ConsumeError::KeyMissing)));
        let tampered = svc
            .oneshot(Paid {
                id: Some(id),
                amount: 8,
            })
            .await;
        assert!(matches!(tampered, Err(ConsumeError::Mismatch)));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}

macro_rules! consumer_tests {
    ($name:ident, $setup:path) => {
        mod $name {
            use super::*;
            consumer_tests!(@cases $setup;
                copies_run_once_and_get_the_receipt,
                concurrent_copies_run_once,
                failures_are_not_recorded,
                panics_release_the_claim,
                a_cancelled_run_releases_the_claim,
                another_fingerprint_never_runs,
                the_lease_is_renewed_while_the_handler_runs,
                the_layer_guards_any_message,
            );
        }
    };
    (@cases $setup:path; $($case:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let Some((store, _guard)) = $setup().await else {
                    return;
                };
                cases::$case(store).await;
            }
        )*
    };
}

async fn memory() -> Option<(MemoryStore, Guard)> {
    Some((MemoryStore::new(), None))
}

consumer_tests!(memory_store, memory);

mod redis_setup {
    use super::support_redis::{shared_cluster, shared_standalone};
    use super::*;
    use tower_idempotency_redis::{RedisClusterStore, RedisStore};

    pub(super) async fn standalone() -> Option<(RedisStore, Guard)> {
        let server = shared_standalone()?;
        let store = RedisStore::standalone(server.url()).await.unwrap();
        Some((store.poll_interval(Duration::from_millis(20)), Some(server)))
    }

    pub(super) async fn cluster() -> Option<(RedisClusterStore, Guard)> {
        let cluster = shared_cluster()?;
        let store = RedisStore::cluster(cluster.urls()).await.unwrap();
        Some((
            store.poll_interval(Duration::from_millis(20)),
            Some(cluster),
        ))
    }
}

use redis_setup::{cluster as redis_cluster_setup, standalone as redis_standalone_setup};

consumer_tests!(redis_standalone, redis_standalone_setup);
consumer_tests!(redis_cluster, redis_cluster_setup);

/// On RabbitMQ: 20 orders published 3 times each (each copy with its own
/// message id, as a publisher's retries are), one consumer that dies
/// (its connection closed) after its handler ran and before its `ack`,
/// and a handler that fails once: every order is handled once, and the
/// queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_consumer_runs_each_key_once_through_copies_a_crash_before_ack_and_a_failure() {
    use lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use std::collections::HashMap;
    use std::sync::Mutex;
    use tower_idempotency_queue::consumer::{AmqpConsumer, AmqpMessage};

    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let url = broker.url();
    let connect = || Connection::connect(&url, ConnectionProperties::default());
    let conn = connect().await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let queue = unique("consumer").replace(':', "-");
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    for i in 0..20 {
        for copy in 0..3 {
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(format!("{i}-{copy}").into());
            let body = format!("order-{i}");
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    }
    let key = |m: &AmqpMessage| {
        let order = String::from_utf8(m.data.to_vec()).ok()?;
        let fp = Fingerprint::of(order.as_bytes());
        Some((order, fp))
    };
    let store = MemoryStore::new();
    let ran: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // The first consumer takes one message, runs the handler, and dies
    // before its ack.
    let doomed = connect().await.unwrap();
    let doomed_ch = doomed.create_channel().await.unwrap();
    let first = doomed_ch
        .basic_get(queue.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap()
        .delivery;
    let first_order = String::from_utf8(first.data.clone()).unwrap();
    let a = AmqpConsumer::new(Consumer::new(store.clone()).scope("amqp"), key);
    let handled = {
        let (ran, doomed) = (ran.clone(), &doomed);
        a.handle(first, &move |m: AmqpMessage| {
            let ran = ran.clone();
            async move {
                let order = String::from_utf8(m.data.to_vec()).unwrap();
                *ran.lock().unwrap().entry(order).or_default() += 1;
                doomed.close(200, "killed".into()).await.unwrap();
                Ok::<_, Down>(())
            }
        })
        .await
    };
    assert!(
        handled.is_err(),
        "acknowledged on a closed connection: {handled:?}"
    );

    // The second consumer gets everything, the dead one's message again.
    let b = AmqpConsumer::new(Consumer::new(store.clone()).scope("amqp"), key)
        .retry_after(Duration::from_millis(50));
    let b_conn = connect().await.unwrap();
    let b_ch = b_conn.create_channel().await.unwrap();
    let running = {
        let (ran, failed_once, queue) = (ran.clone(), failed_once.clone(), queue.clone());
        tokio::spawn(async move {
            let handler = move |m: AmqpMessage| {
                let (ran, failed_once) = (ran.clone(), failed_once.clone());
                async move {
                    let order = String::from_utf8(m.data.to_vec()).unwrap();
                    if order == "order-7" && !failed_once.swap(true, Ordering::SeqCst) {
                        return Err(Down);
                    }
                    *ran.lock().unwrap().entry(order).or_default() += 1;
                    Ok(())
                }
            };
            b.run(&b_ch, &queue, handler).await
        })
    };
    let started = std::time::Instant::now();
    loop {
        let left = ch
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count();
        if left == 0 && ran.lock().unwrap().len() == 20 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "left {left}, ran {:?}",
            ran.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Settled: nothing comes back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    b_conn.close(200, "done".into()).await.unwrap();
    let _ = running.await;
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran.len(), 20, "{ran:?}");
    assert!(ran.values().all(|&n| n == 1), "{ran:?}");
    assert!(ran.contains_key(&first_order));
    assert!(failed_once.load(Ordering::SeqCst));
    let check = connect().await.unwrap().create_channel().await.unwrap();
    let left = check
        .basic_get(queue.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap();
    assert!(left.is_none(), "a message left: {left:?}");
}

/// The JetStream adapter: a handler runs once per key through publisher
/// retries (another message id, or the same one), a consumer that crashed
/// after its handler ran, and a failed delivery redelivered; a key reused
/// with another payload never runs.
mod jetstream_consumer {
    use super::*;
    use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
    use futures_util::StreamExt;
    use std::collections::HashMap;
    use std::sync::Mutex;
    use tower_idempotency_queue::consumer::JetStreamConsumer;

    const ACK_WAIT: Duration = Duration::from_secs(1);

    async fn publish(js: &jetstream::Context, subject: &str, key: &str, id: &str, body: &str) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Idempotency-Key", key);
        headers.insert("Nats-Msg-Id", id);
        js.publish_with_headers(subject.to_owned(), headers, body.to_owned().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_runs_once_per_key_on_a_jetstream_subscription() {
        let Some(server) = super::support_nats::shared() else {
            return;
        };
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client);
        let name = format!("orders_{:x}", OwnerToken::new().as_u128());
        let subject = format!("{name}.paid");
        let stream = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        let pull: jetstream::consumer::PullConsumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("shipper".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                ..Default::default()
            })
            .await
            .unwrap();
        // A: the publisher retried with another id, and with the same id
        // (the server drops that one); B once; C's consumer crashes after
        // its handler ran; D fails once; E has no key.
        publish(&js, &subject, "A", "a-1", "paid A 100").await;
        publish(&js, &subject, "A", "a-2", "paid A 100").await;
        publish(&js, &subject, "A", "a-1", "paid A 100").await;
        publish(&js, &subject, "B", "b-1", "paid B 5").await;
        publish(&js, &subject, "C", "c-1", "paid C 7").await;
        publish(&js, &subject, "D", "d-1", "paid D 9").await;
        // A again with another amount: refused, never run.
        publish(&js, &subject, "A", "a-3", "paid A 100000").await;
        js.publish(subject.clone(), "no key".into())
            .await
            .unwrap()
            .await
            .unwrap();

        let consumer = Consumer::new(MemoryStore::new()).scope(unique("js"));
        let once = JetStreamConsumer::new(
            consumer.clone(),
            JetStreamConsumer::header_key("Idempotency-Key"),
        )
        .ack_wait(ACK_WAIT)
        .retry_after(Duration::from_millis(100));
        let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let failed_d = Arc::new(AtomicUsize::new(0));
        let mut crashed_c = false;
        let (mut mismatched, mut keyless) = (0, 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let info = pull.clone().info().await.unwrap().clone();
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not settled: {info:?}"
            );
            let mut batch = pull.fetch().max_messages(16).messages().await.unwrap();
            while let Some(m) = batch.next().await {
                let m = m.unwrap();
                let key = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Idempotency-Key"))
                    .map(|v| v.as_str().to_owned());
                if key.as_deref() == Some("C") && !crashed_c {
                    // The handler runs and succeeds, then the consumer
                    // dies before it acknowledged: redelivered after the
                    // ack wait.
                    crashed_c = true;
                    let r = runs.clone();
                    consumer
                        .once("C", Fingerprint::of(&m.payload), async move {
                            *r.lock().unwrap().entry("C".into()).or_default() += 1;
                            Ok::<_, Down>(())
                        })
                        .await
                        .unwrap();
                    continue;
                }
                let (r, failed) = (runs.clone(), failed_d.clone());
                let got = once
                    .handle(&m, |m| {
                        let key = m.headers.as_ref().unwrap().get("Idempotency-Key");
                        let key = key.unwrap().as_str().to_owned();
                        async move {
                            if key == "D" && failed.fetch_add(1, Ordering::SeqCst) == 0 {
                                return Err(Down);
                            }
                            *r.lock().unwrap().entry(key).or_default() += 1;
                            Ok(())
                        }
                    })
                    .await;
                match got {
                    Err(ConsumeError::Mismatch) => mismatched += 1,
                    Err(ConsumeError::KeyMissing) => keyless += 1,
                    _ => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let runs = runs.lock().unwrap().clone();
        for key in ["A", "B", "C", "D"] {
            assert_eq!(runs.get(key), Some(&1), "{key}: {runs:?}");
        }
        assert_eq!(runs.len(), 4, "{runs:?}");
        assert_eq!(
            failed_d.load(Ordering::SeqCst),
            2,
            "D failed once, then ran"
        );
        assert_eq!((mismatched, keyless), (1, 1));
    }
}
