//! [`AmqpConsumer`]: a handler that runs once per message key on a
//! RabbitMQ subscription.

use crate::Message;
use bytes::Bytes;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use std::future::Future;
use std::time::Duration;
use tower_idempotency::consumer::{ConsumeError, Consumer, Once, Receipt};
use tower_idempotency::store::Store;
use tower_idempotency::Fingerprint;

/// One message as the handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AmqpMessage {
    /// The body.
    pub data: Bytes,
    /// Its properties and headers.
    pub properties: BasicProperties,
    /// Whether the broker delivered it before.
    pub redelivered: bool,
}

impl AmqpMessage {
    /// The notification, if this message is an entry the gateway's
    /// [`AmqpQueue`](crate::AmqpQueue) queued.
    pub fn queued(&self) -> Option<Message> {
        Message::decode(&self.data)
    }

    /// A header as text (a string or a number), if it is there: the
    /// gateway's entries carry `x-idempotency-key`, `x-attempts` (failed
    /// attempts before this one), `x-last-error` and `x-enqueued-ms`.
    pub fn header(&self, name: &str) -> Option<String> {
        match self.properties.headers().as_ref()?.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            AMQPValue::LongLongInt(n) => Some(n.to_string()),
            AMQPValue::LongInt(n) => Some(n.to_string()),
            AMQPValue::LongUInt(n) => Some(n.to_string()),
            _ => None,
        }
    }
}

/// The key of an entry the gateway queued (its scoped idempotency key) and
/// its fingerprint; `None` for another message.
pub fn gateway_entry(m: &AmqpMessage) -> Option<(String, Fingerprint)> {
    m.queued().map(|q| (q.key, q.fingerprint))
}

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// The handler ran and succeeded; acknowledged.
    Ran,
    /// An earlier delivery of its key succeeded; acknowledged, the handler
    /// did not run.
    Done,
    /// Not handled now; handed back to the queue for a later delivery.
    Requeued,
    /// Can never succeed; rejected (dead-lettered by the queue's
    /// dead-letter exchange).
    Rejected,
}

/// Runs a handler once per message key on a RabbitMQ subscription.
///
/// RabbitMQ delivers at least once: a consumer that dies before its `ack`
/// gets the message redelivered (to itself or another consumer), a publisher
/// that did not hear its confirm publishes again (another message id, the
/// same content), and a sender's own retries arrive as copies. The key of a
/// message comes from its content (a closure you give, or
/// [`gateway_entry`] for what the gateway queued), never from the broker's
/// message id, so all of these run the handler once, through a
/// [`Consumer`] and its store: the same claim, lease, run limit and failure
/// rules as the HTTP [dedup layer](tower_idempotency::dedup).
///
/// - The handler succeeded (now, or on an earlier delivery of the key):
///   the message is acknowledged.
/// - It failed, panicked, ran past the run limit, or the store failed, or
///   another delivery of the key is running: nothing is recorded, and the
///   message is handed back to the queue after
///   [`retry_after`](AmqpConsumer::retry_after) (`nack` with requeue), so a
///   later delivery runs it again.
/// - It can never succeed (no key, its key reused with another payload, a
///   stored receipt that cannot be read): the message is rejected without
///   requeue, which dead-letters it if the queue has a dead-letter exchange
///   (declare one: without it, RabbitMQ drops it).
/// ```no_run
/// use lapin::{Connection, ConnectionProperties};
/// use tower_idempotency::consumer::Consumer;
/// use tower_idempotency_queue::consumer::{gateway_entry, AmqpConsumer, AmqpMessage};
/// use tower_idempotency_redis::RedisStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = Connection::connect("amqp://app:secret@127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
/// let channel = conn.create_channel().await?;
/// let store = RedisStore::standalone("redis://127.0.0.1/").await?;
/// let consumer = AmqpConsumer::new(Consumer::new(store).scope("credit-points"), gateway_entry);
/// consumer
///     .run(&channel, "gateway", |m: AmqpMessage| async move {
///         let paid = m.queued().expect("a gateway entry");
///         println!("credit for {}", paid.key);
///         Ok::<_, std::io::Error>(())
///     })
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct AmqpConsumer<St, K> {
    consumer: Consumer<St>,
    key: K,
    prefetch: u16,
    retry_after: Duration,
}

