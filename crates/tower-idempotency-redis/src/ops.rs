//! The [`Store`] operations of [`RedisStore`]: one script call each.

use super::scripts::{
    fence_key, in_flight_value, millis, owner_bytes, position_key, Undo, ADVANCE, CLAIM, COMPLETE,
    FENCE_MARGIN, FORGET, INSPECT, IN_FLIGHT, IN_FLIGHT_LEN, OWNER_LEN, RELEASE, RENEW, REPLACE,
    TAKE_TOKEN, TOKEN_TAKEN, TOKEN_VALUE,
};
use super::{corrupt, map_err, RedisStore};
use bytes::Bytes;
use redis::aio::ConnectionLike;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tower_idempotency_core::store::codec::{decode, encode};
use tower_idempotency_core::store::{
    Advance, Claim, CompletedRecord, Forgotten, OwnerToken, Ownership, Position, RecordState,
    Store, StoreError, Watch,
};
use tower_idempotency_core::Fingerprint;

impl<C> Store for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn claim(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, true).await
    }

    /// As [`claim`](Self::claim); a key in flight starts no poller.
    async fn claim_unwatched(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_in(key, fingerprint, token, lease, false).await
    }

    async fn complete(
        &self,
        key: &str,
        token: OwnerToken,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let value = encode(&record);
        let mut conn = self.conn.clone();
        let forgets = self.forgets.load(Ordering::Acquire);
        let done: i64 = COMPLETE
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .arg(value)
            .arg(millis(window))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("complete", e))?;
        if done == 1 {
            // A forget that ran meanwhile may have deleted this record in
            // Redis already: no local copy then.
            if let Some(local) = &self.local {
                self.keep_locally(local, &key, &record, window, forgets);
            }
            self.wake_local_waiters(&key);
        }
        Ok(done == 1)
    }

    async fn renew(
        &self,
        key: &str,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let done: i64 = RENEW
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .arg(millis(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("renew", e))?;
        Ok(done == 1)
    }

    async fn release(&self, key: &str, token: OwnerToken) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let done: i64 = RELEASE
            .key(&key)
            .arg(&owner_bytes(token)[..])
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("release", e))?;
        if done == 1 {
            self.wake_local_waiters(&key);
        }
        Ok(done == 1)
    }

    /// `SET key PX ttl`: one command.
    async fn put_token(&self, key: &str, ttl: Duration) -> Result<(), StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        redis::cmd("SET")
            .arg(&key)
            .arg(TOKEN_VALUE)
            .arg("PX")
            .arg(millis(ttl))
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| map_err("put_token", e))
    }

    /// One script: marks the token taken by `owner` (keeping its expiry).
    /// Of concurrent takes exactly one sees `1`; an expired token is
    /// already gone. Needs Redis 6 or newer (`KEEPTTL`).
    async fn take_token(&self, key: &str, owner: OwnerToken) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let mut taken_by = TOKEN_TAKEN.to_vec();
        taken_by.extend_from_slice(&owner.as_u128().to_be_bytes());
        let taken: i64 = TAKE_TOKEN
            .key(&key)
            .arg(TOKEN_VALUE)
            .arg(taken_by)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("take_token", e))?;
        Ok(taken == 1)
    }

    /// One script: the value and its time to live. The local tier is not
    /// consulted: this shows what every instance would find.
    async fn inspect(&self, key: &str) -> Result<RecordState, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        let found: redis::Value = INSPECT
            .key(&key)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("inspect", e))?;
        let (value, ttl) = match found {
            redis::Value::Nil => return Ok(RecordState::Absent),
            redis::Value::Array(mut parts) if parts.len() == 2 => {
                match (parts.swap_remove(0), parts.swap_remove(0)) {
                    (redis::Value::BulkString(v), redis::Value::Int(ttl)) => (v, ttl),
                    _ => return Err(corrupt("inspect answer of an unexpected shape")),
                }
            }
            other => return Err(corrupt(format_args!("inspect answered {other:?}"))),
        };
        let left = Duration::from_millis(u64::try_from(ttl).unwrap_or(0));
        match value.first() {
            // The fence (decimal) may follow the fingerprint.
            Some(&IN_FLIGHT) if value.len() >= IN_FLIGHT_LEN => {
                let mut fp = [0u8; 16];
                fp.copy_from_slice(&value[OWNER_LEN..IN_FLIGHT_LEN]);
                Ok(RecordState::InFlight {
                    fingerprint: Fingerprint::from_bytes(fp),
                    // The claim's time is not stored in Redis.
                    age: None,
                    lease_left: left,
                })
            }
            Some(&IN_FLIGHT) => Err(corrupt(format_args!(
                "in-flight value of {} bytes",
                value.len()
            ))),
            // A client token, not a record.
            Some(b'~') => Ok(RecordState::Absent),
            _ => Ok(RecordState::Completed {
                record: Arc::new(decode(&Bytes::from(value))?),
                left,
            }),
        }
    }

    /// One script: deletes a completed record, never a claim; then this
    /// instance's local tier forgets it too (and a completion or claim that
    /// ran meanwhile copies nothing into it). Other instances' local tiers
    /// keep their copy until its window ends: forget on each of them, or
    /// run them without a local tier.
    async fn forget(&self, key: &str) -> Result<Forgotten, StoreError> {
        let key = self.full_key(key);
        let mut conn = self.conn.clone();
        // Odd while a forget runs: a claim or completion that copies a
        // record into the local tier meanwhile takes its copy out again.
        self.forgets.fetch_add(1, Ordering::AcqRel);
        let done: Result<i64, _> = FORGET.key(&key).invoke_async(&mut conn).await;
        let local = self.local.as_ref().is_some_and(|local| local.remove(&key));
        self.forgets.fetch_add(1, Ordering::AcqRel);
        let done = done.map_err(|e| map_err("forget", e))?;
        Ok(match done {
            1 => Forgotten::Deleted,
            -1 => Forgotten::InFlight,
            _ if local => Forgotten::Deleted,
            _ => Forgotten::Absent,
        })
    }

    /// One script: a compare-and-set of the object's position (its own key,
    /// beside the records), never through the local tier.
    async fn advance(
        &self,
        object: &str,
        position: Position,
        ttl: Duration,
    ) -> Result<Advance, StoreError> {
        let key = position_key(self.full_key(object));
        let mut conn = self.conn.clone();
        let done: redis::Value = ADVANCE
            .key(&key)
            .arg(position.encode())
            .arg(millis(ttl))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("advance", e))?;
        match done {
            redis::Value::Int(1) => Ok(Advance::Moved),
            redis::Value::BulkString(kept) => Ok(Advance::Behind(read_position(&kept)?)),
            other => Err(corrupt(format_args!("advance answered {other:?}"))),
        }
    }

    /// `GET`: one command.
    async fn position(&self, object: &str) -> Result<Option<Position>, StoreError> {
        let key = position_key(self.full_key(object));
        let mut conn = self.conn.clone();
        let kept: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .map_err(|e| map_err("position", e))?;
        kept.map(|k| read_position(&k)).transpose()
    }

    /// One script: replaces a completed record, never a claim; this
    /// instance's local tier drops its copy (as for a forget), so that it
    /// reads the new one. Other instances' local tiers keep the old record
    /// until its window ends.
    async fn replace(
        &self,
        key: &str,
        record: Arc<CompletedRecord>,
        window: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.full_key(key);
        let value = encode(&record);
        let mut conn = self.conn.clone();
        self.forgets.fetch_add(1, Ordering::AcqRel);
        let done: Result<i64, _> = REPLACE
            .key(&key)
            .arg(value)
            .arg(millis(window))
            .invoke_async(&mut conn)
            .await;
        if let Some(local) = &self.local {
            local.remove(&key);
        }
        self.forgets.fetch_add(1, Ordering::AcqRel);
        Ok(done.map_err(|e| map_err("replace", e))? == 1)
    }
}

