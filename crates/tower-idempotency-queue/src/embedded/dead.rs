//! Dead letters in the embedded queue: moving a delivery that failed for
//! good to the `dead` table, listing it, and replaying it as a new entry.

use super::records::{decode_dead, err, fail, queue_now, Marker};
use super::store::{Embedded, DEAD, DEAD_ATTEMPTS, EXPIRY, KEYS};
use crate::attempts::History;
use crate::common::time_of;
use crate::{DeadLetter, Delivery, Message, QueueError, QueueErrorKind};
use redb::{ReadableTable, WriteTransaction};

impl Embedded {
    pub(super) fn dead_letter(
        txn: &WriteTransaction,
        delivery: &Delivery,
        error: &str,
    ) -> Result<bool, QueueError> {
        let Some((id, s)) = Self::leased(txn, delivery)? else {
            return Ok(false);
        };
        let history = Self::history(txn, id)?;
        let message = Self::remove(txn, id)?
            .ok_or_else(|| fail(QueueErrorKind::Corrupt, "entry without message"))?;
        Self::bury(txn, id, s.attempts, error, &message, history.as_deref())?;
        // The key stays marked (as live): a copy arriving now is a duplicate.
        Ok(true)
    }

    /// Writes the dead letter `id` (the live entry is already removed),
    /// its `history` (as stored) with this last attempt added.
    pub(super) fn bury(
        txn: &WriteTransaction,
        id: u64,
        attempts: u32,
        error: &str,
        message: &[u8],
        history: Option<&str>,
    ) -> Result<(), QueueError> {
        let now = queue_now(txn)?;
        let line = History::record(history, attempts, time_of(now), error);
        txn.open_table(DEAD_ATTEMPTS)
            .map_err(err)?
            .insert(id, line.as_str())
            .map_err(err)?;
        let mut record = Vec::with_capacity(16 + error.len() + message.len());
        record.extend_from_slice(&attempts.to_le_bytes());
        record.extend_from_slice(&now.to_le_bytes());
        record.extend_from_slice(&(error.len() as u32).to_le_bytes());
        record.extend_from_slice(error.as_bytes());
        record.extend_from_slice(message);
        txn.open_table(DEAD)
            .map_err(err)?
            .insert(id, record.as_slice())
            .map_err(err)?;
        Ok(())
    }

