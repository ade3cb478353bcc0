//! The Lua scripts and the layout of the values they compare: each script
//! touches one key, so all of them run unchanged on a Redis Cluster.

use redis::aio::ConnectionLike;
use redis::{RedisError, Script};
use std::sync::LazyLock;
use std::time::Duration;
use tower_idempotency_core::store::OwnerToken;
use tower_idempotency_core::Fingerprint;

/// First byte of an in-flight value.
pub(super) const IN_FLIGHT: u8 = 0xF1;
/// The value of an issued client token.
pub(super) const TOKEN_VALUE: &[u8] = b"\x7etoken";
/// A consumed client token: this tag, then the owner token of the request
/// that took it.
pub(super) const TOKEN_TAKEN: &[u8] = b"\x7etaken";
/// Tag + owner token: what complete, renew and release compare.
pub(super) const OWNER_LEN: usize = 17;
/// Tag + owner token + fingerprint.
pub(super) const IN_FLIGHT_LEN: usize = 33;

/// Claims an absent key, or returns what is there: the claim's fencing
/// token (an integer) when acquired (also when the key holds this very
/// claim: a resent script), the in-flight value, or the completed record
/// with its remaining time to live (for the local tier).
///
/// `KEYS[2]` is the key's fence counter (same slot): the token is one more
/// than the counter's last value, and never less than the server's clock in
/// microseconds (`TIME`), so it still grows once the counter has expired or
/// the server lost its data. The counter lives `ARGV[3]` ms. The in-flight
/// value keeps the token (decimal, after the fingerprint) for resent claims.
pub(super) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v then
  if string.byte(v, 1) == 241 then
    if string.sub(v, 1, 17) == string.sub(ARGV[1], 1, 17) then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return tonumber(string.sub(v, 34)) or 0
    end
    return string.sub(v, 1, 33)
  end
  return {v, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local f = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if last + 1 > f then
  f = last + 1
end
local s = string.format('%.0f', f)
redis.call('SET', KEYS[2], s, 'PX', ARGV[3])
redis.call('SET', KEYS[1], ARGV[1] .. s, 'PX', ARGV[2])
return f
",
    )
});

/// How much longer than the lease a key's fence counter lives: past it, the
/// server's clock alone keeps the tokens growing.
pub(super) const FENCE_MARGIN: Duration = Duration::from_secs(60);

/// The key of `key`'s fence counter: in the same Cluster slot as `key`, and
/// never the key of a record: it holds `%fence`, and in record keys every
/// `%` is followed by `25`, `7B` or `7D` (the layer's keys are escaped).
pub(super) fn fence_key(key: &str) -> String {
    if hash_tag(key).is_some() {
        // The key's own tag (from the prefix) still decides the slot.
        return format!("{key}%fence");
    }
    if !key.contains('}') {
        // The whole key as the tag: the slot of the key itself.
        return format!("{{{key}}}%fence");
    }
    // A prefix with a `}` but no hash tag: the whole key is hashed, and so
    // is the counter's (its suffix adds no brace); find one of the same slot.
    let slot = crc16(key.as_bytes()) % 16384;
    (0u32..)
        .map(|i| format!("{key}%fence{i:x}"))
        .find(|k| crc16(k.as_bytes()) % 16384 == slot)
        .expect("every slot has a short suffix")
}

/// The hash tag of a key as Redis Cluster reads it: what is between the
/// first `{` and the first `}` after it, if not empty.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

/// CRC16/XMODEM, as Redis Cluster hashes keys.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Owner's claim (or an absent key) → completed record with the window.
pub(super) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == false or string.sub(v, 1, 17) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
",
    )
});

/// Owner's claim → new lease.
pub(super) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 17) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
",
    )
});

/// Owner's claim → absent.
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 17) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
",
    )
});

/// What a key holds, with its remaining time to live: nil when absent.
pub(super) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v then
  return {v, redis.call('PTTL', KEYS[1])}
end
return false
",
    )
});

/// A completed record → absent (1); an in-flight claim is left to its
/// owner (-1); an absent key or a client token is not a record (0).
pub(super) static FORGET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 1) == 126 then
  return 0
end
if string.byte(v, 1) == 241 then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
",
    )
});

/// A completed record → the new record (`ARGV[1]`, for `ARGV[2]` ms);
/// never a claim, a client token or an absent key.
pub(super) static REPLACE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 1) == 126 or string.byte(v, 1) == 241 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
",
    )
});

