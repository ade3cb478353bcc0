//! [`Queue`] for [`Either`]: a program that picks its queue at run time.
//!
//! ```
//! use either::Either;
//! use tower_idempotency_queue::{Ingested, Message, MemoryQueue, Queue};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // A memory queue here; `Either::Right(RedbQueue::open(path)?)` when a
//! // flag asks for the durable one.
//! let queue: Either<MemoryQueue, MemoryQueue> = Either::Left(MemoryQueue::new());
//! let got = queue.ingest(Message::new("k", Fingerprint::of(b"1"), "x")).await.unwrap();
//! assert!(matches!(got, Ingested::Queued(_)));
//! assert_eq!(queue.stats().await.unwrap().depth, 1);
//! # }
//! ```

use super::{
    BreakerRule, BreakerState, DeadLetter, Delivery, EntryId, Ingested, Message, Queue, QueueError,
    QueueStats, Reseal, SharedPacing,
};
use ::either::Either;
use std::time::Duration;

macro_rules! both {
    ($self:ident, $q:ident => $call:expr) => {
        match $self {
            Either::Left($q) => $call.await,
            Either::Right($q) => $call.await,
        }
    };
}

impl<A: Queue, B: Queue> Queue for Either<A, B> {
    async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
        both!(self, q => q.ingest(message))
    }

    async fn fetch(&self, max: usize, lease: Duration) -> Result<Vec<Delivery>, QueueError> {
        both!(self, q => q.fetch(max, lease))
    }

    async fn renew(&self, delivery: &Delivery, lease: Duration) -> Result<bool, QueueError> {
        both!(self, q => q.renew(delivery, lease))
    }

    async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
        both!(self, q => q.ack(delivery))
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        both!(self, q => q.retry(delivery, after, error))
    }

    async fn postpone(
        &self,
        delivery: &Delivery,
        after: Duration,
        error: &str,
    ) -> Result<bool, QueueError> {
        both!(self, q => q.postpone(delivery, after, error))
    }

    async fn dead_letter(&self, delivery: &Delivery, error: &str) -> Result<bool, QueueError> {
        both!(self, q => q.dead_letter(delivery, error))
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        both!(self, q => q.dead_letters(limit))
    }

    async fn dead_page(
        &self,
        after: Option<&EntryId>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        both!(self, q => q.dead_page(after, limit))
    }

    async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        both!(self, q => q.find_dead(id))
    }

    async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
        both!(self, q => q.delete_dead(id))
    }

    async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
        both!(self, q => q.replay(id))
    }

    async fn replay_all(&self) -> Result<usize, QueueError> {
        both!(self, q => q.replay_all())
    }

    async fn replay_with(&self, id: &EntryId, reseal: &Reseal) -> Result<bool, QueueError> {
        both!(self, q => q.replay_with(id, reseal))
    }

    async fn replay_all_with(&self, reseal: &Reseal) -> Result<usize, QueueError> {
        both!(self, q => q.replay_all_with(reseal))
    }

    async fn stats(&self) -> Result<QueueStats, QueueError> {
        both!(self, q => q.stats())
    }

    async fn forget(&self, key: &str) -> Result<bool, QueueError> {
        both!(self, q => q.forget(key))
    }
}

impl<A: SharedPacing, B: SharedPacing> SharedPacing for Either<A, B> {
    async fn take_slot(
        &self,
        lane: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Option<u64>, QueueError> {
        both!(self, q => q.take_slot(lane, limit, lease))
    }

    async fn renew_slot(&self, lane: &str, slot: u64, lease: Duration) -> Result<(), QueueError> {
        both!(self, q => q.renew_slot(lane, slot, lease))
    }

    async fn give_slot(&self, lane: &str, slot: u64) -> Result<(), QueueError> {
        both!(self, q => q.give_slot(lane, slot))
    }

    async fn take_turn(
        &self,
        lane: &str,
        interval: Duration,
    ) -> Result<Option<Duration>, QueueError> {
        both!(self, q => q.take_turn(lane, interval))
    }

    async fn breaker_state(&self, lane: &str) -> Result<Option<BreakerState>, QueueError> {
        both!(self, q => q.breaker_state(lane))
    }

    async fn breaker_vote(
        &self,
        lane: &str,
        entry: u64,
        ok: bool,
        rule: BreakerRule,
    ) -> Result<Option<BreakerState>, QueueError> {
        both!(self, q => q.breaker_vote(lane, entry, ok, rule))
    }

    async fn take_probe(
        &self,
        lane: &str,
        rule: BreakerRule,
        lease: Duration,
    ) -> Result<Option<BreakerState>, QueueError> {
        both!(self, q => q.take_probe(lane, rule, lease))
    }

    async fn renew_probe(&self, lane: &str, probe: u64, lease: Duration) -> Result<(), QueueError> {
        both!(self, q => q.renew_probe(lane, probe, lease))
    }

    async fn settle_probe(
        &self,
        lane: &str,
        probe: u64,
        up: Option<bool>,
        fresh: bool,
        rule: BreakerRule,
    ) -> Result<Option<BreakerState>, QueueError> {
        both!(self, q => q.settle_probe(lane, probe, up, fresh, rule))
    }
}

impl<A: super::Park, B: super::Park> super::Park for Either<A, B> {
    async fn park(&self, delivery: &Delivery, prefix: &str) -> Result<Option<bool>, QueueError> {
        both!(self, q => q.park(delivery, prefix))
    }

    async fn wake(&self, prefix: &str) -> Result<u64, QueueError> {
        both!(self, q => q.wake(prefix))
    }

    async fn parked(&self) -> Result<Vec<String>, QueueError> {
        both!(self, q => q.parked())
    }
}
