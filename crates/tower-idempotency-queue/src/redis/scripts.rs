//! The Lua scripts of [`RedisStreamsQueue`](crate::RedisStreamsQueue): each
//! change of the queue is one script, atomic on the server.

use ::redis::Script;
use std::sync::LazyLock;

/// Owner check shared by the scripts: the entry is pending for this consumer.
const OWNED: &str = "
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return 0 end
";

pub(super) static INGEST: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local cur = redis.call('GET', KEYS[2])
         if cur then
           -- A write of this call's own, so that the caller's WAIT covers
           -- the entry another instance wrote before it.
           if ARGV[4] == '1' then redis.call('SET', KEYS[2], cur, 'KEEPTTL') end
           if cur == ARGV[1] then return 1 else return 2 end
         end
         local id = redis.call('XADD', KEYS[1], '*', 'm', ARGV[2], 'a', '0', 't', ARGV[3])
         redis.call('SET', KEYS[2], ARGV[1])
         return id",
    )
});

pub(super) static PRUNE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local n = 0
         for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
           local f = {}
           for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
           if f['pending'] == 0 then
             redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
             n = n + 1
           end
         end
         return n",
    )
});

pub(super) static FETCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local s, r, rh = KEYS[1], KEYS[2], KEYS[3]
         local g, c, n, lease, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
         for _, k in ipairs(redis.call('ZRANGEBYSCORE', r, '-inf', now, 'LIMIT', 0, 256)) do
           local e = redis.call('HMGET', rh, k .. ':m', k .. ':a', k .. ':t', k .. ':h')
           if e[1] then redis.call('XADD', s, '*', 'm', e[1], 'a', e[2], 't', e[3], 'h', e[4] or '') end
           redis.call('HDEL', rh, k .. ':m', k .. ':a', k .. ':t', k .. ':h')
           redis.call('ZREM', r, k)
         end
         local out = {}
         local function push(e, reclaimed)
           if type(e) ~= 'table' or type(e[2]) ~= 'table' then return end
           local f = {}
           for i = 1, #e[2], 2 do f[e[2][i]] = e[2][i + 1] end
           -- This attempt: the failures recorded, plus every time this
           -- stream entry was handed out (a reclaim counts).
           local handed = 1
           if reclaimed then
             local p = redis.call('XPENDING', s, g, e[1], e[1], 1)
             if p[1] then handed = tonumber(p[1][4]) end
           end
           table.insert(out, e[1]); table.insert(out, f['m'] or '')
           table.insert(out, tostring(tonumber(f['a'] or '0') + handed))
           table.insert(out, f['t'] or '0')
           table.insert(out, f['h'] or '')
         end
         -- Expired entries: each XAUTOCLAIM scans at most 10 x COUNT
         -- pending entries, so the scan goes on from the cursor the last
         -- one returned (kept in KEYS[4] between fetches), for up to
         -- about one pass over the pending list per fetch: live entries
         -- pending ahead of an expired one never keep it waiting.
         local cursor = redis.call('GET', KEYS[4]) or '0-0'
         local from, wrapped = cursor, false
         for _ = 1, 64 do
           local want = n - #out / 5
           if want <= 0 then break end
           local claimed = redis.call('XAUTOCLAIM', s, g, c, lease, cursor, 'COUNT', want)
           for _, e in ipairs(claimed[2]) do push(e, true) end
           cursor = claimed[1]
           if cursor == '0-0' then
             if wrapped or from == '0-0' then break end
             wrapped = true
           end
         end
         redis.call('SET', KEYS[4], cursor)
         local left = n - #out / 5
         if left > 0 then
           local read = redis.call('XREADGROUP', 'GROUP', g, c, 'COUNT', left, 'STREAMS', s, '>')
           if read then for _, e in ipairs(read[1][2]) do push(e, false) end end
         end
         return out",
    )
});

pub(super) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{OWNED}
         redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
         redis.call('XDEL', KEYS[1], ARGV[3])
         redis.call('PEXPIRE', KEYS[2], ARGV[4])
         return 1"
    ))
});

