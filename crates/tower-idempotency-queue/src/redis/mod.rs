//! [`RedisStreamsQueue`]: a queue shared by many instances, on Redis Streams.
//!
//! The queue itself is here; each change it makes is one Lua script
//! (`scripts`), atomic on the server.

mod scripts;

use self::scripts::{
    ACK, BREAKER_STATE, BREAKER_VOTE, DEAD, DELETE_DEAD, FETCH, FORGET, INGEST, PARK, PRUNE, RENEW,
    RENEW_SLOT, REPLAY, RETRY, SETTLE_PROBE, TAKE_PROBE, TAKE_SLOT, TAKE_TURN, WAKE,
};
use crate::attempts::{dead_letter, History};
use crate::worker::breaker::{FAILURE_PER_MILLE, MAX_SHARED_VOTES, WINDOW};
use crate::{
    BreakerRule, BreakerState, DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError,
    QueueErrorKind, QueueStats, Reseal, SharedPacing,
};
use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{IntoConnectionInfo, Value};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A queue on Redis Streams, shared by every instance that names it.
///
/// Entries live in the stream `{name}:s`, read through the consumer group
/// `workers` (each instance is one consumer). An entry is acknowledged
/// (`XACK`, then deleted) only after its delivery succeeded; an entry whose
/// worker died is reclaimed (`XAUTOCLAIM`, its scan going on from where
/// the last fetch's stopped, kept in `{name}:ac`) once its lease ran out,
/// however many live entries are pending ahead of it; a failed
/// one waits out its backoff in `{name}:r` (a sorted set) and is appended
/// again when due; one that failed too often moves to the dead-letter stream
/// `{name}:d`. Each key has a marker `{name}:k:<key>` (its fingerprint),
/// set by the same script that appends the entry, so 7 copies make one entry;
/// it expires one window after delivery, or when [`forget`](Queue::forget)
/// deletes it. Every key of a queue shares the
/// hash tag `{name}`, so the queue works on a Redis Cluster too (one slot).
///
/// Give every worker of a queue the same [lease](crate::Worker::lease): an
/// entry is reclaimed once it has been idle for the lease of the worker that
/// reclaims it (Redis keeps the idle time, not the lease it was fetched with).
///
/// An acknowledgement after [`ingest`](Queue::ingest) is only as durable as
/// Redis is: run it with AOF and `appendfsync always` (or `everysec`,
/// accepting up to one second of loss), and a replica.
///
/// Order groups ([`Message::order`]) are not enforced by this queue yet:
/// use the embedded queue where several events of one transaction must be
/// delivered in order.
pub struct RedisStreamsQueue<C = ConnectionManager> {
    conn: C,
    name: Arc<str>,
    consumer: Arc<str>,
    window: Duration,
    replicas: u32,
}

impl<C: Clone> Clone for RedisStreamsQueue<C> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            name: self.name.clone(),
            consumer: self.consumer.clone(),
            window: self.window,
            replicas: self.replicas,
        }
    }
}

impl<C> fmt::Debug for RedisStreamsQueue<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamsQueue")
            .field("name", &self.name)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

const GROUP: &str = "workers";

/// The most parked entries one script wakes: a few milliseconds of
/// Redis's time.
const WAKE_STEP: usize = 256;

/// How long [`RedisStreamsQueue::replicas`] waits for the replicas (`WAIT`
/// blocks the connection it runs on: kept short).
const REPLICA_WAIT: Duration = Duration::from_millis(250);

/// One stream entry as `XRANGE` answers it: its id and its fields.
type StreamEntry = (String, HashMap<String, Value>);

crate::common::backend_errors!("redis queue");

use crate::common::{ms_of, now_ms, time_of};

impl RedisStreamsQueue<ConnectionManager> {
    /// Connects to a standalone Redis and opens (or creates) the queue `name`.
    pub async fn standalone(url: impl IntoConnectionInfo, name: &str) -> Result<Self, QueueError> {
        let client = ::redis::Client::open(url).map_err(err)?;
        let conn = ConnectionManager::new(client).await.map_err(err)?;
        Self::open(conn, name).await
    }
}

