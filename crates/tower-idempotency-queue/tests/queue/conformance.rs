//! The queue conformance suite (`tower_idempotency_queue::testing`) on
//! every backend of the crate: memory, redb, Redis Streams, RabbitMQ, NATS
//! JetStream, and a `Sealed` queue over redb.

use std::sync::Arc;
use test_support::common::temp::TempDir;
use test_support::support_nats;
use tower_idempotency::store::OwnerToken;
use tower_idempotency_queue::testing::{queue_tests, HOLD};
use tower_idempotency_queue::{
    JetStreamQueue, MemoryQueue, QueueKey, RedbQueue, RedisStreamsQueue, Sealed,
};

use crate::queue::{amqp_queue, jetstream_open, redis_queue};

async fn memory() -> Option<(MemoryQueue, ())> {
    Some((MemoryQueue::new(), ()))
}

async fn redb() -> Option<(RedbQueue, TempDir)> {
    let dir = TempDir::new("queue-conformance");
    Some((RedbQueue::open(dir.file()).unwrap(), dir))
}

async fn sealed_redb() -> Option<(Sealed<RedbQueue>, TempDir)> {
    let (queue, dir) = redb().await?;
    let key = QueueKey::new(&[7; 32]).unwrap();
    Some((Sealed::new(queue, key, "conformance"), dir))
}

/// A queue of its own on the binary's shared `nats-server -js`, with the
/// shortest ack wait JetStream takes (1 s, under the suite's `HOLD`): its
/// lease is the consumer's, set when the queue is opened, not the fetch's.
async fn jetstream() -> Option<(JetStreamQueue, Arc<support_nats::NatsServer>)> {
    let server = support_nats::shared()?;
    let name = format!("suite-{:x}", OwnerToken::new().as_u128());
    let queue = jetstream_open(&server.url(), &name).await;
    assert!(HOLD > std::time::Duration::from_secs(1));
    Some((queue, server))
}

async fn redis() -> Option<(
    RedisStreamsQueue,
    Arc<test_support::support_redis::RedisServer>,
)> {
    redis_queue().await
}

queue_tests!(memory_queue, memory);
queue_tests!(redb_queue, redb);
queue_tests!(sealed_redb_queue, sealed_redb);
queue_tests!(amqp_queue_suite, amqp_queue);
queue_tests!(jetstream_queue_suite, jetstream);
// Not `a_lease_that_runs_out_is_lost`: a Redis Streams lease belongs to
// the instance (its consumer in the group), not to a delivery, so an entry
// whose lease ran out is taken back by the same instance's next fetch and
// its first holder's settlement still holds; only another instance takes
// it away.
queue_tests!(redis_streams_queue_suite, redis;
    copies_of_one_key_make_one_entry,
    renew_keeps_a_lease,
    retry_and_postpone_make_an_entry_due_later,
    dead_letters_are_paged_each_once,
    a_dead_letter_is_replayed_once,
    a_raced_replay_and_delete_have_the_letter_once,
    forget_lets_a_delivered_key_be_queued_again,
    each_destination_is_an_entry_of_its_own,
);