/// Resets the idle time of an entry this consumer holds (so that no
/// `XAUTOCLAIM` takes it while its delivery runs), without counting a
/// delivery (`JUSTID`).
pub(super) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{OWNED}
         redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
         return 1"
    ))
});

pub(super) static RETRY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{OWNED}
         redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
         redis.call('XDEL', KEYS[1], ARGV[3])
         local k = ARGV[3]
         redis.call('HSET', KEYS[3], k .. ':m', ARGV[5], k .. ':a', ARGV[6], k .. ':t', ARGV[7], k .. ':h', ARGV[8])
         redis.call('ZADD', KEYS[2], ARGV[4], k)
         return 1"
    ))
});

pub(super) static DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{OWNED}
         redis.call('XADD', KEYS[2], '*', 'm', ARGV[4], 'a', ARGV[5], 'e', ARGV[6], 'at', ARGV[7], 'h', ARGV[8])
         redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
         redis.call('XDEL', KEYS[1], ARGV[3])
         return 1"
    ))
});

/// Parks an entry this consumer holds: out of the stream, into the hash of
/// its prefix (fields `ID:m`, `ID:a`, `ID:t`, `ID:h`) and the prefix's
/// order (a sorted set: score the id's milliseconds, member the id's
/// sequence zero-padded, `|`, the id, so that it sorts as the stream
/// does), the prefix in the set of parked prefixes, the parked count up by
/// one. KEYS: the stream, the prefix's hash, the set, the count, the
/// prefix's order; ARGV: group, consumer, id, message, attempts, enqueued,
/// history, prefix.
pub(super) static PARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{OWNED}
         redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
         redis.call('XDEL', KEYS[1], ARGV[3])
         local k = ARGV[3]
         redis.call('HSET', KEYS[2], k .. ':m', ARGV[4], k .. ':a', ARGV[5], k .. ':t', ARGV[6], k .. ':h', ARGV[7])
         local ms, seq = string.match(k, '^(%d+)-(%d+)$')
         redis.call('ZADD', KEYS[5], tonumber(ms or '0'), string.format('%020d', tonumber(seq or '0')) .. '|' .. k)
         redis.call('SADD', KEYS[3], ARGV[8])
         redis.call('INCR', KEYS[4])
         return 1"
    ))
});

/// Wakes at most ARGV[2] of the entries parked under a prefix, the first in
/// its order: each back into the stream, out of the hash and the order, the
/// count down; the prefix leaves the set once nothing of it is parked. One
/// script per step: two instances waking at once move each entry once, and
/// Redis answers others between steps. Entries parked before the order was
/// kept (none in it, some in the hash) are woken all in one step, sorted by
/// id. KEYS: the stream, the prefix's hash, the set, the count, the
/// prefix's order; ARGV: the prefix, the most to wake. How many woken, and
/// 1 while some are left (else 0).
pub(super) static WAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local n = 0
         local function back(id, e)
           if e[1] then
             redis.call('XADD', KEYS[1], '*', 'm', e[1], 'a', e[2] or '0', 't', e[3] or '0', 'h', e[4] or '')
             n = n + 1
           end
         end
         local members = redis.call('ZRANGE', KEYS[5], 0, tonumber(ARGV[2]) - 1)
         if #members > 0 then
           for _, member in ipairs(members) do
             local id = string.match(member, '|(.*)$')
             local f = {id .. ':m', id .. ':a', id .. ':t', id .. ':h'}
             back(id, redis.call('HMGET', KEYS[2], f[1], f[2], f[3], f[4]))
             redis.call('HDEL', KEYS[2], f[1], f[2], f[3], f[4])
           end
           redis.call('ZREM', KEYS[5], unpack(members))
         else
           local all = redis.call('HGETALL', KEYS[2])
           local by, ids = {}, {}
           for i = 1, #all, 2 do
             local id, field = string.match(all[i], '^(.*):(%a)$')
             if id then
               if not by[id] then by[id] = {}; table.insert(ids, id) end
               by[id][field] = all[i + 1]
             end
           end
           local function parts(id)
             local ms, seq = string.match(id, '^(%d+)-(%d+)$')
             return tonumber(ms or '0'), tonumber(seq or '0')
           end
           table.sort(ids, function(a, b)
             local am, as = parts(a)
             local bm, bs = parts(b)
             if am == bm then return as < bs end
             return am < bm
           end)
           for _, id in ipairs(ids) do
             local e = by[id]
             back(id, {e['m'], e['a'], e['t'], e['h']})
           end
           redis.call('DEL', KEYS[2])
         end
         if n > 0 then
           local left = redis.call('DECRBY', KEYS[4], n)
           if left <= 0 then redis.call('DEL', KEYS[4]) end
         end
         if redis.call('ZCARD', KEYS[5]) > 0 or redis.call('EXISTS', KEYS[2]) == 1 then
           return {n, 1}
         end
         redis.call('SREM', KEYS[3], ARGV[1])
         return {n, 0}",
    )
});