impl<C> RedisStreamsQueue<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Opens (or creates) the queue `name` over a connection you built (a
    /// Cluster connection, TLS, auth). This instance joins the consumer
    /// group under a fresh consumer name.
    pub async fn open(conn: C, name: &str) -> Result<Self, QueueError> {
        let queue = Self {
            conn,
            name: Arc::from(name),
            consumer: Arc::from(format!(
                "c-{:032x}",
                tower_idempotency::store::OwnerToken::new().as_u128()
            )),
            window: Duration::from_secs(25 * 3600),
            replicas: 0,
        };
        let mut conn = queue.conn.clone();
        let created: Result<(), _> = ::redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(queue.key("s"))
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => return Err(err(e)),
            _ => {}
        }
        // The consumers of earlier runs (each run joins under a fresh
        // name): those holding no entry are removed, so that names do not
        // pile up across restarts. A live instance's consumer is created
        // again by its next read; one holding entries keeps them until
        // another instance reclaims them.
        let _: i64 = PRUNE
            .key(queue.key("s"))
            .arg(GROUP)
            .invoke_async(&mut conn)
            .await
            .map_err(err)?;
        Ok(queue)
    }

    /// Answers [`ingest`](Queue::ingest) only once `replicas` replicas hold
    /// the entry (Redis `WAIT`, up to 250 ms; fewer is an error, and the
    /// sender gets the failure reply and retries). Defaults to 0: an
    /// acknowledgement is then as durable as the master alone (its AOF
    /// setting), and a failover to a replica that had not received the
    /// entry loses it.
    pub fn replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// How long a delivered key is remembered. Defaults to 25 hours.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Moves the dead letter `id` back into the stream, as `message` (its
    /// own bytes when empty).
    async fn replay_as(&self, id: &EntryId, message: Vec<u8>) -> Result<bool, QueueError> {
        let got: i64 = REPLAY
            .key(self.key("d"))
            .key(self.key("s"))
            .arg(id.as_str())
            .arg(now_ms())
            .arg(message)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(got == 1)
    }

    fn key(&self, part: &str) -> String {
        format!("{{{}}}:{part}", self.name)
    }

    /// The hash of the entries parked under `prefix`.
    fn parked_under(&self, prefix: &str) -> String {
        format!("{{{}}}:park:{prefix}", self.name)
    }

    /// The order of the entries parked under `prefix` (a sorted set).
    fn parked_order(&self, prefix: &str) -> String {
        format!("{{{}}}:parko:{prefix}", self.name)
    }

    fn marker(&self, key: &str) -> String {
        format!("{{{}}}:k:{key}", self.name)
    }

    /// The keys of a lane's shared breaker: its state, its probes, its
    /// votes and its failed votes.
    fn breaker_keys(&self, lane: &str) -> [String; 4] {
        ["brk", "brkp", "brkv", "brkf"].map(|part| self.key(&format!("{part}:{lane}")))
    }
}

/// A shared breaker script's answer (see the scripts), `probe` the id of
/// the probe it was asked for.
fn breaker_of(code: i64, probe: u64) -> BreakerState {
    match code {
        0 => BreakerState::Closed,
        -1 => BreakerState::HalfOpen,
        -2 => BreakerState::ProbesOut,
        -3 => BreakerState::Probe(probe),
        n => BreakerState::Open(Duration::from_millis(n.unsigned_abs())),
    }
}

