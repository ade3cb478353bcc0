//! RabbitMQ's dead letters: a call costs what it returns (a page, one
//! letter), calls running at once never hide a letter from each other, a
//! replay and a delete racing on two instances have a letter once, and the
//! letters of an earlier version's dead-letter queue are kept.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use test_support::support_rabbitmq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::store::{MemoryStore, OwnerToken};
use tower_idempotency_queue::testing::{
    assert_nothing_due, fetch_n, message, unique_key, HOLD, LEASE,
};
use tower_idempotency_queue::{AmqpQueue, EntryId, Ingested, Queue};

/// A TCP proxy in front of the broker that counts the bytes the broker
/// sends: what a call read from the broker, whatever the calls it made.
struct Counting {
    port: u16,
    from_broker: Arc<AtomicU64>,
}

impl Counting {
    async fn start(broker: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let from_broker = Arc::new(AtomicU64::new(0));
        let counter = from_broker.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = TcpStream::connect(("127.0.0.1", broker)).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut ur, mut uw) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut uw).await;
                    let _ = uw.shutdown().await;
                });
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0; 64 * 1024];
                    while let Ok(n) = ur.read(&mut buf).await {
                        if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    let _ = cw.shutdown().await;
                });
            }
        });
        Self { port, from_broker }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn read(&self) -> u64 {
        self.from_broker.load(Ordering::Relaxed)
    }
}

fn fresh_name(tag: &str) -> String {
    format!("dead-{tag}-{:x}", OwnerToken::new().as_u128())
}

/// Queues `n` notifications and dead-letters each; their keys.
async fn dead_letters_of<Q: Queue>(queue: &Q, n: usize) -> HashSet<String> {
    let keys: Vec<String> = (0..n).map(|_| unique_key("amqp-dead")).collect();
    for batch in keys.chunks(100) {
        let queued = join_all(batch.iter().map(|k| queue.ingest(message(k)))).await;
        for q in queued {
            assert!(matches!(q.unwrap(), Ingested::Queued(_)));
        }
        let held = fetch_n(queue, batch.len()).await;
        assert_eq!(held.len(), batch.len(), "every entry fetched");
        let dead = join_all(held.iter().map(|d| queue.dead_letter(d, "upstream down"))).await;
        for d in dead {
            assert!(d.unwrap());
        }
    }
    keys.into_iter().collect()
}

/// Two calls reading the dead letters while a third pages through them:
/// none of them misses a letter (no "not found" for a letter there, no list
/// short of one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_dead_letters_read_at_once_are_never_hidden_from_each_other() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    const N: usize = 30;
    let queue = AmqpQueue::open(&broker.url(), &fresh_name("hide"), MemoryStore::new())
        .await
        .unwrap();
    let keys = dead_letters_of(&queue, N).await;
    let all = queue.dead_letters(N + 1).await.unwrap();
    assert_eq!(all.len(), N);
    let ids: Vec<EntryId> = all.iter().map(|d| d.id.clone()).collect();
    let shows = (0..2).map(|_| {
        let (queue, ids) = (queue.clone(), ids.clone());
        tokio::spawn(async move {
            for round in 0..3 {
                for id in &ids {
                    let found = queue.find_dead(id).await.unwrap();
                    assert!(found.is_some(), "round {round}: letter {id} not found");
                }
                let listed = queue.dead_letters(N + 1).await.unwrap();
                assert_eq!(listed.len(), N, "round {round}: a list short of letters");
            }
        })
    });
    let shows: Vec<_> = shows.collect();
    let pager = {
        let queue = queue.clone();
        tokio::spawn(async move {
            for round in 0..3 {
                let (mut seen, mut after) = (HashSet::new(), None::<EntryId>);
                loop {
                    let page = queue.dead_page(after.as_ref(), 4).await.unwrap();
                    let Some(last) = page.last() else {
                        break;
                    };
                    after = Some(last.id.clone());
                    seen.extend(page.iter().map(|d| d.message.key.clone()));
                }
                assert_eq!(seen.len(), N, "round {round}: pages short of letters");
            }
        })
    };
    for s in shows {
        s.await.unwrap();
    }
    pager.await.unwrap();
    let listed: HashSet<String> = (queue.dead_letters(N + 1).await.unwrap())
        .into_iter()
        .map(|d| d.message.key)
        .collect();
    assert_eq!(listed, keys);
}

/// What one page of 50, one letter shown and one replayed read from the
/// broker, with `n` dead letters.
async fn read_for_a_page(broker: &support_rabbitmq::RabbitServer, n: usize) -> u64 {
    let proxy = Counting::start(broker.port()).await;
    let queue = AmqpQueue::open(&proxy.url(), &fresh_name("cost"), MemoryStore::new())
        .await
        .unwrap();
    dead_letters_of(&queue, n).await;
    // The instance has its dead letters at hand (it wrote them).
    let first = queue.dead_page(None, 1).await.unwrap();
    assert_eq!(first.len(), 1);
    let before = proxy.read();
    let page = queue.dead_page(Some(&first[0].id), 50).await.unwrap();
    assert_eq!(page.len(), 50);
    let shown = queue.find_dead(&page[49].id).await.unwrap();
    assert!(shown.is_some());
    assert!(queue.replay(&page[0].id).await.unwrap());
    proxy.read() - before
}

