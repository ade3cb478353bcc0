//! The [`Queue`](crate::Queue) impl shared by the queues over
//! [`Embedded`](super::store::Embedded): every change goes through its
//! group commit.

/// Implements [`Queue`](crate::Queue) for a newtype over [`Embedded`].
macro_rules! embedded_queue {
    ($ty:ty) => {
        impl $crate::Queue for $ty {
            async fn ingest(&self, message: Message) -> Result<Ingested, QueueError> {
                self.inner.ingest_message(message).await
            }

            async fn fetch(
                &self,
                max: usize,
                lease: Duration,
            ) -> Result<Vec<Delivery>, QueueError> {
                self.inner
                    .grouped_fetch(move |txn| Embedded::fetch(txn, max, lease))
                    .await
            }

            async fn renew(
                &self,
                delivery: &Delivery,
                lease: Duration,
            ) -> Result<bool, QueueError> {
                let d = delivery.clone();
                self.inner
                    .grouped(move |txn| Embedded::renew(txn, &d, lease))
                    .await
            }

            async fn ack(&self, delivery: &Delivery) -> Result<bool, QueueError> {
                let (d, window) = (delivery.clone(), self.inner.window());
                self.inner
                    .grouped(move |txn| Embedded::ack(txn, &d, window))
                    .await
            }

            async fn retry(
                &self,
                delivery: &Delivery,
                after: Duration,
                error: &str,
            ) -> Result<bool, QueueError> {
                let (d, error) = (delivery.clone(), error.to_owned());
                self.inner
                    .grouped(move |txn| Embedded::retry(txn, &d, after, Some(&error)))
                    .await
            }

            async fn postpone(
                &self,
                delivery: &Delivery,
                after: Duration,
                _error: &str,
            ) -> Result<bool, QueueError> {
                let d = delivery.clone();
                self.inner
                    .grouped(move |txn| Embedded::retry(txn, &d, after, None))
                    .await
            }

            async fn dead_letter(
                &self,
                delivery: &Delivery,
                error: &str,
            ) -> Result<bool, QueueError> {
                let (d, error) = (delivery.clone(), error.to_owned());
                self.inner
                    .grouped(move |txn| Embedded::dead_letter(txn, &d, &error))
                    .await
            }

            async fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
                let q = self.inner.clone();
                tokio::task::spawn_blocking(move || q.dead_letters(limit))
                    .await
                    .map_err(|e| QueueError::backend("embedded queue", e))?
            }

            async fn dead_page(
                &self,
                after: Option<&EntryId>,
                limit: usize,
            ) -> Result<Vec<DeadLetter>, QueueError> {
                // An id that is no number of this queue's comes before all.
                let after = after.map(|a| a.as_str().parse::<u64>().unwrap_or(0));
                let q = self.inner.clone();
                tokio::task::spawn_blocking(move || q.dead_page(after, limit))
                    .await
                    .map_err(|e| QueueError::backend("embedded queue", e))?
            }

            async fn find_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
                let Ok(id) = id.as_str().parse::<u64>() else {
                    return Ok(None);
                };
                let q = self.inner.clone();
                tokio::task::spawn_blocking(move || q.find_dead(id))
                    .await
                    .map_err(|e| QueueError::backend("embedded queue", e))?
            }

            async fn delete_dead(&self, id: &EntryId) -> Result<Option<DeadLetter>, QueueError> {
                let Ok(id) = id.as_str().parse::<u64>() else {
                    return Ok(None);
                };
                self.inner
                    .grouped(move |txn| Embedded::delete_dead(txn, id))
                    .await
            }

            async fn replay(&self, id: &EntryId) -> Result<bool, QueueError> {
                let Ok(id) = id.as_str().parse::<u64>() else {
                    return Ok(false);
                };
                self.inner
                    .grouped(move |txn| Embedded::replay(txn, id, None))
                    .await
            }

            async fn replay_all(&self) -> Result<usize, QueueError> {
                self.inner.grouped(Embedded::replay_all).await
            }

            async fn replay_with(
                &self,
                id: &EntryId,
                reseal: &$crate::Reseal,
            ) -> Result<bool, QueueError> {
                let Some(letter) = <Self as $crate::Queue>::find_dead(self, id).await? else {
                    return Ok(false);
                };
                let Ok(id) = id.as_str().parse::<u64>() else {
                    return Ok(false);
                };
                // A letter's record never changes: what was read is what
                // the replay removes.
                let message = reseal(&letter.message);
                self.inner
                    .grouped(move |txn| Embedded::replay(txn, id, message.clone()))
                    .await
            }

            async fn replay_all_with(&self, reseal: &$crate::Reseal) -> Result<usize, QueueError> {
                $crate::seal::replay_each(self, reseal).await
            }

            async fn stats(&self) -> Result<QueueStats, QueueError> {
                let q = self.inner.clone();
                tokio::task::spawn_blocking(move || q.stats())
                    .await
                    .map_err(|e| QueueError::backend("embedded queue", e))?
            }

            async fn forget(&self, key: &str) -> Result<bool, QueueError> {
                let key = key.to_owned();
                // A refusal is the change's answer, not its failure: the
                // changes committed with it are kept.
                self.inner
                    .grouped(move |txn| Embedded::forget(txn, &key))
                    .await?
                    .map_err(|why| QueueError::new($crate::QueueErrorKind::Conflict, why))
            }
        }

        impl $crate::Park for $ty {
            fn parks(&self) -> bool {
                true
            }

            async fn park(
                &self,
                delivery: &Delivery,
                prefix: &str,
            ) -> Result<Option<bool>, QueueError> {
                let (d, prefix) = (delivery.clone(), prefix.to_owned());
                self.inner
                    .grouped(move |txn| Embedded::park(txn, &d, &prefix))
                    .await
            }

            async fn wake(&self, prefix: &str) -> Result<u64, QueueError> {
                let prefix = prefix.to_owned();
                self.inner
                    .grouped(move |txn| Embedded::wake(txn, &prefix))
                    .await
            }

            async fn parked(&self) -> Result<Vec<String>, QueueError> {
                let q = self.inner.clone();
                tokio::task::spawn_blocking(move || q.parked())
                    .await
                    .map_err(|e| QueueError::backend("embedded queue", e))?
            }
        }
    };
}
pub(super) use embedded_queue;