/// A duration in whole milliseconds, at least 1.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A fresh id, unique across instances (an owner token's low half counts
/// up).
fn unique_id() -> u64 {
    let t = tower_idempotency::store::OwnerToken::new().as_u128();
    (t >> 64) as u64 ^ t as u64
}

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn number(v: &Value) -> u64 {
    bytes(v)
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn text(v: &Value) -> String {
    bytes(v)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

impl<C> Queue for RedisStreamsQueue<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        let fp = message.fingerprint.to_bytes();
        let got: Value = INGEST
            .key(self.key("s"))
            .key(self.marker(&message.key))
            .arg(&fp[..])
            .arg(message.encode())
            .arg(now_ms())
            .arg(if self.replicas > 0 { "1" } else { "0" })
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        let got = match got {
            Value::Int(1) => Ingested::Duplicate,
            Value::Int(_) => return Ok(Ingested::Mismatch),
            id => Ingested::Queued(EntryId::new(text(&id))),
        };
        // A duplicate's success reply promises the entry another instance
        // queued: the script rewrote the key's marker, and replication is one
        // ordered stream, so this `WAIT` covers that entry too.
        if self.replicas > 0 {
            let acked: u32 = ::redis::cmd("WAIT")
                .arg(self.replicas)
                .arg(REPLICA_WAIT.as_millis() as u64)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(err)?;
            if acked < self.replicas {
                return Err(fail(
                    QueueErrorKind::Timeout,
                    format_args!(
                        "{acked} of {} replicas hold the entry after {REPLICA_WAIT:?}",
                        self.replicas
                    ),
                ));
            }
        }
        Ok(got)
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        let got: Vec<Value> = FETCH
            .key(self.key("s"))
            .key(self.key("r"))
            .key(self.key("rh"))
            .key(self.key("ac"))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(max.max(1))
            .arg(lease.as_millis() as u64)
            .arg(now_ms())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        let mut out = Vec::with_capacity(got.len() / 5);
        for e in got.chunks_exact(5) {
            let id = text(&e[0]);
            let attempt = number(&e[2]) as u32;
            let Some(message) = bytes(&e[1]).and_then(Message::decode) else {
                // Added by another version or by hand: set aside with its
                // reason, and the others delivered.
                let history = text(&e[4]);
                self.bury_unreadable(&id, bytes(&e[1]).unwrap_or_default(), attempt, &history)
                    .await?;
                continue;
            };
            out.push(Delivery {
                id: EntryId::new(id),
                message,
                attempt,
                enqueued_at: time_of(number(&e[3])),
                lease: 0,
                history: Some(text(&e[4]).into()).filter(|h: &Arc<str>| !h.is_empty()),
            });
        }
        Ok(out)
    }

    async fn renew(&self, delivery: &Delivery, _lease: Duration) -> Result<bool, QueueError> {
        // Redis keeps the idle time, not a lease: reset to zero, the entry
        // is reclaimed one (reclaiming worker's) lease from now.
        let got: i64 = RENEW
            .key(self.key("s"))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(delivery.id.as_str())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(got == 1)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        let got: i64 = ACK
            .key(self.key("s"))
            .key(self.marker(&delivery.message.key))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(delivery.id.as_str())
            .arg(self.window.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(got == 1)
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        let history = History::record(
            delivery.history.as_deref(),
            delivery.attempt,
            SystemTime::now(),
            error,
        );
        self.back_off(delivery, after, delivery.attempt, &history)
            .await
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        _error: &str,
    ) -> Result<bool, QueueError> {
        let history = delivery.history.as_deref().unwrap_or_default();
        self.back_off(delivery, after, delivery.attempt.saturating_sub(1), history)
            .await
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        let got: i64 = DEAD
            .key(self.key("s"))
            .key(self.key("d"))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(delivery.id.as_str())
            .arg(delivery.message.encode())
            .arg(delivery.attempt)
            .arg(error)
            .arg(now_ms())
            .arg(History::record(
                delivery.history.as_deref(),
                delivery.attempt,
                SystemTime::now(),
                error,
            ))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(got == 1)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let rows: Vec<StreamEntry> = ::redis::cmd("XRANGE")
            .arg(self.key("d"))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(limit.max(1))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(rows.into_iter().map(dead_letter_of).collect())
    }

    async fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        // `(ID` starts after ID (exclusive); a stream id is all Redis takes.
        let start = match after {
            None => "-".to_owned(),
            Some(a) if is_stream_id(a.as_str()) => format!("({a}"),
            Some(_) => {
                return Err(fail(
                    QueueErrorKind::Invalid,
                    "not a dead letter id of this queue",
                ))
            }
        };
        let rows: Vec<StreamEntry> = ::redis::cmd("XRANGE")
            .arg(self.key("d"))
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(limit.max(1))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(rows.into_iter().take(limit).map(dead_letter_of).collect())
    }

    async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        if !is_stream_id(id.as_str()) {
            return Ok(None);
        }
        let rows: Vec<StreamEntry> = ::redis::cmd("XRANGE")
            .arg(self.key("d"))
            .arg(id.as_str())
            .arg(id.as_str())
            .query_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(rows.into_iter().next().map(dead_letter_of))
    }

    async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        let Some(letter) = self.find_dead(id).await? else {
            return Ok(None);
        };
        let got: i64 = DELETE_DEAD
            .key(self.key("d"))
            .key(self.marker(&letter.message.key))
            .arg(id.as_str())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok((got == 1).then_some(letter))
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        self.replay_as(id, Vec::new()).await
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        crate::seal::replay_each(self, &|_| None).await
    }

    async fn replay_with(&self, id: &EntryId, reseal: &Reseal) -> Result<bool, QueueError> {
        if !is_stream_id(id.as_str()) {
            return Ok(false);
        }
        // A letter's row never changes: what was read is what the script
        // moves.
        let letter = self.find_dead(id).await?;
        let resealed = (letter.and_then(|l| reseal(&l.message)))
            .map(|m| m.encode())
            .unwrap_or_default();
        self.replay_as(id, resealed).await
    }

    async fn replay_all_with(&self, reseal: &Reseal) -> Result<usize, QueueError> {
        crate::seal::replay_each(self, reseal).await
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        let (live, delayed, dead, first, parked): (u64, u64, u64, Vec<StreamEntry>, Option<i64>) =
            ::redis::pipe()
                .cmd("XLEN")
                .arg(self.key("s"))
                .cmd("ZCARD")
                .arg(self.key("r"))
                .cmd("XLEN")
                .arg(self.key("d"))
                .cmd("XRANGE")
                .arg(self.key("s"))
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1)
                .cmd("GET")
                .arg(self.key("parked"))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(err)?;
        // The oldest entry in the stream; entries backing off or parked are
        // older still, but only counted.
        let oldest = first.first().and_then(|(_, f)| f.get("t")).map(number);
        let parked = u64::try_from(parked.unwrap_or(0)).unwrap_or(0);
        Ok(crate::stats::counted(live + delayed + parked, dead, oldest))
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
        let got: i64 = FORGET
            .key(self.marker(key))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        match got {
            -1 => Err(QueueError::new(
                QueueErrorKind::Conflict,
                "still queued: delivered when due (or dead-lettered: replay it from the dead letters instead)",
            )),
            n => Ok(n == 1),
        }
    }
}