/// A page, a letter shown and a letter replayed cost what they return,
/// not what the dead letters hold: ten times the letters read about as
/// much from the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_dead_letter_page_costs_the_page_not_every_letter() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let small = read_for_a_page(&broker, 200).await;
    let large = read_for_a_page(&broker, 2000).await;
    assert!(
        large < small * 2,
        "with 2000 letters a page read {large} bytes from the broker, with 200 {small}"
    );
}

/// Every letter of a large dead-letter queue replayed one by one (an
/// operator's bulk replay): each is queued again once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_bulk_replay_of_many_letters_replays_each_once() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    const N: usize = 1000;
    let queue = AmqpQueue::open(&broker.url(), &fresh_name("bulk"), MemoryStore::new())
        .await
        .unwrap();
    let keys = dead_letters_of(&queue, N).await;
    let started = std::time::Instant::now();
    let mut after = None::<EntryId>;
    let mut replayed = 0;
    // An operator's call gives up after 30 s.
    while started.elapsed() < Duration::from_secs(30) {
        let page = queue.dead_page(after.as_ref(), 100).await.unwrap();
        let Some(last) = page.last() else {
            break;
        };
        after = Some(last.id.clone());
        for letter in &page {
            assert!(queue.replay(&letter.id).await.unwrap(), "{}", letter.id);
            replayed += 1;
        }
    }
    let took = started.elapsed();
    assert_eq!(replayed, N, "letters replayed one by one in {took:?}");
    assert!(queue.dead_letters(10).await.unwrap().is_empty());
    let back = fetch_n(&queue, N).await;
    let back_keys: HashSet<String> = back.iter().map(|d| d.message.key.clone()).collect();
    assert_eq!((back.len(), back_keys), (N, keys));
}

/// A replay on one instance racing a delete on another, for each of 16
/// letters: exactly one has it; a replayed letter is delivered once, a
/// deleted one never.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_replay_and_a_delete_on_two_instances_have_a_letter_once() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    const N: usize = 16;
    let (name, store) = (fresh_name("race"), MemoryStore::new());
    let a = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    let b = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    dead_letters_of(&a, N).await;
    let dead = b.dead_letters(N + 1).await.unwrap();
    assert_eq!(dead.len(), N, "the other instance lists every letter");
    let (mut replayed, mut deleted) = (HashSet::new(), HashSet::new());
    for (n, letter) in dead.iter().enumerate() {
        let go = Arc::new(tokio::sync::Barrier::new(2));
        let (q, id, g) = (a.clone(), letter.id.clone(), go.clone());
        let replay = tokio::spawn(async move {
            g.wait().await;
            q.replay(&id).await.unwrap()
        });
        let (q, id, g) = (b.clone(), letter.id.clone(), go.clone());
        let delete = tokio::spawn(async move {
            g.wait().await;
            if n % 2 == 0 {
                tokio::task::yield_now().await;
            }
            q.delete_dead(&id).await.unwrap()
        });
        let (replay, delete) = (replay.await.unwrap(), delete.await.unwrap());
        assert!(
            replay != delete.is_some(),
            "letter {n}: replayed {replay}, deleted {}",
            delete.is_some()
        );
        if replay {
            replayed.insert(letter.message.key.clone());
        } else {
            deleted.insert(letter.message.key.clone());
        }
    }
    assert!(a.dead_letters(N + 1).await.unwrap().is_empty());
    assert!(b.dead_letters(N + 1).await.unwrap().is_empty());
    let back = fetch_n(&a, replayed.len()).await;
    let back_keys: HashSet<String> = back.iter().map(|d| d.message.key.clone()).collect();
    assert_eq!(back.len(), replayed.len(), "each replayed letter delivered");
    assert_eq!(back_keys, replayed);
    for d in &back {
        assert!(a.ack(d).await.unwrap());
    }
    // Nothing more: no letter twice, no deleted letter.
    assert_nothing_due(&a, HOLD).await;
    assert_nothing_due(&b, LEASE).await;
}

