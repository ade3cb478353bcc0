//! The dead letters of an earlier version: kept in the quorum queue
//! `NAME.dead`, moved into the dead-letter log when the queue is opened.

use super::super::QueueError;
use super::connection::string;
use super::dead_log::MOVED_HEADER;
use super::AmqpQueue;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use tower_idempotency::store::Store;

impl<S: Store> AmqpQueue<S> {
    /// The quorum queue an earlier version kept its dead letters in.
    fn old_dead_queue(&self) -> String {
        format!("{}.dead", self.inner.name)
    }

    /// Moves the letters of an earlier version's dead-letter queue into the
    /// log, each once, and deletes that queue once it is empty.
    ///
    /// The queue is first unbound from the dead-letter exchange (nothing
    /// new lands there). Each letter is then taken, appended to the log
    /// (marked moved, its message id kept) and only then acknowledged: an
    /// instance that dies in between leaves the letter in the old queue,
    /// taken again by the next open, and the log's readers keep the first
    /// copy of a message id moved twice. Instances opening at once each
    /// take letters of their own. Nothing is lost, nothing doubled.
    pub(super) async fn move_old_dead_letters(&self) -> Result<(), QueueError> {
        let link = self.link().await?;
        let generation = link.generation;
        let ch = self
            .bounded(generation, "a new channel", link.conn.create_channel())
            .await?;
        let old = self.old_dead_queue();
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = ch.queue_declare(string(old.clone()), passive, FieldTable::default());
        if self
            .bounded(generation, "a declare", declared)
            .await
            .is_err()
        {
            // None there (the broker closed this channel to say so).
            return Ok(());
        }
        let unbind = ch.queue_unbind(
            string(old.clone()),
            string(self.dlx()),
            string(self.inner.name.clone()),
            FieldTable::default(),
        );
        self.bounded(generation, "an unbind", unbind).await?;
        let mut moved = 0u64;
        loop {
            let get = ch.basic_get(string(old.clone()), BasicGetOptions::default());
            let Some(got) = self.bounded(generation, "a get", get).await? else {
                break;
            };
            let d = got.delivery;
            let mut headers = d.properties.headers().clone().unwrap_or_default();
            headers.insert(MOVED_HEADER.into(), AMQPValue::LongLongInt(1));
            let props = d.properties.clone().with_headers(headers);
            self.publish_raw("", &self.dead_log(), &d.data, props)
                .await?;
            self.settled(generation, d.acker.ack(BasicAckOptions::default()))
                .await?;
            moved += 1;
        }
        if moved > 0 {
            crate::log_info!(queue = %self.inner.name, moved, "dead letters moved into the dead-letter log");
        }
        let delete = ch.queue_delete(
            string(old),
            QueueDeleteOptions {
                if_empty: true,
                ..QueueDeleteOptions::default()
            },
        );
        // Not empty (an instance of the earlier version still writes to
        // it): the next open moves what is there.
        let _ = self.bounded(generation, "a delete", delete).await;
        let closing = ch.close(200, "done".into());
        let _ = self.bounded(generation, "a channel's close", closing).await;
        Ok(())
    }
}
