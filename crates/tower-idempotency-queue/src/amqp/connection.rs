//! The link to the broker: one connection and its channels, the queues
//! declared on every connect, and publishing with publisher confirms (an
//! entry's properties are `entry`'s).

use super::super::{Message, QueueError, QueueErrorKind};
use super::entry::Envelope;
use super::{
    delay::{MAX_DELAY, MIN_DELAY},
    err, fail, AmqpQueue,
};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_idempotency::store::Store;

/// The longest one exchange with the broker may take: a publish and its
/// confirm, an acknowledgement, a declare. The broker answers in
/// milliseconds. Past it the caller gets a retryable error and the
/// connection is forgotten (the next call connects again), so a broker, or a
/// connection, that stops answering holds no request, delivery or fetch for
/// longer. Below the claim an ingest holds while it publishes (10 s): a
/// publish that ran out gives its key back before another copy may take the
/// key over.
pub(super) const EXCHANGE_LIMIT: Duration = Duration::from_secs(5);

/// The longest connecting may take: TCP (or TLS), the AMQP handshake, the
/// two channels, every declare and the dead-letter log's on a channel of
/// its own, two dozen round trips.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// How long after a failed connect callers get its error without trying
/// again themselves.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Who connects, and the last connect that failed (when, why): held by
/// the one caller that connects while the others wait for it.
#[derive(Default)]
pub(super) struct Slot {
    failed: Option<(Instant, String)>,
}

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

    /// Why this connection is not handed out again (`stalled`: the newest
    /// generation found broken), for the log.
    fn unusable_because(&self, stalled: u64) -> &'static str {
        if !self.conn.status().connected() {
            "the connection closed"
        } else if !self.publish.status().connected() {
            "the publishing channel closed"
        } else if !self.take.status().connected() {
            "the consuming channel closed"
        } else if self.generation <= stalled {
            "an exchange on it failed or went unanswered"
        } else {
            "unknown"
        }
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

/// The arguments of a stream: an append-only log, read from an offset
/// without taking what is read.
pub(super) fn stream() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("stream")),
    );
    args
}

pub(super) fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

impl<S: Store> AmqpQueue<S> {
    /// The live connection, connecting (and declaring the queues) when
    /// there is none or it broke.
    ///
    /// A live connection is handed out without waiting: only connecting
    /// takes the lock. (Every publish taking it, as it once did, made a
    /// convoy in a storm: each caller handed the lock to the next through
    /// the next one's serving thread, busy with hundreds of connections,
    /// until the last of 500 copies had waited 5 s for a connection that
    /// was up all along.)
    ///
    /// Bounded: a caller waits for another's connect at most
    /// [`EXCHANGE_LIMIT`], a connect takes at most [`CONNECT_LIMIT`], and
    /// for [`RECONNECT_PAUSE`] after a failed connect callers get its error
    /// at once, so callers piling up while the broker does not answer do not
    /// each wait for a connect of their own, one after the other.
    pub(super) async fn link(&self) -> Result<Link, QueueError> {
        if let Some(link) = self.live() {
            return Ok(link);
        }
        let mut slot = tokio::time::timeout(EXCHANGE_LIMIT, self.inner.link.lock())
            .await
            .map_err(|_| fail(QueueErrorKind::Timeout, "still connecting to the broker"))?;
        // Connected by the caller this one waited for.
        if let Some(link) = self.live() {
            return Ok(link);
        }
        if let Some((at, why)) = &slot.failed
            && at.elapsed() < RECONNECT_PAUSE
        {
            return Err(fail(
                QueueErrorKind::Unavailable,
                format_args!("not connected: {why}"),
            ));
        }
        let stalled = self.inner.stalled.load(Ordering::Relaxed);
        let old = self
            .inner
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(old) = old {
            let _why = old.unusable_because(stalled);
            crate::log_warn!(queue = %self.inner.name, generation = old.generation, why = _why, "connecting to the broker again");
            // Closed aside: a connection that stopped answering is dropped
            // all the same once the limit passes.
            tokio::spawn(async move {
                let closing = old.conn.close(200, "reconnecting".into());
                let _ = tokio::time::timeout(EXCHANGE_LIMIT, closing).await;
            });
        }
        let connecting = async {
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
            self.declare_dead_log(&conn).await;
            Ok::<_, QueueError>((conn, publish, take))
        };
        let connected = tokio::time::timeout(CONNECT_LIMIT, connecting)
            .await
            .unwrap_or_else(|_| {
                Err(fail(
                    QueueErrorKind::Timeout,
                    format_args!("connecting took longer than {CONNECT_LIMIT:?}"),
                ))
            });
        let (conn, publish, take) = match connected {
            Ok(connected) => connected,
            Err(e) => {
                slot.failed = Some((Instant::now(), e.to_string()));
                return Err(e);
            }
        };
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
        slot.failed = None;
        *self.inner.live.lock().unwrap_or_else(|e| e.into_inner()) = Some(link.clone());
        Ok(link)
    }