/// The dead letters an earlier version kept in its `NAME.dead` quorum
/// queue are listed and replayed after the upgrade, each once, whichever
/// instances open the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_dead_letters_of_an_earlier_version_are_kept_once() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    const N: usize = 12;
    let name = fresh_name("upgrade");
    let conn = Connection::connect(&broker.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut quorum = FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(format!("{name}.dead").into(), durable, quorum)
        .await
        .unwrap();
    // The bodies as the queue writes them: queued into a queue of their
    // own, taken from it as they are.
    let source = fresh_name("upgrade-source");
    let writer = AmqpQueue::open(&broker.url(), &source, MemoryStore::new())
        .await
        .unwrap();
    let mut keys = HashSet::new();
    for i in 0..N {
        let key = unique_key("upgrade");
        writer.ingest(message(&key)).await.unwrap();
        let body = ch
            .basic_get(source.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("the entry just queued")
            .delivery
            .data;
        let mut headers = FieldTable::default();
        headers.insert("x-attempts".into(), AMQPValue::LongLongInt(5));
        headers.insert(
            "x-last-error".into(),
            AMQPValue::LongString(LongString::from("upstream down")),
        );
        headers.insert(
            "x-dead-at-ms".into(),
            AMQPValue::LongLongInt(1_700_000_000_000 + i as i64),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("{:032x}", OwnerToken::new().as_u128()).into())
            .with_headers(headers);
        ch.basic_publish(
            "".into(),
            format!("{name}.dead").into(),
            BasicPublishOptions::default(),
            &body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        keys.insert(key);
    }
    // Two instances of the new version open the queue at once.
    let (store, url) = (MemoryStore::new(), broker.url());
    let (a, b) = tokio::join!(
        AmqpQueue::open(&url, &name, store.clone()),
        AmqpQueue::open(&url, &name, store.clone()),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    for q in [&a, &b] {
        let listed = q.dead_letters(N + 5).await.unwrap();
        let listed_keys: HashSet<String> = listed.iter().map(|d| d.message.key.clone()).collect();
        assert_eq!(listed.len(), N, "each letter once");
        assert_eq!(listed_keys, keys);
        assert_eq!(q.stats().await.unwrap().dead, N as u64);
    }
    let first = a.dead_letters(1).await.unwrap().remove(0);
    assert_eq!(first.error, "upstream down");
    assert_eq!(first.attempts, 5);
    assert_eq!(a.replay_all().await.unwrap(), N);
    let back = fetch_n(&b, N).await;
    assert_eq!(back.len(), N, "each letter replayed");
    for d in &back {
        assert!(b.ack(d).await.unwrap());
    }
    assert_nothing_due(&a, HOLD).await;
    let _ = conn.close(200, "done".into()).await;
}

/// The broker killed and started again: the instance reads its dead
/// letters on the new connection (where its reader left off), lists each
/// once, and replays one once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_dead_letters_are_read_again_after_the_broker_restarts() {
    if !support_rabbitmq::rabbitmq_available() {
        return;
    }
    const N: usize = 6;
    let mut broker = support_rabbitmq::RabbitServer::start();
    let queue = AmqpQueue::open(&broker.url(), &fresh_name("restart"), MemoryStore::new())
        .await
        .unwrap();
    let keys = dead_letters_of(&queue, N).await;
    assert_eq!(queue.dead_letters(N + 1).await.unwrap().len(), N);
    // A stream killed seconds after it was made may not be started again
    // (RabbitMQ 3.10): see the next test.
    tokio::time::sleep(Duration::from_secs(8)).await;
    broker.kill();
    broker.restart();
    // Calls fail until the queue connects again.
    let mut listed = Err(None);
    for _ in 0..100 {
        match queue.dead_letters(N + 1).await {
            Ok(l) => {
                listed = Ok(l);
                break;
            }
            Err(e) => listed = Err(Some(e)),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listed = listed.expect("the dead letters listed after the restart");
    let listed_keys: HashSet<String> = listed.iter().map(|d| d.message.key.clone()).collect();
    assert_eq!((listed.len(), listed_keys), (N, keys));
    assert!(queue.replay(&listed[0].id).await.unwrap());
    assert!(
        !queue.replay(&listed[0].id).await.unwrap(),
        "replayed twice"
    );
    let back = fetch_n(&queue, 1).await;
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].message.key, listed[0].message.key);
    assert!(queue.ack(&back[0]).await.unwrap());
    assert_eq!(queue.stats().await.unwrap().dead, N as u64 - 1);
    assert_nothing_due(&queue, HOLD).await;
}

/// The broker killed seconds after the dead-letter log was made (RabbitMQ
/// 3.10 may then not start that stream again): entries are still queued
/// and delivered, and an entry that cannot be buried stays in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_a_dead_letter_log_down_leaves_the_queue_working() {
    if !support_rabbitmq::rabbitmq_available() {
        return;
    }
    let mut broker = support_rabbitmq::RabbitServer::start();
    let queue = AmqpQueue::open(&broker.url(), &fresh_name("log-down"), MemoryStore::new())
        .await
        .unwrap();
    broker.kill();
    broker.restart();
    let key = unique_key("log-down");
    let mut queued = None;
    for _ in 0..100 {
        if let Ok(q) = queue.ingest(message(&key)).await {
            queued = Some(q);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(matches!(queued, Some(Ingested::Queued(_))), "{queued:?}");
    let d = fetch_n(&queue, 1).await.pop().expect("the entry delivered");
    match queue.dead_letter(&d, "upstream down").await {
        Ok(buried) => {
            assert!(buried);
            let dead = queue.dead_letters(2).await.unwrap();
            assert_eq!(dead.len(), 1);
            assert_eq!(dead[0].message.key, key);
        }
        Err(_) => {
            // Not buried: the entry is handed out again.
            let again = fetch_n(&queue, 1).await.pop().expect("the entry again");
            assert_eq!(again.message.key, key);
            assert!(queue.ack(&again).await.unwrap());
        }
    }
}
