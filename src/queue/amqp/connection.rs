//! The link to the broker: one connection and its channels, the queues
//! declared on every connect, and publishing with publisher confirms.

use super::super::{Message, QueueError};
use super::{
    delay::{MAX_DELAY, MIN_DELAY},
    err, AmqpQueue,
};
use crate::store::Store;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One connection and its channels.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) conn: Arc<Connection>,
    /// Publishes in confirm mode.
    pub(super) publish: Channel,
    /// Consumes entries (`basic.consume`) and acknowledges them.
    pub(super) take: Channel,
    /// Which connection this is: a delivery taken on another one can no
    /// longer be acknowledged (the broker gave it back when that closed).
    pub(super) generation: u64,
}

impl Link {
    pub(super) fn usable(&self) -> bool {
        self.conn.status().connected()
            && self.publish.status().connected()
            && self.take.status().connected()
    }
}

pub(super) fn string(v: impl Into<String>) -> ShortString {
    ShortString::from(v.into())
}

pub(super) fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args
}

pub(super) fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

pub(super) fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    p.headers().as_ref()?.inner().get(name)
}

pub(super) fn header_u64(p: &BasicProperties, name: &str) -> Option<u64> {
    match header(p, name)? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}

pub(super) fn header_text(p: &BasicProperties, name: &str) -> String {
    match header(p, name) {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
        _ => String::new(),
    }
}

/// What a publish carries besides the message.
pub(super) struct Envelope<'a> {
    pub(super) id: String,
    pub(super) attempts: u32,
    pub(super) error: Option<&'a str>,
    pub(super) enqueued_ms: u64,
    pub(super) dead_at: Option<u64>,
}

impl<S: Store> AmqpQueue<S> {
    /// The live connection, connecting (and declaring the queues) when
    /// there is none or it broke.
    pub(super) async fn link(&self) -> Result<Link, QueueError> {
        let mut slot = self.inner.link.lock().await;
        if let Some(link) = slot.as_ref().filter(|l| l.usable()) {
            return Ok(link.clone());
        }
        if let Some(old) = slot.take() {
            let _ = old.conn.close(200, "reconnecting".into()).await;
        }
        let conn = Connection::connect(&self.inner.uri, ConnectionProperties::default())
            .await
            .map_err(err)?;
        let publish = conn.create_channel().await.map_err(err)?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(err)?;
        let take = conn.create_channel().await.map_err(err)?;
        self.declare(&publish).await?;
        let link = Link {
            conn: Arc::new(conn),
            publish,
            take,
            generation: self.inner.generations.fetch_add(1, Ordering::Relaxed) + 1,
        };
        // What the old connection held, the broker handed out again.
        self.inner
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, h| h.generation == link.generation);
        *slot = Some(link.clone());
        Ok(link)
    }

    /// Forgets a broken connection, so that the next call connects again.
    pub(super) async fn broken(&self, link: &Link) {
        let mut slot = self.inner.link.lock().await;
        if slot
            .as_ref()
            .is_some_and(|l| l.generation == link.generation)
        {
            *slot = None;
        }
    }

    pub(super) async fn declare(&self, ch: &Channel) -> Result<(), QueueError> {
        let name = &self.inner.name;
        ch.exchange_declare(
            string(self.dlx()),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(err)?;
        ch.queue_declare(string(self.dead_queue()), durable(), quorum())
            .await
            .map_err(err)?;
        ch.queue_bind(
            string(self.dead_queue()),
            string(self.dlx()),
            string(name.clone()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(err)?;
        let mut main = quorum();
        main.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(self.dlx())),
        );
        ch.queue_declare(string(name.clone()), durable(), main)
            .await
            .map_err(err)?;
        for exp in MIN_DELAY..=MAX_DELAY {
            let ms = 1u64 << exp;
            let mut args = quorum();
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms as i64));
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(LongString::from("")),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(LongString::from(name.as_str())),
            );
            // Moved back into the queue at-least-once (a duplicate at
            // worst, which the consumer runs once), never dropped.
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString(LongString::from("at-least-once")),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString(LongString::from("reject-publish")),
            );
            ch.queue_declare(string(self.delay_queue(ms)), durable(), args)
                .await
                .map_err(err)?;
        }
        Ok(())
    }

    /// Publishes `message` to `exchange`/`routing_key` and waits for the
    /// broker's confirm.
    pub(super) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        env: Envelope<'_>,
    ) -> Result<(), QueueError> {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-attempts".into(),
            AMQPValue::LongLongInt(i64::from(env.attempts)),
        );
        headers.insert(
            "x-enqueued-ms".into(),
            AMQPValue::LongLongInt(env.enqueued_ms as i64),
        );
        headers.insert(
            "x-idempotency-key".into(),
            AMQPValue::LongString(LongString::from(message.key.as_str())),
        );
        if let Some(e) = env.error {
            headers.insert(
                "x-last-error".into(),
                AMQPValue::LongString(LongString::from(e)),
            );
        }
        if let Some(at) = env.dead_at {
            headers.insert("x-dead-at-ms".into(), AMQPValue::LongLongInt(at as i64));
        }
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(string(env.id))
            .with_timestamp(env.enqueued_ms / 1000)
            .with_headers(headers);
        let link = self.link().await?;
        let sent = async {
            link.publish
                .basic_publish(
                    string(exchange),
                    string(routing_key),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.encode(),
                    props,
                )
                .await?
                .await
        }
        .await;
        match sent {
            Ok(lapin::Confirmation::Ack(None)) => Ok(()),
            Ok(lapin::Confirmation::Ack(Some(_))) => Err(err(format!(
                "the broker could not route the entry to `{routing_key}`"
            ))),
            Ok(other) => Err(err(format!(
                "the broker did not confirm the entry: {other:?}"
            ))),
            Err(e) => {
                self.broken(&link).await;
                Err(err(e))
            }
        }
    }
}