/// A client token → taken by this request (same expiry); never touches
/// anything else. Taken by this request already (a resent script) → 1 again.
pub(super) static TAKE_TOKEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0
",
    )
});

/// An object's position (`ARGV[1]`, [`Position::encode`]'s 24 hex digits)
/// → kept for `ARGV[2]` ms if it is ahead of the one kept (or none is):
/// 1; else the position kept, unchanged. The three 8-digit parts are
/// compared as numbers (each exact in Lua's doubles), not by the locale's
/// collation.
///
/// [`Position::encode`]: tower_idempotency_core::store::Position::encode
pub(super) static ADVANCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v then
  if string.len(v) ~= 24 then
    return redis.error_reply('unreadable position')
  end
  local ahead = false
  for i = 1, 17, 8 do
    local kept = tonumber(string.sub(v, i, i + 7), 16)
    local new = tonumber(string.sub(ARGV[1], i, i + 7), 16)
    if kept == nil then
      return redis.error_reply('unreadable position')
    end
    if new ~= kept then
      ahead = new > kept
      break
    end
  end
  if not ahead then
    return v
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
",
    )
});

/// The key of an object's position: never a record's or a fence counter's
/// (every `%` of a stored key is escaped).
pub(super) fn position_key(full_key: String) -> String {
    full_key + "%pos"
}

/// Releases a claim that may have been made by a call that did not return
/// it. Safe whatever happened: the release compares the owner token, and it
/// is queued behind the claim on the same connection.
pub(super) struct Undo<C: ConnectionLike + Send + 'static>(
    pub(super) Option<(C, String, [u8; OWNER_LEN])>,
);

impl<C: ConnectionLike + Send + 'static> Drop for Undo<C> {
    fn drop(&mut self) {
        let Some((mut conn, key, owner)) = self.0.take() else {
            return;
        };
        // Without a runtime the lease runs out by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _: Result<i64, RedisError> = RELEASE
                    .key(&key)
                    .arg(&owner[..])
                    .invoke_async(&mut conn)
                    .await;
            });
        }
    }
}

/// Milliseconds for `PX` / `PEXPIRE`: at least 1, at most ten years.
pub(super) fn millis(d: Duration) -> u64 {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    ms.clamp(1, 10 * 365 * 24 * 3600 * 1000)
}

pub(super) fn owner_bytes(token: OwnerToken) -> [u8; OWNER_LEN] {
    let mut out = [0u8; OWNER_LEN];
    out[0] = IN_FLIGHT;
    out[1..].copy_from_slice(&token.as_u128().to_be_bytes());
    out
}

pub(super) fn in_flight_value(token: OwnerToken, fingerprint: Fingerprint) -> [u8; IN_FLIGHT_LEN] {
    let mut out = [0u8; IN_FLIGHT_LEN];
    out[..OWNER_LEN].copy_from_slice(&owner_bytes(token));
    out[OWNER_LEN..].copy_from_slice(&fingerprint.to_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_layout() {
        let token = OwnerToken::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let fp = Fingerprint::from_bytes([0xaa; 16]);
        let v = in_flight_value(token, fp);
        assert_eq!(v[0], IN_FLIGHT);
        assert_eq!(&v[1..17], &token.as_u128().to_be_bytes());
        assert_eq!(&v[17..], &[0xaa; 16]);
        assert_eq!(&v[..OWNER_LEN], &owner_bytes(token));
    }

    #[test]
    fn crc16_is_redis_cluster_hash() {
        // CLUSTER KEYSLOT foo = 12182, 123456789 = 12739 (CRC16 0x31C3).
        assert_eq!(crc16(b"foo") % 16384, 12182);
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    #[test]
    fn fence_keys_share_the_slot_of_their_key() {
        let slot = |k: &str| crc16(hash_tag(k).unwrap_or(k).as_bytes()) % 16384;
        for key in [
            "idem:a:b",
            "{idem}:x",
            "p}:idem:x",
            "{}x",
            "a{b",
            "{}{x}y",
            "}{",
        ] {
            let fence = fence_key(key);
            assert_eq!(slot(&fence), slot(key), "{key} -> {fence}");
            assert_ne!(fence, key);
            assert!(fence.contains("%fence"), "{fence}");
        }
        assert_eq!(fence_key("idem:k"), "{idem:k}%fence");
        assert_eq!(fence_key("{p}:k"), "{p}:k%fence");
    }

    #[test]
    fn millis_is_clamped() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(10)), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
        assert_eq!(millis(Duration::MAX), 10 * 365 * 24 * 3600 * 1000);
    }
}
