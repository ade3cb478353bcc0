//! The Lua scripts and the layout of the values they compare: each script
//! touches one key, so all of them run unchanged on a Redis Cluster.

use crate::store::OwnerToken;
use crate::Fingerprint;
use ::redis::aio::ConnectionLike;
use ::redis::{RedisError, Script};
use std::sync::LazyLock;
use std::time::Duration;

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

/// Claims an absent key, or returns what is there: nil when acquired (also
/// when the key holds this very claim: a resent script), the
/// in-flight value, or the completed record with its remaining time to live
/// (for the local tier).
pub(super) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v then
  if string.byte(v, 1) == 241 then
    if string.sub(v, 1, 17) == string.sub(ARGV[1], 1, 17) then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return false
    end
    return string.sub(v, 1, 33)
  end
  return {v, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
",
    )
});

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
    fn millis_is_clamped() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(10)), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
        assert_eq!(millis(Duration::MAX), 10 * 365 * 24 * 3600 * 1000);
    }
}