impl<C> RedisStore<C> {
    /// Copies a completed record into the local tier, unless a `forget` ran
    /// since `forgets` was read (the count of [`forget`](Store::forget)s
    /// begun and ended, read before the script that found the record): the
    /// record may be the one it deleted.
    fn keep_locally(
        &self,
        local: &tower_idempotency_core::store::CompletedCache,
        key: &str,
        record: &Arc<CompletedRecord>,
        ttl: Duration,
        forgets: u64,
    ) {
        if !forgets.is_multiple_of(2) {
            return;
        }
        local.insert(key, record, ttl);
        if self.forgets.load(Ordering::Acquire) != forgets {
            local.remove(key);
        }
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A claim; `watched`: a key in flight gets this instance's shared
    /// poller.
    async fn claim_in(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        token: OwnerToken,
        lease: Duration,
        watched: bool,
    ) -> Result<Claim, StoreError> {
        self.check_epoch_soon();
        let key = self.full_key(key);
        if let Some(record) = self.local.as_ref().and_then(|local| local.get(&key)) {
            return Ok(Claim::Completed(record));
        }
        let mut conn = self.conn.clone();
        // If this call is cancelled (the layer's store timeout) or fails after
        // the script may have run, nobody would own the claim it may have
        // made: release it, so it does not block the key for a whole lease.
        let mut undo = Undo(Some((self.conn.clone(), key.clone(), owner_bytes(token))));
        let forgets = self.forgets.load(Ordering::Acquire);
        let found: redis::Value = CLAIM
            .key(&key)
            .key(fence_key(&key))
            .arg(&in_flight_value(token, fingerprint)[..])
            .arg(millis(lease))
            .arg(millis(lease.saturating_add(FENCE_MARGIN)))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err("claim", e))?;
        undo.0 = None;
        let found = match found {
            redis::Value::Int(fence) => {
                let fence = u64::try_from(fence).unwrap_or(0);
                return Ok(Claim::Acquired(Ownership::new(token, fence)));
            }
            redis::Value::BulkString(found) => found,
            redis::Value::Array(mut parts) if parts.len() == 2 => {
                let (redis::Value::BulkString(found), redis::Value::Int(ttl)) =
                    (parts.swap_remove(0), parts.swap_remove(0))
                else {
                    return Err(corrupt("claim answer of an unexpected shape"));
                };
                let record = Arc::new(decode(&Bytes::from(found))?);
                if let (Some(local), Ok(ttl)) = (&self.local, u64::try_from(ttl)) {
                    self.keep_locally(local, &key, &record, Duration::from_millis(ttl), forgets);
                }
                return Ok(Claim::Completed(record));
            }
            other => return Err(corrupt(format_args!("claim answered {other:?}"))),
        };
        match found.first() {
            Some(&IN_FLIGHT) if found.len() == IN_FLIGHT_LEN => {
                let mut owner = [0u8; OWNER_LEN];
                owner.copy_from_slice(&found[..OWNER_LEN]);
                let mut fp = [0u8; 16];
                fp.copy_from_slice(&found[OWNER_LEN..]);
                Ok(Claim::InFlight {
                    fingerprint: Fingerprint::from_bytes(fp),
                    watch: match watched {
                        true => self.watch(key, owner),
                        false => Watch::poll(self.poll_interval),
                    },
                })
            }
            Some(&IN_FLIGHT) => Err(corrupt(format_args!(
                "in-flight value of {} bytes",
                found.len()
            ))),
            _ => Ok(Claim::Completed(Arc::new(decode(&Bytes::from(found))?))),
        }
    }
}

/// A position as the store keeps it.
fn read_position(kept: &[u8]) -> Result<Position, StoreError> {
    std::str::from_utf8(kept)
        .ok()
        .and_then(Position::decode)
        .ok_or_else(|| corrupt("unreadable position"))
}
