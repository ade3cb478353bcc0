//! The dead-letter log: the stream `NAME.dead-log` that keeps the dead
//! letters and what became of them, and the index of the letters still
//! dead that each instance reads from it.
//!
//! # Why a stream, and an index read from it
//!
//! A quorum queue can only be read by taking its messages: listing one page
//! of its dead letters took every letter and gave it back, so a call cost
//! every letter there, and two calls at once hid letters from each other.
//! A stream is read by offset without taking anything, by any number of
//! readers at once. Every record is appended to it, never changed:
//!
//! - a **letter** (its id is its offset: ids grow in the order letters
//!   died), whether this crate or the broker itself dead-lettered it;
//! - a **settlement**: the letter at an offset was replayed or deleted;
//! - a **mark**: written by a call that must see every record appended
//!   before it began (on any instance), read back once everything before
//!   it was.
//!
//! Each instance reads the stream from its start once, then follows it,
//! and keeps the letters not settled in memory, ordered by offset: a page,
//! a letter shown, replayed or deleted then costs a mark and what it
//! returns, not every letter. The stream is the record of truth; the index
//! is rebuilt from it by every instance that opens the queue.

use super::super::{DeadLetter, QueueError, QueueErrorKind};
use super::connection::string;
use super::entry::{header_text, header_u64};
use super::{fail, fresh_id, AmqpQueue};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_idempotency::store::Store;

/// What a record of the log is, when it is not a letter.
const RECORD_HEADER: &str = "x-dead-record";
/// The token a record's writer waits for the reader to pass.
const TOKEN_HEADER: &str = "x-dead-token";
/// A settlement: the offset of the letter it settles.
const SETTLES_HEADER: &str = "x-dead-settles";
/// A letter moved from an earlier version's dead-letter queue.
pub(super) const MOVED_HEADER: &str = "x-dead-moved";
/// Where a record is in the stream, as the broker delivers it.
const OFFSET_HEADER: &str = "x-stream-offset";

const SETTLE: &str = "settle";
const MARK: &str = "mark";

/// How many records the reader is handed ahead of its acknowledgements.
const PREFETCH: u16 = 500;

/// How long a call waits for the reader to pass its mark (on a fresh
/// instance: to read the whole log once).
const CATCH_UP_LIMIT: Duration = Duration::from_secs(20);

/// The letters not settled, as read from the log so far.
#[derive(Default)]
struct Index {
    /// By offset, with its message id.
    letters: BTreeMap<u64, (String, DeadLetter)>,
    /// The message id of each letter in `letters`: a letter moved from an
    /// earlier version's queue twice (a move cut short) is kept once.
    message_ids: HashMap<String, u64>,
    /// The message ids of every moved letter read, settled or not.
    moved: HashSet<String>,
    /// The offset to read next.
    next: u64,
    /// Whether a mark was read once: every record appended before this
    /// instance first looked is in.
    caught_up: bool,
    /// Writers waiting for their record to be read, by token.
    waiting: HashMap<String, oneshot::Sender<()>>,
}

impl Index {
    fn read(&mut self, offset: u64, d: &lapin::message::Delivery) {
        // Read again after the reader started over: already in.
        if offset < self.next {
            return;
        }
        self.next = offset + 1;
        let p = &d.properties;
        match header_text(p, RECORD_HEADER).as_str() {
            SETTLE => {
                if let Some(o) = header_u64(p, SETTLES_HEADER) {
                    self.settle(o);
                }
            }
            MARK => self.caught_up = true,
            _ => {
                let id = message_id(p);
                // Without a message id, a letter cannot be told from
                // another: each is kept.
                let moved = header_u64(p, MOVED_HEADER).is_some() && !id.is_empty();
                if moved && (self.moved.contains(&id) || self.message_ids.contains_key(&id)) {
                    // Moved twice: kept once.
                } else {
                    if moved {
                        self.moved.insert(id.clone());
                    }
                    let letter = super::dead::letter_at(offset, d);
                    if !id.is_empty() {
                        self.message_ids.insert(id.clone(), offset);
                    }
                    self.letters.insert(offset, (id, letter));
                }
            }
        }
        let token = header_text(p, TOKEN_HEADER);
        if let Some(w) = (!token.is_empty())
            .then(|| self.waiting.remove(&token))
            .flatten()
        {
            let _ = w.send(());
        }
    }

    fn settle(&mut self, offset: u64) -> Option<DeadLetter> {
        let (id, letter) = self.letters.remove(&offset)?;
        if self.message_ids.get(&id) == Some(&offset) {
            self.message_ids.remove(&id);
        }
        Some(letter)
    }
}

fn message_id(p: &BasicProperties) -> String {
    p.message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .unwrap_or_default()
}

/// The reader of the log on one connection.
struct Reader {
    generation: u64,
    task: JoinHandle<()>,
}

/// The index and its reader: one per queue instance.
#[derive(Default)]
pub(super) struct DeadLog {
    index: Arc<Mutex<Index>>,
    reader: tokio::sync::Mutex<Option<Reader>>,
}

impl Drop for DeadLog {
    fn drop(&mut self) {
        if let Some(r) = self.reader.get_mut().take() {
            r.task.abort();
        }
    }
}

impl DeadLog {
    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A record written, whose reading a writer may wait for.
pub(super) struct Awaited {
    token: String,
    read: oneshot::Receiver<()>,
}

impl<S: Store> AmqpQueue<S> {
    /// The stream of dead letters and their settlements.
    pub(super) fn dead_log(&self) -> String {
        format!("{}.dead-log", self.inner.name)
    }