    /// The connection, when it is up and no exchange on it went wrong.
    fn live(&self) -> Option<Link> {
        let stalled = self.inner.stalled.load(Ordering::Relaxed);
        self.inner
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|l| l.usable() && l.generation > stalled)
            .cloned()
    }

    /// Forgets a broken connection (`generation`, [`Link::generation`]), so
    /// that the next call connects again. It waits for nothing (not for a
    /// connect under way): a caller that found the broker silent answers at
    /// once.
    pub(super) fn broken(&self, generation: u64) {
        self.inner.stalled.fetch_max(generation, Ordering::Relaxed);
    }

    /// `exchange`, one round trip with the broker on the connection
    /// `generation`, within [`EXCHANGE_LIMIT`]; `what` names it in the
    /// error. No answer in time: that connection is forgotten, so the next
    /// call connects again.
    pub(super) async fn bounded<T, E: std::error::Error + Send + Sync + 'static>(
        &self,
        generation: u64,
        what: &str,
        exchange: impl Future<Output = Result<T, E>>,
    ) -> Result<T, QueueError> {
        match tokio::time::timeout(EXCHANGE_LIMIT, exchange).await {
            Ok(answer) => {
                answer.map_err(|e| QueueError::backend(format_args!("amqp queue: {what}"), e))
            }
            Err(_) => {
                self.broken(generation);
                Err(fail(
                    QueueErrorKind::Timeout,
                    format_args!("the broker did not answer {what} within {EXCHANGE_LIMIT:?}"),
                ))
            }
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

    /// Declares the dead-letter log and binds it to the dead-letter
    /// exchange, on a channel of its own. A failure is logged, not the
    /// connect's: entries are queued and delivered while the log cannot be
    /// reached (a stream the broker has not started again), and what needs
    /// the log (burying an entry, which then goes back to the queue;
    /// listing, replaying) answers the broker's error meanwhile.
    async fn declare_dead_log(&self, conn: &Connection) {
        let declared = async {
            let ch = conn.create_channel().await?;
            ch.queue_declare(string(self.dead_log()), durable(), stream())
                .await?;
            ch.queue_bind(
                string(self.dead_log()),
                string(self.dlx()),
                string(self.inner.name.clone()),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
            ch.close(200, "declared".into()).await
        }
        .await;
        if let Err(_e) = declared {
            crate::log_warn!(queue = %self.inner.name, error = %_e, "amqp queue: the dead-letter log could not be declared");
        }
    }

    /// An acknowledgement (`ack`) on the connection `generation`, bounded
    /// like every exchange, as a result: lapin answers `Ok(false)`, not an
    /// error, when the channel closed under the delivery (the broker hands
    /// it out again), and that is no acknowledgement.
    pub(super) async fn settled(
        &self,
        generation: u64,
        ack: impl std::future::Future<Output = lapin::Result<bool>>,
    ) -> Result<(), QueueError> {
        match self.bounded(generation, "an acknowledgement", ack).await? {
            true => Ok(()),
            false => Err(fail(
                QueueErrorKind::Unavailable,
                "the channel closed before the broker was told",
            )),
        }
    }

    /// Gives `acker`'s delivery back to the queue, bounded like every
    /// exchange; a failure leaves it to the broker (it hands the delivery
    /// out again once the connection closes).
    pub(super) async fn give_back_one(&self, generation: u64, acker: &lapin::Acker) {
        let _ = self
            .bounded(
                generation,
                "a negative acknowledgement",
                acker.nack(super::requeue()),
            )
            .await;
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
        self.publish_with(exchange, routing_key, message, env, FieldTable::default())
            .await
    }

    /// [`publish`](Self::publish) with `headers` of the caller's besides.
    pub(super) async fn publish_with(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Message,
        env: Envelope<'_>,
        headers: FieldTable,
    ) -> Result<(), QueueError> {
        let props = super::entry::properties(message, env, headers);
        self.publish_raw(exchange, routing_key, &message.encode(), props)
            .await
    }

    /// Publishes `body` with `props` as they are to `exchange`/`routing_key`
    /// and waits for the broker's confirm.
    pub(super) async fn publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: lapin::BasicProperties,
    ) -> Result<(), QueueError> {
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
                    body,
                    props,
                )
                .await?
                .await
        };
        let confirmed = self.bounded(link.generation, "a publish", sent).await;
        if confirmed.is_err() {
            self.broken(link.generation);
        }
        match confirmed? {
            lapin::Confirmation::Ack(None) => Ok(()),
            lapin::Confirmation::Ack(Some(_)) => Err(fail(
                QueueErrorKind::Other,
                format_args!("the broker could not route the entry to `{routing_key}`"),
            )),
            // Nacked: the broker could not store it now.
            other => Err(fail(
                QueueErrorKind::Unavailable,
                format_args!("the broker did not confirm the entry: {other:?}"),
            )),
        }
    }
}
