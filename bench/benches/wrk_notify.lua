-- WeChat Pay v3 notifications for wrk (apt-get install wrk), the same
-- requests `proxy_bench load --kind wechatpay-v3` sends, from a lighter load
-- generator: MODE=first gives every request a new id, MODE=repeat cycles
-- through 8 ids. PREFIX makes a run's ids its own.
--
--   MODE=first PREFIX=run1 wrk -t1 -c64 -d4s -s bench/benches/wrk_notify.lua http://GATEWAY/notify
--   MODE=repeat wrk -t1 -c64 -d4s -s bench/benches/wrk_notify.lua http://NGINX/notify
local mode = os.getenv("MODE") or "first"
local prefix = os.getenv("PREFIX") or "w"
local counter = 0
-- Each wrk thread's number (set in setup), so that threads' ids differ.
tid = 0
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

local function body(id)
  return '{"id":"' .. id .. '","create_time":"2026-11-30T08:00:00+08:00",'
    .. '"resource_type":"encrypt-resource","event_type":"TRANSACTION.SUCCESS",'
    .. '"summary":"支付成功","resource":{"original_type":"transaction",'
    .. '"algorithm":"AEAD_AES_256_GCM",'
    .. '"ciphertext":"sRvt4YOGXeWyk3qNrYBlQX0YTr1MrJLm1w6R3ExSlXY0mAEOWX2qHSGgmAjtmg8=",'
    .. '"associated_data":"transaction","nonce":"fdasflkja484w"}}'
end

local headers = {
  ["content-type"] = "application/json",
  ["wechatpay-signature"] = "x",
  ["wechatpay-timestamp"] = "1764460800",
  ["wechatpay-nonce"] = "fdasflkja484w",
  ["wechatpay-serial"] = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
}

-- Built in init(), once wrk knows the host for the Host header.
local repeats = {}
function init(args)
  for i = 0, 7 do repeats[i] = wrk.format("POST", "/notify", headers, body(prefix .. "-rep-" .. i)) end
end

function request()
  counter = counter + 1
  if mode == "repeat" then
    return repeats[counter % 8]
  end
  return wrk.format("POST", "/notify", headers, body(prefix .. "-" .. tid .. "-" .. counter))
end

function done(summary, latency, requests)
  io.write(string.format("wrk: requests=%d errors=%d non2xx=%d rps=%.0f p50_ms=%.2f p99_ms=%.2f\n",
    summary.requests, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