/// Forgets a delivered key's marker: 1, or 0 if there is none, or -1 (and
/// nothing changed) while it has no expiry (its entry is queued, being
/// delivered or dead-lettered).
pub(super) static FORGET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local t = redis.call('PTTL', KEYS[1])
         if t == -2 then return 0 end
         if t == -1 then return -1 end
         redis.call('DEL', KEYS[1])
         return 1",
    )
});

/// Deletes a dead letter and its key's marker (while the marker has no
/// expiry: it is still the dead letter's). KEYS: the dead-letter stream,
/// the marker; ARGV[1] the dead letter's id. 1, or 0 if there was none.
pub(super) static DELETE_DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
         if redis.call('PTTL', KEYS[2]) == -1 then redis.call('DEL', KEYS[2]) end
         return 1",
    )
});

/// Moves a dead letter back into the stream, its attempts reset. KEYS:
/// the dead-letter stream, the stream; ARGV: the letter's id, now (ms),
/// the message to queue in its place (empty: its own). 1, or 0 if there
/// was none.
pub(super) static REPLAY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local e = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
         if #e == 0 then return 0 end
         local f = {}
         for i = 1, #e[1][2], 2 do f[e[1][2][i]] = e[1][2][i + 1] end
         local m = f['m']
         if ARGV[3] ~= '' then m = ARGV[3] end
         redis.call('XADD', KEYS[2], '*', 'm', m, 'a', '0', 't', ARGV[2])
         redis.call('XDEL', KEYS[1], ARGV[1])
         return 1",
    )
});

/// The server's clock in milliseconds (every instance's slots and turns on
/// one clock).
const NOW: &str = "
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
";

/// A lane's shared delivery slots: a sorted set of slot → lease end.
/// KEYS[1] the set; ARGV: limit, lease (ms), slot. 1 taken, 0 all taken.
pub(super) static TAKE_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
         redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
         if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
         redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
         -- The set lives as long as its longest lease, not the last one.
         if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
           redis.call('PEXPIRE', KEYS[1], ARGV[2])
         end
         return 1"
    ))
});

/// Renews a slot still held. KEYS[1] the set; ARGV: lease (ms), slot.
pub(super) static RENEW_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
         if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
         redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[2])
         if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
           redis.call('PEXPIRE', KEYS[1], ARGV[1])
         end
         return 1"
    ))
});

/// A lane's shared rate: the time of its next turn (a GCRA with no burst).
/// KEYS[1] the turn; ARGV: interval (ms). 0 go now, else ms to wait.
pub(super) static TAKE_TURN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
         local interval = tonumber(ARGV[1])
         local next = tonumber(redis.call('GET', KEYS[1]) or '0')
         if next > now then return next - now end
         redis.call('SET', KEYS[1], tostring(now + interval), 'PX', interval + 1000)
         return 0"
    ))
});

/// The shared breaker's answers: 0 closed, more than 0 open for that many
/// ms, -1 half-open, -2 half-open with every probe out, -3 the probe was
/// taken. Its keys (per lane): a hash with `until` (when the open state
/// ends; absent while closed) and `failed` (probes failed since it was
/// half-open), the probes under way (a sorted set of probe → lease end),
/// and the votes (a sorted set of entry → when, and one of the failed
/// entries alone).
const BREAKER_STANDS: &str = "
local ends = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
";

