//! Acknowledge then deliver: the queues (embedded, Redis Streams, RabbitMQ, NATS JetStream), the worker, pacing and the consumers.

mod consumer;
mod queue;
mod queue_group_commit;
mod queue_redis_promise;
mod worker_pace;
mod worker_promise;