    pub(super) fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let dead = txn.open_table(DEAD).map_err(err)?;
        let histories = txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
        let mut out = Vec::new();
        for row in dead.iter().map_err(err)?.take(limit) {
            let (id, value) = row.map_err(err)?;
            let history = histories.get(id.value()).map_err(err)?;
            let history = history.as_ref().map(|h| h.value());
            out.push(decode_dead(id.value(), value.value(), history)?);
        }
        Ok(out)
    }

    /// At most `limit` dead letters with an id above `after`, by id.
    pub(super) fn dead_page(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, QueueError> {
        let Some(start) = after.map_or(Some(0), |a| a.checked_add(1)) else {
            return Ok(Vec::new());
        };
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let dead = txn.open_table(DEAD).map_err(err)?;
        let histories = txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
        let mut out = Vec::new();
        for row in dead.range(start..).map_err(err)?.take(limit) {
            let (id, value) = row.map_err(err)?;
            let history = histories.get(id.value()).map_err(err)?;
            let history = history.as_ref().map(|h| h.value());
            out.push(decode_dead(id.value(), value.value(), history)?);
        }
        Ok(out)
    }

    pub(super) fn find_dead(&self, id: u64) -> Result<Option<DeadLetter>, QueueError> {
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let dead = txn.open_table(DEAD).map_err(err)?;
        let histories = txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
        let history = histories.get(id).map_err(err)?;
        let history = history.as_ref().map(|h| h.value());
        let row = dead.get(id).map_err(err)?;
        row.map(|v| decode_dead(id, v.value(), history)).transpose()
    }

    /// Removes the dead letter `id` and its key's marker (when the marker
    /// is still this letter's): a later copy is queued again.
    pub(super) fn delete_dead(
        txn: &WriteTransaction,
        id: u64,
    ) -> Result<Option<DeadLetter>, QueueError> {
        let record = txn
            .open_table(DEAD)
            .map_err(err)?
            .remove(id)
            .map_err(err)?
            .map(|v| v.value().to_vec());
        let Some(record) = record else {
            return Ok(None);
        };
        let history = Self::take_dead_history(txn, id)?;
        let letter = decode_dead(id, &record, history.as_deref())?;
        let key = letter.message.key.as_str();
        let mut keys = txn.open_table(KEYS).map_err(err)?;
        let marker = keys
            .get(key)
            .map_err(err)?
            .and_then(|v| Marker::decode(v.value()));
        if let Some(marker) = marker.filter(|m| m.entry == id) {
            keys.remove(key).map_err(err)?;
            txn.open_table(EXPIRY)
                .map_err(err)?
                .remove((marker.expires, key))
                .map_err(err)?;
        }
        Ok(Some(letter))
    }

    /// Queues the dead letter `id` again as a new entry: its message, or
    /// `message` in its place.
    pub(super) fn replay(
        txn: &WriteTransaction,
        id: u64,
        message: Option<Message>,
    ) -> Result<bool, QueueError> {
        let record = txn
            .open_table(DEAD)
            .map_err(err)?
            .remove(id)
            .map_err(err)?
            .map(|v| v.value().to_vec());
        let Some(record) = record else {
            return Ok(false);
        };
        // Queued again as a new entry: its attempts start afresh.
        Self::take_dead_history(txn, id)?;
        let mut letter = decode_dead(id, &record, None)?;
        if let Some(message) = message {
            letter.message = message;
        }
        let new_id = Self::next_id(txn)?;
        let marker = Marker {
            fingerprint: letter.message.fingerprint.to_bytes(),
            entry: new_id,
            expires: 0,
        };
        txn.open_table(KEYS)
            .map_err(err)?
            .insert(letter.message.key.as_str(), marker.encode().as_slice())
            .map_err(err)?;
        let now = queue_now(txn)?;
        Self::enqueue(txn, new_id, &letter.message, now)?;
        Ok(true)
    }

    /// Removes the history of dead letter `id`: what it was, as stored.
    fn take_dead_history(txn: &WriteTransaction, id: u64) -> Result<Option<String>, QueueError> {
        let mut table = txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
        let row = table.remove(id).map_err(err)?;
        Ok(row.map(|v| v.value().to_owned()))
    }

    pub(super) fn replay_all(txn: &WriteTransaction) -> Result<usize, QueueError> {
        let ids: Vec<u64> = txn
            .open_table(DEAD)
            .map_err(err)?
            .iter()
            .map_err(err)?
            .filter_map(|r| r.ok().map(|(k, _)| k.value()))
            .collect();
        let mut n = 0;
        for id in ids {
            n += usize::from(Self::replay(txn, id, None)?);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use crate::{EntryId, Ingested, MemoryQueue, Message, Queue};
    use std::time::Duration;
    use tower_idempotency::Fingerprint;

    /// Paged after a cursor, found by id, deleted once; a deleted letter's
    /// key is queued again by its next copy, a replayed one's is not.
    #[tokio::test(flavor = "current_thread")]
    async fn dead_letters_paged_found_and_deleted() {
        let q = MemoryQueue::new();
        for key in ["a", "b", "c"] {
            let m = Message::new(key, Fingerprint::of(key.as_bytes()), "{}");
            assert!(matches!(q.ingest(m).await.unwrap(), Ingested::Queued(_)));
        }
        for d in q.fetch(10, Duration::from_secs(30)).await.unwrap() {
            assert!(q.dead_letter(&d, "boom").await.unwrap());
        }
        let first = q.dead_page(None, 2).await.unwrap();
        assert_eq!(first.len(), 2);
        let rest = q.dead_page(Some(&first[1].id), 2).await.unwrap();
        assert_eq!(rest.len(), 1);
        assert!(q.dead_page(Some(&rest[0].id), 2).await.unwrap().is_empty());
        let keys: Vec<String> = first
            .iter()
            .chain(&rest)
            .map(|d| d.message.key.clone())
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
        let b = &first[1];
        assert_eq!(q.find_dead(&b.id).await.unwrap().unwrap().error, "boom");
        assert!(q.find_dead(&EntryId::new("999")).await.unwrap().is_none());
        assert!(q
            .find_dead(&EntryId::new("not-a-number"))
            .await
            .unwrap()
            .is_none());

        // Deleted: gone, once; its key is free again.
        let deleted = q.delete_dead(&b.id).await.unwrap().unwrap();
        assert_eq!(deleted.message.key, "b");
        assert!(q.delete_dead(&b.id).await.unwrap().is_none());
        let again = Message::new("b", Fingerprint::of(b"b"), "{}");
        assert!(matches!(
            q.ingest(again).await.unwrap(),
            Ingested::Queued(_)
        ));
        // Still dead: a copy is a duplicate.
        let copy = Message::new("c", Fingerprint::of(b"c"), "{}");
        assert_eq!(q.ingest(copy).await.unwrap(), Ingested::Duplicate);
        // Replayed, then deleted: nothing to delete.
        assert!(q.replay(&first[0].id).await.unwrap());
        assert!(q.delete_dead(&first[0].id).await.unwrap().is_none());
        assert_eq!(q.stats().await.unwrap().dead, 1);
    }

    /// Each failed attempt is kept with its error, in order; a
    /// postponement is not an attempt; a replay starts afresh.
    #[tokio::test(flavor = "current_thread")]
    async fn a_dead_letter_keeps_each_attempts_error() {
        let q = MemoryQueue::new();
        let m = Message::new("k", Fingerprint::of(b"k"), "{}");
        q.ingest(m).await.unwrap();
        let lease = Duration::from_secs(30);
        for (n, error) in ["first 502", "second timeout", "third 500"]
            .iter()
            .enumerate()
        {
            let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
            if n == 1 {
                assert!(q.postpone(&d, Duration::ZERO, "paused").await.unwrap());
                let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
                assert!(q.retry(&d, Duration::ZERO, error).await.unwrap());
            } else if n == 2 {
                assert!(q.dead_letter(&d, error).await.unwrap());
            } else {
                assert!(q.retry(&d, Duration::ZERO, error).await.unwrap());
            }
        }
        let dead = q.dead_letters(10).await.unwrap().pop().unwrap();
        let got: Vec<(u32, &str)> = dead
            .history
            .iter()
            .map(|a| (a.number, a.error.as_str()))
            .collect();
        assert_eq!(
            got,
            [(1, "first 502"), (2, "second timeout"), (3, "third 500")]
        );
        assert_eq!((dead.attempts, dead.attempts_not_kept), (3, 0));
        assert!(dead.history.windows(2).all(|w| w[0].at <= w[1].at));
        assert_eq!(
            q.find_dead(&dead.id).await.unwrap().unwrap().history,
            dead.history
        );
        // Replayed: a new entry, with no attempts yet.
        assert!(q.replay(&dead.id).await.unwrap());
        let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
        assert!(q.dead_letter(&d, "again").await.unwrap());
        let dead = q.dead_letters(10).await.unwrap().pop().unwrap();
        let got: Vec<(u32, &str)> = dead
            .history
            .iter()
            .map(|a| (a.number, a.error.as_str()))
            .collect();
        assert_eq!(got, [(1, "again")]);
    }

    /// Many attempts with huge errors: the first and the latest are kept,
    /// each error cut short, and the others counted.
    #[tokio::test(flavor = "current_thread")]
    async fn attempts_kept_are_bounded_in_count_and_size() {
        use crate::{MAX_ATTEMPTS_KEPT, MAX_ERROR_LEN};
        let q = MemoryQueue::new();
        q.ingest(Message::new("k", Fingerprint::of(b"k"), "{}"))
            .await
            .unwrap();
        let huge = "x".repeat(400 * 1024);
        let lease = Duration::from_secs(30);
        for n in 1..=60u32 {
            let d = q.fetch(1, lease).await.unwrap().pop().unwrap();
            assert_eq!(d.attempt, n);
            let error = format!("attempt {n} {huge}");
            if n == 60 {
                assert!(q.dead_letter(&d, &error).await.unwrap());
            } else {
                assert!(q.retry(&d, Duration::ZERO, &error).await.unwrap());
            }
        }
        let dead = q.dead_letters(10).await.unwrap().pop().unwrap();
        assert_eq!(dead.history.len(), MAX_ATTEMPTS_KEPT);
        assert_eq!(dead.attempts_not_kept, 60 - MAX_ATTEMPTS_KEPT as u32);
        let numbers: Vec<u32> = dead.history.iter().map(|a| a.number).collect();
        let mut want = vec![1];
        want.extend(60 - MAX_ATTEMPTS_KEPT as u32 + 2..=60);
        assert_eq!(numbers, want);
        for a in &dead.history {
            assert_eq!(a.error.len(), MAX_ERROR_LEN);
            assert!(a.error.starts_with(&format!("attempt {} x", a.number)));
        }
    }

    /// A dead letter written before attempts were kept (its record alone)
    /// shows its last error as its one attempt; a damaged history reads as
    /// none, and the letter is still listed, replayed and deleted.
    #[tokio::test(flavor = "current_thread")]
    async fn an_old_or_damaged_dead_letter_still_reads() {
        use crate::embedded::records::err;
        use crate::embedded::store::{Embedded, DEAD_ATTEMPTS};
        let db = redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .unwrap();
        let q = Embedded::new(db, None, Duration::from_secs(3600)).unwrap();
        for key in ["old", "damaged"] {
            let m = Message::new(key, Fingerprint::of(key.as_bytes()), "{}");
            q.ingest_message(m).await.unwrap();
        }
        let lease = Duration::from_secs(30);
        let taken = q
            .grouped_fetch(move |txn| Embedded::fetch(txn, 2, lease))
            .await
            .unwrap();
        for d in taken.clone() {
            q.grouped(move |txn| Embedded::retry(txn, &d, Duration::ZERO, Some("e1")))
                .await
                .unwrap();
        }
        let taken = q
            .grouped_fetch(move |txn| Embedded::fetch(txn, 2, lease))
            .await
            .unwrap();
        for d in taken {
            let (id, key) = (d.id.as_str().parse::<u64>().unwrap(), d.message.key.clone());
            q.grouped(move |txn| {
                Embedded::dead_letter(txn, &d, "last words")?;
                let mut h = txn.open_table(DEAD_ATTEMPTS).map_err(err)?;
                if key == "old" {
                    // As the earlier version wrote it: no history row.
                    h.remove(id).map_err(err)?;
                } else {
                    h.insert(id, "1;0;99@x=<script>").map_err(err)?;
                }
                Ok(())
            })
            .await
            .unwrap();
        }
        let letters = q.dead_letters(10).unwrap();
        assert_eq!(letters.len(), 2);
        for l in &letters {
            assert_eq!(l.history.len(), 1, "{l:?}");
            assert_eq!(l.history[0].error, "last words");
            assert_eq!(l.history[0].number, 2);
            assert_eq!(l.history[0].at, l.dead_at);
            assert_eq!(l.attempts_not_kept, 1);
        }
        let old = letters[0].id.as_str().parse::<u64>().unwrap();
        assert!(q.find_dead(old).unwrap().is_some());
        let damaged = letters[1].id.as_str().parse::<u64>().unwrap();
        let gone = q
            .grouped(move |txn| Embedded::delete_dead(txn, damaged))
            .await
            .unwrap();
        assert_eq!(gone.unwrap().message.key, "damaged");
        assert!(q
            .grouped(move |txn| Embedded::replay(txn, old, None))
            .await
            .unwrap());
    }
}
