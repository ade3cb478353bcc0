//! An idempotent consumer of the notifications the gateway queued on
//! RabbitMQ: the handler runs once per notification, however many times
//! the broker delivers it (a consumer killed before its `ack`, a copy the
//! gateway queued twice, a dead letter replayed).
//!
//! ```sh
//! # The gateway acknowledges into the queue `gateway` of this broker:
//! gateway --route /wx=wechatpay-v3 --ack-then-deliver /wx \
//!     --queue amqp://guest:guest@127.0.0.1:5672/%2f --store redis://127.0.0.1/ ...
//! # This consumer takes the entries of that queue (beside, or instead of,
//! # the gateway's own delivery over HTTP: each entry goes to one of them):
//! cargo run --example amqp_consumer -- amqp://guest:guest@127.0.0.1:5672/%2f gateway redis://127.0.0.1/
//! ```
//!
//! Arguments: the broker's URL, the queue (default `gateway`), and a Redis
//! URL for the consumer's records (default: in memory, which only this
//! process sees: give every consumer of the queue the same Redis).
//! It prints one line per notification handled, and stops at Ctrl-C.

use lapin::{Connection, ConnectionProperties};
use tower_idempotency::consumer::Consumer;
use tower_idempotency::store::{Either, MemoryStore, Store};
use tower_idempotency_queue::consumer::{gateway_entry, AmqpConsumer, AmqpMessage};
use tower_idempotency_queue::Message;
use tower_idempotency_redis::RedisStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = args.next().unwrap_or_else(|| "gateway".into());
    let store = match args.next() {
        Some(redis) => Either::Right(RedisStore::standalone(redis.as_str()).await?),
        None => Either::Left(MemoryStore::new()),
    };
    let print = |n: &Message, m: &AmqpMessage| {
        println!(
            "handled {} {} ({} bytes, attempts before: {})",
            n.key,
            n.uri,
            n.body.len(),
            m.header("x-attempts").unwrap_or_else(|| "0".into())
        );
    };
    tokio::select! {
        done = consume(&url, &queue, store, print) => done?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// Consumes `queue` on the broker at `url`, its records in `store`, until
/// the connection fails: `handle` runs once per notification the gateway
/// queued, however many times the broker delivers it.
pub async fn consume<S: Store>(
    url: &str,
    queue: &str,
    store: S,
    handle: impl Fn(&Message, &AmqpMessage) + Send + Sync,
) -> Result<(), Box<dyn std::error::Error>> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    let consumer = AmqpConsumer::new(Consumer::new(store).scope("amqp-consumer"), gateway_entry);
    let handle = &handle;
    let handler = |m: AmqpMessage| async move {
        // `gateway_entry` keyed it, so it is one of the gateway's entries.
        let Some(n) = m.queued() else {
            return Err("not a gateway entry");
        };
        // The business effect goes here (credit the order, ship the goods).
        handle(&n, &m);
        Ok(())
    };
    consumer.run(&channel, queue, handler).await?;
    Ok(())
}
