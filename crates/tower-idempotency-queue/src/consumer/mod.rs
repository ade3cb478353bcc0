//! Run a handler once per message key for a subscription of a broker users
//! already run, settling each message as its handler's result says: the
//! same guarantee as [`Consumer`](tower_idempotency::consumer::Consumer)
//! (an atomic claim, a renewed lease, nothing recorded on a failure), on
//! RabbitMQ ([`AmqpConsumer`], feature `amqp`) and NATS JetStream
//! ([`JetStreamConsumer`], feature `nats`).

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "nats")]
mod jetstream;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use amqp::{gateway_entry, AmqpConsumer, AmqpMessage, Handled};
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use jetstream::JetStreamConsumer;