/// Where a lane's shared breaker stands. KEYS[1] its state.
pub(super) static BREAKER_STATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{BREAKER_STANDS}
         if ends == 0 then return 0 end
         if now < ends then return ends - now end
         return -1"
    ))
});

/// Casts an entry's vote (its latest result replaces its earlier one),
/// then judges while closed: open when at least `failures` votes failed
/// and they are at least the rate. Open or half-open, only probes count.
/// KEYS: state, probes, votes, failed votes; ARGV: entry, ok (1 or 0),
/// failures, cooldown (ms), window (ms), most votes, rate (per mille).
pub(super) static BREAKER_VOTE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{BREAKER_STANDS}
         if ends > 0 then
           if now < ends then return ends - now end
           return -1
         end
         local votes, fails = KEYS[3], KEYS[4]
         local cutoff = now - tonumber(ARGV[5])
         redis.call('ZREMRANGEBYSCORE', votes, '-inf', cutoff)
         redis.call('ZREMRANGEBYSCORE', fails, '-inf', cutoff)
         redis.call('ZADD', votes, now, ARGV[1])
         if ARGV[2] == '1' then
           redis.call('ZREM', fails, ARGV[1])
         else
           redis.call('ZADD', fails, now, ARGV[1])
         end
         local over = redis.call('ZCARD', votes) - tonumber(ARGV[6])
         if over > 0 then
           local old = redis.call('ZPOPMIN', votes, over)
           for i = 1, #old, 2 do redis.call('ZREM', fails, old[i]) end
         end
         redis.call('PEXPIRE', votes, ARGV[5])
         redis.call('PEXPIRE', fails, ARGV[5])
         if ARGV[2] == '1' then return 0 end
         local failed, all = redis.call('ZCARD', fails), redis.call('ZCARD', votes)
         if failed >= tonumber(ARGV[3]) and failed * 1000 >= all * tonumber(ARGV[7]) then
           redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[4]), 'failed', 0)
           redis.call('DEL', KEYS[2])
           return tonumber(ARGV[4])
         end
         return 0"
    ))
});

/// Takes a probe, leased: half-open, while the probes under way (their
/// leases not run out) and those failed are fewer than the most.
/// KEYS: state, probes; ARGV: most probes, lease (ms), probe.
pub(super) static TAKE_PROBE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{BREAKER_STANDS}
         if ends == 0 then return 0 end
         if now < ends then return ends - now end
         redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
         local out = redis.call('ZCARD', KEYS[2]) + tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
         if out >= tonumber(ARGV[1]) then return -2 end
         redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
         if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
           redis.call('PEXPIRE', KEYS[2], ARGV[2])
         end
         return -3"
    ))
});

/// Settles a probe: delivered, the breaker closes (its votes forgotten);
/// failed, it opens again if its entry had not failed before or every
/// probe failed; a probe that said nothing, or whose lease ran out (its
/// place was given to another), changes nothing more.
/// KEYS: state, probes, votes, failed votes; ARGV: probe, result (1
/// delivered, 0 failed, -1 nothing), fresh (1 or 0), most probes, cooldown
/// (ms).
pub(super) static SETTLE_PROBE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
         local known = redis.call('ZREM', KEYS[2], ARGV[1]) == 1
         {BREAKER_STANDS}
         if ends == 0 then return 0 end
         if ARGV[2] == '1' then
           redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
           return 0
         end
         if now < ends then return ends - now end
         if not known or ARGV[2] ~= '0' then return -1 end
         local failed = redis.call('HINCRBY', KEYS[1], 'failed', 1)
         redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
         if ARGV[3] == '1' or (failed >= tonumber(ARGV[4]) and redis.call('ZCARD', KEYS[2]) == 0) then
           redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[5]), 'failed', 0)
           redis.call('DEL', KEYS[2])
           return tonumber(ARGV[5])
         end
         return -1"
    ))
});
