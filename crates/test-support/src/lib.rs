//! What the workspace's tests share: real servers on loopback ports (hyper,
//! `redis-server`, PostgreSQL and MariaDB, RabbitMQ, NATS JetStream), each
//! started by the test that needs it and killed when it ends, the channels'
//! signed vectors, the channel scenarios, and a store that injects faults.
//! Not published.

// Test helpers: a `Debug` for each would be code nobody reads.
#![allow(missing_debug_implementations)]

pub mod common;
pub mod support_nats;
pub mod support_rabbitmq;
pub mod support_redis;
pub mod support_sql;
pub mod verify_support;