    /// Starts reading the log on the live connection, where the reader
    /// left off, unless it reads there already.
    pub(super) async fn follow_dead_log(&self) -> Result<(), QueueError> {
        let link = self.link().await?;
        let log = &self.inner.dead_log;
        let mut reader = log.reader.lock().await;
        if let Some(r) = &*reader
            && r.generation == link.generation
            && !r.task.is_finished()
        {
            return Ok(());
        }
        if let Some(r) = reader.take() {
            r.task.abort();
        }
        let generation = link.generation;
        let ch = self
            .bounded(generation, "a new channel", link.conn.create_channel())
            .await?;
        let qos = ch.basic_qos(PREFETCH, BasicQosOptions { global: false });
        self.bounded(generation, "a prefetch", qos).await?;
        let next = log.index().next;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongLongInt(i64::try_from(next).unwrap_or(i64::MAX)),
        );
        let consume = ch.basic_consume(
            string(self.dead_log()),
            string(""),
            BasicConsumeOptions::default(),
            args,
        );
        let mut consumer = self.bounded(generation, "a consume", consume).await?;
        let index = log.index.clone();
        let task = tokio::spawn(async move {
            let _ch = ch;
            while let Some(Ok(d)) = consumer.next().await {
                if let Some(offset) = header_u64(&d.properties, OFFSET_HEADER) {
                    index
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .read(offset, &d);
                }
                if d.acker.ack(BasicAckOptions::default()).await.is_err() {
                    break;
                }
            }
            // The connection or the channel closed: those waiting learn it
            // now rather than at their limit.
            index
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .waiting
                .clear();
        });
        *reader = Some(Reader { generation, task });
        Ok(())
    }

    /// A token for a record about to be written, whose reading
    /// [`read_back`](Self::read_back) waits for.
    pub(super) fn awaited(&self) -> Awaited {
        let token = fresh_id();
        let (tx, read) = oneshot::channel();
        self.inner
            .dead_log
            .index()
            .waiting
            .insert(token.clone(), tx);
        Awaited { token, read }
    }

    /// The header that has the reader tell the writer of `awaited`.
    pub(super) fn token_header(headers: &mut FieldTable, awaited: &Awaited) {
        headers.insert(
            TOKEN_HEADER.into(),
            AMQPValue::LongString(LongString::from(awaited.token.as_str())),
        );
    }

    /// Waits (at most `limit`) until the reader read the record of
    /// `awaited`.
    pub(super) async fn read_back(
        &self,
        awaited: Awaited,
        limit: Duration,
    ) -> Result<(), QueueError> {
        let Awaited { token, read } = awaited;
        let got = tokio::time::timeout(limit, read).await;
        self.inner.dead_log.index().waiting.remove(&token);
        match got {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(fail(
                QueueErrorKind::Unavailable,
                "the dead-letter log's reader stopped (the connection closed)",
            )),
            Err(_) => Err(fail(
                QueueErrorKind::Timeout,
                format_args!("the dead letters were not read within {limit:?}"),
            )),
        }
    }

    /// Returns once every record appended to the log before it was called
    /// (by any instance) is in this instance's index: a mark written, and
    /// read back.
    pub(super) async fn catch_up(&self) -> Result<(), QueueError> {
        self.follow_dead_log().await?;
        let awaited = self.awaited();
        let mut headers = FieldTable::default();
        headers.insert(
            RECORD_HEADER.into(),
            AMQPValue::LongString(LongString::from(MARK)),
        );
        Self::token_header(&mut headers, &awaited);
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        if let Err(e) = self.publish_raw("", &self.dead_log(), b"", props).await {
            self.inner.dead_log.index().waiting.remove(&awaited.token);
            return Err(e);
        }
        self.read_back(awaited, CATCH_UP_LIMIT).await
    }

    /// Appends the settlement of the letter at `offset` (replayed or
    /// deleted), and takes it out of this instance's index at once (the
    /// others read it).
    pub(super) async fn settle_letter(&self, offset: u64) -> Result<(), QueueError> {
        let mut headers = FieldTable::default();
        headers.insert(
            RECORD_HEADER.into(),
            AMQPValue::LongString(LongString::from(SETTLE)),
        );
        headers.insert(
            SETTLES_HEADER.into(),
            AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        self.publish_raw("", &self.dead_log(), b"", props).await?;
        self.inner.dead_log.index().settle(offset);
        Ok(())
    }

    /// The letter at `offset`, if it is in the index and not settled.
    pub(super) fn indexed(&self, offset: u64) -> Option<DeadLetter> {
        let index = self.inner.dead_log.index();
        index.letters.get(&offset).map(|(_, l)| l.clone())
    }

    /// At most `limit` letters of the index after offset `after` (from
    /// the first when `None`), by offset.
    pub(super) fn indexed_after(&self, after: Option<u64>, limit: usize) -> Vec<DeadLetter> {
        let index = self.inner.dead_log.index();
        let start = match after {
            None => std::ops::Bound::Unbounded,
            Some(a) => std::ops::Bound::Excluded(a),
        };
        (index.letters.range((start, std::ops::Bound::Unbounded)))
            .take(limit)
            .map(|(_, (_, l))| l.clone())
            .collect()
    }

    /// The offset the reader reads next: every letter read so far is
    /// before it.
    pub(super) fn read_up_to(&self) -> u64 {
        self.inner.dead_log.index().next
    }

    /// How many letters are not settled, once the log was read to where
    /// it stood when this instance first looked.
    pub(super) async fn dead_count(&self) -> Result<u64, QueueError> {
        self.follow_dead_log().await?;
        if !self.inner.dead_log.index().caught_up {
            self.catch_up().await?;
        }
        Ok(self.inner.dead_log.index().letters.len() as u64)
    }
}