impl<St, K> AmqpConsumer<St, K>
where
    St: Store,
    K: Fn(&AmqpMessage) -> Option<(String, Fingerprint)> + Send + Sync,
{
    /// Handles messages through `consumer`, keyed by `key`.
    pub fn new(consumer: Consumer<St>, key: K) -> Self {
        Self {
            consumer,
            key,
            prefetch: 16,
            retry_after: Duration::from_secs(1),
        }
    }

    /// Messages handled at once (the channel's prefetch). Defaults to 16.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// How long a message that was not handled waits before it is handed
    /// back to the queue (so that a failing handler is not called in a
    /// tight loop). Defaults to 1 s.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// Consumes `queue` on `channel` until the subscription ends (the
    /// channel or connection closed: an error), handling each message with
    /// [`handle`](Self::handle).
    pub async fn run<H, F, T, E>(
        &self,
        channel: &Channel,
        queue: &str,
        handler: H,
    ) -> Result<(), lapin::Error>
    where
        H: Fn(AmqpMessage) -> F + Send + Sync,
        F: Future<Output = Result<T, E>> + Send,
        T: Receipt,
        E: std::fmt::Display,
    {
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut failed = None;
        deliveries
            .take_while(|d| {
                let go = d.is_ok();
                if let Err(e) = d {
                    failed = Some(e.clone());
                }
                std::future::ready(go)
            })
            .filter_map(|d| std::future::ready(d.ok()))
            .for_each_concurrent(usize::from(self.prefetch), |d| async {
                let _ = self.handle(d, &handler).await;
            })
            .await;
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Handles one delivery: runs `handler` unless its key already
    /// succeeded, then acknowledges, hands back or rejects it (see the
    /// [type docs](AmqpConsumer)). `Err` if the broker could not be told.
    pub async fn handle<H, F, T, E>(
        &self,
        delivery: lapin::message::Delivery,
        handler: &H,
    ) -> Result<Handled, lapin::Error>
    where
        H: Fn(AmqpMessage) -> F,
        F: Future<Output = Result<T, E>>,
        T: Receipt,
        E: std::fmt::Display,
    {
        let message = AmqpMessage {
            data: Bytes::from(delivery.data),
            properties: delivery.properties,
            redelivered: delivery.redelivered,
        };
        let acker = delivery.acker;
        let got = match (self.key)(&message) {
            None => Err(ConsumeError::<E>::KeyMissing),
            Some((key, fp)) => self.consumer.once(&key, fp, handler(message)).await,
        };
        let handled = match got {
            Ok(Once::Ran(_)) => Handled::Ran,
            Ok(Once::Done(_)) => Handled::Done,
            Err(e) if e.is_retryable() => Handled::Requeued,
            Err(_) => Handled::Rejected,
        };
        // Each answer is bounded as the gateway's queue bounds its own: a
        // broker that stops answering (frozen, a partition) is a failure
        // after [`ACK_LIMIT`], not a handler stuck for ever.
        let told = match handled {
            Handled::Ran | Handled::Done => told(acker.ack(BasicAckOptions::default())).await?,
            Handled::Requeued => {
                tokio::time::sleep(self.retry_after).await;
                told(acker.nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                }))
                .await?
            }
            Handled::Rejected => told(acker.nack(BasicNackOptions::default())).await?,
        };
        if !told {
            // lapin answers `false`, not an error, when the channel closed
            // under the delivery: the broker was not told, and hands it out
            // again (where its key's record makes it a duplicate).
            return Err(lapin::Error::from(std::io::Error::other(
                "the channel closed before the broker was told",
            )));
        }
        Ok(handled)
    }
}

/// How long an acknowledgement (ack or nack) waits for the broker.
const ACK_LIMIT: Duration = Duration::from_secs(5);

/// `ack`, bounded by [`ACK_LIMIT`]: no answer in time is an error (the
/// broker hands the message out again once the channel closes, where its
/// key's record makes it a duplicate).
async fn told(ack: impl Future<Output = Result<bool, lapin::Error>>) -> Result<bool, lapin::Error> {
    match tokio::time::timeout(ACK_LIMIT, ack).await {
        Ok(answer) => answer,
        Err(_) => Err(lapin::Error::from(std::io::Error::other(format!(
            "the broker did not answer the acknowledgement within {ACK_LIMIT:?}"
        )))),
    }
}
