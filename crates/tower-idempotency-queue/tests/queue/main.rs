//! Acknowledge then deliver: the queues (embedded, Redis Streams, RabbitMQ, NATS JetStream), the worker, pacing and the consumers.

mod amqp_dead;
mod backend;
mod conformance;
mod consumer;
mod queue;
mod queue_group_commit;
mod queue_headers;
mod queue_redis_promise;
mod worker_destinations;
mod worker_pace;
mod worker_pace_cost;
mod worker_pace_stall;
mod worker_promise;

/// The upstream's failure in these tests.
#[derive(Debug)]
struct Down;

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("upstream down")
    }
}

/// Retried, as a handler's failure is unless it says otherwise.
impl tower_idempotency::consumer::Failure for Down {}
