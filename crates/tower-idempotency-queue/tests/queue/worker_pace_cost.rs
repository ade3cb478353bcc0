//! Shared pacing on RabbitMQ (a lane's slots and turns are claims in the
//! store every gateway shares) costs the store a bounded number of claims
//! while a lane's slots are all taken, however many deliveries wait for
//! one, and its claims start no watch in the store (nobody waits on them).

use test_support::common::faults::{FaultStore, Faults, Op};
use test_support::{support_rabbitmq, support_redis};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_idempotency::store::{Claim, OwnerToken, Store, StoreError};
use tower_idempotency::Fingerprint;
use tower_idempotency_queue::{AmqpQueue, SharedPacing};

/// Counts the claims of shared slots.
#[derive(Clone, Default)]
struct SlotClaims(Arc<AtomicUsize>);

impl Faults for SlotClaims {
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError> {
        if op == Op::Claim && key.contains(":slot:") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// All taken, a lane's slots are not looked at again for at least this
/// long.
const RESCAN: Duration = Duration::from_millis(50);
const LIMIT: usize = 3;
const LEASE: Duration = Duration::from_secs(30);

fn slot_key(queue: &str, i: usize) -> String {
    format!("amqp:{queue}:slot:default:{i}")
}

/// Another gateway takes slot `i` of the lane `default`.
async fn hold<S: Store>(store: &S, queue: &str, i: usize) -> OwnerToken {
    let token = OwnerToken::new();
    let got = store
        .claim(&slot_key(queue, i), Fingerprint::of(b"slot"), token, LEASE)
        .await
        .unwrap();
    assert!(matches!(got, Claim::Acquired(_)), "{got:?}");
    token
}

fn queue_name(tag: &str) -> String {
    format!("{tag}-{:x}", OwnerToken::new().as_u128())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_shared_slots_are_looked_at_once_per_rescan_not_once_per_waiting_delivery() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let store = FaultStore::new(SlotClaims::default());
    let name = queue_name("cost");
    let queue = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    // This instance holds one slot, another gateway the others.
    let mine = queue.take_slot("default", LIMIT, LEASE).await.unwrap();
    assert!(mine.is_some());
    for i in 1..LIMIT {
        hold(&store.inner, &name, i).await;
    }
    store.0.store(0, Ordering::SeqCst);
    // 40 deliveries ask for a slot, one after another.
    let start = Instant::now();
    for _ in 0..40 {
        assert_eq!(
            queue.take_slot("default", LIMIT, LEASE).await.unwrap(),
            None
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    let claims = store.0.load(Ordering::SeqCst);
    // At most one look per RESCAN, and a look skips the slot held here.
    let looks = (elapsed.as_millis() / RESCAN.as_millis()) as usize + 1;
    assert!(
        claims <= (LIMIT - 1) * looks,
        "{claims} claims of taken slots in {elapsed:?}: more than {} every {RESCAN:?}",
        LIMIT - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_given_back_here_is_taken_at_once_and_one_freed_elsewhere_soon() {
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    let store = FaultStore::new(SlotClaims::default());
    let name = queue_name("free");
    let queue = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    let mut taken = Vec::new();
    for _ in 0..LIMIT - 1 {
        taken.push(
            queue
                .take_slot("default", LIMIT, LEASE)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let theirs = hold(&store.inner, &name, LIMIT - 1).await;
    assert_eq!(
        queue.take_slot("default", LIMIT, LEASE).await.unwrap(),
        None
    );
    // Given back here: the next delivery takes it, no rescan wait.
    queue.give_slot("default", taken[0]).await.unwrap();
    let again = queue.take_slot("default", LIMIT, LEASE).await.unwrap();
    assert!(again.is_some(), "a slot given back here is taken at once");
    assert_eq!(
        queue.take_slot("default", LIMIT, LEASE).await.unwrap(),
        None
    );
    // Freed by the other gateway: found at a later look.
    let released = store
        .inner
        .release(&slot_key(&name, LIMIT - 1), theirs)
        .await;
    assert!(released.unwrap());
    let start = Instant::now();
    loop {
        if queue
            .take_slot("default", LIMIT, LEASE)
            .await
            .unwrap()
            .is_some()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the slot freed by another gateway was never taken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        queue.take_slot("default", LIMIT, LEASE).await.unwrap(),
        None
    );
}

/// `calls=` of one command in `INFO commandstats`.
fn calls(port: u16, command: &str) -> u64 {
    let info = support_redis::raw_command(port, "INFO commandstats").unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacing_claims_start_no_poller_of_a_redis_store() {
    use tower_idempotency_redis::RedisStore;
    let Some(broker) = support_rabbitmq::shared_rabbitmq() else {
        return;
    };
    if !support_redis::redis_available() {
        return;
    }
    let server = support_redis::RedisServer::start();
    let port = server.port();
    let store = RedisStore::standalone(server.url())
        .await
        .unwrap()
        .poll_interval(Duration::from_millis(10));
    let name = queue_name("poll");
    let queue = AmqpQueue::open(&broker.url(), &name, store.clone())
        .await
        .unwrap();
    // Another gateway holds every slot and the lane's turn.
    let other = RedisStore::standalone(server.url()).await.unwrap();
    for i in 0..LIMIT {
        hold(&other, &name, i).await;
    }
    let interval = Duration::from_secs(10);
    assert_eq!(queue.take_turn("default", interval).await.unwrap(), None);
    let reset = support_redis::raw_command(port, "CONFIG RESETSTAT").unwrap();
    assert!(reset.starts_with("+OK"), "{reset}");
    assert_eq!(
        queue.take_slot("default", LIMIT, LEASE).await.unwrap(),
        None
    );
    let wait = queue.take_turn("default", interval).await.unwrap();
    assert!(wait.is_some_and(|w| w <= interval), "{wait:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        calls(port, "getrange"),
        0,
        "a pacing claim started a poller of the key it found taken"
    );
}