/// Slots, turns and the breaker are kept in Redis, beside the stream, by
/// Lua scripts (one atomic step each).
impl<C> SharedPacing for RedisStreamsQueue<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        let slot = unique_id();
        let got: i64 = TAKE_SLOT
            .key(self.key(&format!("slots:{lane}")))
            .arg(limit)
            .arg(lease.as_millis().max(1) as u64)
            .arg(slot)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok((got == 1).then_some(slot))
    }

    async fn renew_slot(&self, lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
        let _: i64 = RENEW_SLOT
            .key(self.key(&format!("slots:{lane}")))
            .arg(lease.as_millis().max(1) as u64)
            .arg(slot)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn give_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        let _: i64 = ::redis::cmd("ZREM")
            .arg(self.key(&format!("slots:{lane}")))
            .arg(slot)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        let wait: u64 = TAKE_TURN
            .key(self.key(&format!("turn:{lane}")))
            .arg(interval.as_millis().max(1) as u64)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok((wait > 0).then(|| Duration::from_millis(wait)))
    }

    async fn breaker_state(&self, lane: &str) -> Result<Option<BreakerState>, QueueError> {
        let [state, ..] = self.breaker_keys(lane);
        let got: i64 = BREAKER_STATE
            .key(state)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(Some(breaker_of(got, 0)))
    }

    async fn breaker_vote(
        &self,
        lane: &str,
        entry: u64,
        ok: bool,
        rule: BreakerRule,
    ) -> Result<Option<BreakerState>, QueueError> {
        let got: i64 = BREAKER_VOTE
            .key(&self.breaker_keys(lane)[..])
            .arg(entry)
            .arg(u8::from(ok))
            .arg(rule.failures.max(1))
            .arg(ms(rule.cooldown))
            .arg(ms(WINDOW))
            .arg(MAX_SHARED_VOTES)
            .arg(FAILURE_PER_MILLE)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(Some(breaker_of(got, 0)))
    }

    async fn take_probe(
        &self,
        lane: &str,
        rule: BreakerRule,
        lease: Duration,
    ) -> Result<Option<BreakerState>, QueueError> {
        let [state, probes, ..] = self.breaker_keys(lane);
        let probe = unique_id();
        let got: i64 = TAKE_PROBE
            .key(state)
            .key(probes)
            .arg(rule.probes.max(1))
            .arg(ms(lease))
            .arg(probe)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(Some(breaker_of(got, probe)))
    }

    async fn renew_probe(&self, lane: &str, probe: u64, lease: Duration) -> Result<(), QueueError> {
        let [_, probes, ..] = self.breaker_keys(lane);
        let _: i64 = RENEW_SLOT
            .key(probes)
            .arg(ms(lease))
            .arg(probe)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn settle_probe(
        &self,
        lane: &str,
        probe: u64,
        up: Option<bool>,
        fresh: bool,
        rule: BreakerRule,
    ) -> Result<Option<BreakerState>, QueueError> {
        let result: i8 = match up {
            Some(true) => 1,
            Some(false) => 0,
            None => -1,
        };
        let got: i64 = SETTLE_PROBE
            .key(&self.breaker_keys(lane)[..])
            .arg(probe)
            .arg(result)
            .arg(u8::from(fresh))
            .arg(rule.probes.max(1))
            .arg(ms(rule.cooldown))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(Some(breaker_of(got, 0)))
    }
}

