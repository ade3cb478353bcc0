//! The byte layouts of the embedded queue's records.

use crate::attempts::dead_letter;
use crate::common::{now_ms, time_of};
use crate::{DeadLetter, EntryId, Message, QueueError, QueueErrorKind};

crate::common::backend_errors!("embedded queue", pub(super));

/// The queue's clock in a write transaction: the wall clock plus the sum of
/// every step back it was seen to take (kept in `meta`), so that it never
/// runs backwards. Every stored time is on it: a wall clock stepped back
/// by an hour does not delay every leased and backing-off entry by an hour
/// (a step forward only makes entries due early).
pub(super) fn queue_now(txn: &redb::WriteTransaction) -> Result<u64, QueueError> {
    use redb::ReadableTable;
    let mut meta = txn.open_table(super::store::META).map_err(err)?;
    let read = |k: &str| -> Result<u64, QueueError> {
        Ok(meta.get(k).map_err(err)?.map(|v| v.value()).unwrap_or(0))
    };
    let (last, mut skew) = (read("clock")?, read("skew")?);
    let mut now = now_ms().saturating_add(skew);
    if now < last {
        skew += last - now;
        now = last;
        meta.insert("skew", skew).map_err(err)?;
    }
    meta.insert("clock", now).map_err(err)?;
    Ok(now)
}

/// The queue's clock (see [`queue_now`]) in a read transaction.
pub(super) fn queue_now_read(txn: &redb::ReadTransaction) -> Result<u64, QueueError> {
    let meta = txn.open_table(super::store::META).map_err(err)?;
    let get = |k: &str| -> Result<u64, QueueError> {
        Ok(meta.get(k).map_err(err)?.map(|v| v.value()).unwrap_or(0))
    };
    Ok(now_ms().saturating_add(get("skew")?).max(get("clock")?))
}

/// The scheduling state of one entry.
#[derive(Clone, Copy)]
pub(super) struct State {
    pub(super) attempts: u32,
    /// Due (new or backing off), or the end of the current lease.
    pub(super) due: u64,
    /// The current lease, 0 when none.
    pub(super) lease: u64,
    pub(super) enqueued: u64,
    /// Hash of the order group, 0 when none.
    pub(super) order: u64,
}

impl State {
    pub(super) fn encode(self) -> [u8; 36] {
        let mut out = [0u8; 36];
        out[..4].copy_from_slice(&self.attempts.to_le_bytes());
        out[4..12].copy_from_slice(&self.due.to_le_bytes());
        out[12..20].copy_from_slice(&self.lease.to_le_bytes());
        out[20..28].copy_from_slice(&self.enqueued.to_le_bytes());
        out[28..].copy_from_slice(&self.order.to_le_bytes());
        out
    }

    pub(super) fn decode(b: &[u8]) -> Result<Self, QueueError> {
        let u64_at = |i: usize| -> Result<u64, QueueError> {
            Ok(u64::from_le_bytes(
                b.get(i..i + 8)
                    .ok_or_else(|| fail(QueueErrorKind::Corrupt, "short state"))?
                    .try_into()
                    .map_err(err)?,
            ))
        };
        Ok(Self {
            attempts: u32::from_le_bytes(
                b.get(..4)
                    .ok_or_else(|| fail(QueueErrorKind::Corrupt, "short state"))?
                    .try_into()
                    .map_err(err)?,
            ),
            due: u64_at(4)?,
            lease: u64_at(12)?,
            enqueued: u64_at(20)?,
            order: u64_at(28)?,
        })
    }
}

/// A key's marker: its fingerprint, its live entry (0 once delivered) and
/// when it is forgotten (0 while live).
pub(super) struct Marker {
    pub(super) fingerprint: [u8; 16],
    pub(super) entry: u64,
    pub(super) expires: u64,
}

impl Marker {
    pub(super) fn encode(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out[..16].copy_from_slice(&self.fingerprint);
        out[16..24].copy_from_slice(&self.entry.to_le_bytes());
        out[24..].copy_from_slice(&self.expires.to_le_bytes());
        out
    }

    pub(super) fn decode(b: &[u8]) -> Option<Self> {
        Some(Self {
            fingerprint: b.get(..16)?.try_into().ok()?,
            entry: u64::from_le_bytes(b.get(16..24)?.try_into().ok()?),
            expires: u64::from_le_bytes(b.get(24..32)?.try_into().ok()?),
        })
    }
}

/// The dead letter `id` from its record `b` and its `history` as stored.
pub(super) fn decode_dead(
    id: u64,
    b: &[u8],
    history: Option<&str>,
) -> Result<DeadLetter, QueueError> {
    let bad = || fail(QueueErrorKind::Corrupt, "unreadable dead letter");
    let attempts = u32::from_le_bytes(b.get(..4).ok_or_else(bad)?.try_into().map_err(err)?);
    let dead_at = u64::from_le_bytes(b.get(4..12).ok_or_else(bad)?.try_into().map_err(err)?);
    let len = u32::from_le_bytes(b.get(12..16).ok_or_else(bad)?.try_into().map_err(err)?) as usize;
    let error = String::from_utf8_lossy(b.get(16..16 + len).ok_or_else(bad)?).into_owned();
    let raw = b.get(16 + len..).ok_or_else(bad)?;
    // An entry dead-lettered because it could not be read is listed as
    // its raw bytes.
    let message =
        Message::decode(raw).unwrap_or_else(|| Message::undecodable(&id.to_string(), raw));
    Ok(dead_letter(
        EntryId::new(id.to_string()),
        message,
        attempts,
        error,
        time_of(dead_at),
        history,
    ))
}
