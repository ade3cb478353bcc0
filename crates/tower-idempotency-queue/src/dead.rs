//! Dead letters in the embedded queue: moving a delivery that failed for
//! good to the `dead` table, listing it, and replaying it as a new entry.

use super::embedded::{Embedded, DEAD, EXPIRY, KEYS};
use super::records::{decode_dead, err, queue_now, Marker};
use super::{DeadLetter, Delivery, QueueError};
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
        let message = Self::remove(txn, id)?.ok_or_else(|| err("entry without message"))?;
        Self::bury(txn, id, s.attempts, error, &message)?;
        // The key stays marked (as live): a copy arriving now is a duplicate.
        Ok(true)
    }

    /// Writes the dead letter `id` (the live entry is already removed).
    pub(super) fn bury(
        txn: &WriteTransaction,
        id: u64,
        attempts: u32,
        error: &str,
        message: &[u8],
    ) -> Result<(), QueueError> {
        let mut record = Vec::with_capacity(16 + error.len() + message.len());
        record.extend_from_slice(&attempts.to_le_bytes());
        record.extend_from_slice(&queue_now(txn)?.to_le_bytes());
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
        let mut out = Vec::new();
        for row in dead.iter().map_err(err)?.take(limit) {
            let (id, value) = row.map_err(err)?;
            out.push(decode_dead(id.value(), value.value())?);
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
        let mut out = Vec::new();
        for row in dead.range(start..).map_err(err)?.take(limit) {
            let (id, value) = row.map_err(err)?;
            out.push(decode_dead(id.value(), value.value())?);
        }
        Ok(out)
    }

    pub(super) fn find_dead(&self, id: u64) -> Result<Option<DeadLetter>, QueueError> {
        let txn = self.db.get()?.begin_read().map_err(err)?;
        let dead = txn.open_table(DEAD).map_err(err)?;
        let row = dead.get(id).map_err(err)?;
        row.map(|v| decode_dead(id, v.value())).transpose()
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
        let letter = decode_dead(id, &record)?;
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

    pub(super) fn replay(txn: &WriteTransaction, id: u64) -> Result<bool, QueueError> {
        let record = txn
            .open_table(DEAD)
            .map_err(err)?
            .remove(id)
            .map_err(err)?
            .map(|v| v.value().to_vec());
        let Some(record) = record else {
            return Ok(false);
        };
        let letter = decode_dead(id, &record)?;
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
            n += usize::from(Self::replay(txn, id)?);
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
}