impl<C> RedisStreamsQueue<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Moves an entry this version cannot read to the dead letters.
    async fn bury_unreadable(
        &self,
        id: &str,
        raw: &[u8],
        attempt: u32,
        history: &str,
    ) -> Result<(), QueueError> {
        let why = "undecodable entry: not a message this version can read";
        crate::log_warn!(entry = %id, "{why}; dead-lettered");
        let _: i64 = DEAD
            .key(self.key("s"))
            .key(self.key("d"))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(id)
            .arg(raw)
            .arg(attempt)
            .arg(why)
            .arg(now_ms())
            .arg(History::record(
                Some(history),
                attempt,
                SystemTime::now(),
                why,
            ))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(())
    }

    /// Moves a leased entry to the backoff set, due after `after`, with
    /// `attempts` and its failed attempts' `history` recorded.
    async fn back_off(
        &self,
        delivery: &Delivery,
        after: Duration,
        attempts: u32,
        history: &str,
    ) -> Result<bool, QueueError> {
        let enqueued = ms_of(delivery.enqueued_at);
        let got: i64 = RETRY
            .key(self.key("s"))
            .key(self.key("r"))
            .key(self.key("rh"))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(delivery.id.as_str())
            .arg(now_ms() + after.as_millis() as u64)
            .arg(delivery.message.encode())
            .arg(attempts)
            .arg(enqueued)
            .arg(history)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(got == 1)
    }
}

impl<C> crate::Park for RedisStreamsQueue<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn park(&self, delivery: &Delivery, prefix: &str) -> Result<Option<bool>, QueueError> {
        let enqueued = ms_of(delivery.enqueued_at);
        let got: i64 = PARK
            .key(self.key("s"))
            .key(self.parked_under(prefix))
            .key(self.key("parked-prefixes"))
            .key(self.key("parked"))
            .key(self.parked_order(prefix))
            .arg(GROUP)
            .arg(&*self.consumer)
            .arg(delivery.id.as_str())
            .arg(delivery.message.encode())
            .arg(delivery.attempt.saturating_sub(1))
            .arg(enqueued)
            .arg(delivery.history.as_deref().unwrap_or_default())
            .arg(prefix)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(err)?;
        Ok(Some(got == 1))
    }

    /// Wakes the entries parked under `prefix` in steps of at most
    /// `WAKE_STEP`, so that Redis answers other clients in between.
    async fn wake(&self, prefix: &str) -> Result<u64, QueueError> {
        let mut woken = 0;
        loop {
            let (n, more): (u64, u8) = WAKE
                .key(self.key("s"))
                .key(self.parked_under(prefix))
                .key(self.key("parked-prefixes"))
                .key(self.key("parked"))
                .key(self.parked_order(prefix))
                .arg(prefix)
                .arg(WAKE_STEP)
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(err)?;
            woken += n;
            if more == 0 {
                return Ok(woken);
            }
        }
    }

    async fn parked(&self) -> Result<Vec<String>, QueueError> {
        ::redis::cmd("SMEMBERS")
            .arg(self.key("parked-prefixes"))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(err)
    }
}

/// A row of the dead-letter stream as a dead letter.
fn dead_letter_of((id, f): StreamEntry) -> DeadLetter {
    let nil = Value::Nil;
    let field = |k: &str| f.get(k).unwrap_or(&nil);
    let raw = bytes(field("m")).unwrap_or_default();
    let history = bytes(field("h")).and_then(|h| std::str::from_utf8(h).ok());
    dead_letter(
        EntryId::new(&*id),
        Message::decode(raw).unwrap_or_else(|| Message::undecodable(&id, raw)),
        number(field("a")) as u32,
        text(field("e")),
        time_of(number(field("at"))),
        history,
    )
}

/// Whether `id` reads as a stream id (`MS-SEQ`), so that Redis takes it.
fn is_stream_id(id: &str) -> bool {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    !ms.is_empty()
        && !seq.is_empty()
        && ms.bytes().all(|b| b.is_ascii_digit())
        && seq.bytes().all(|b| b.is_ascii_digit())
        && ms.len() <= 20
        && seq.len() <= 20
}
