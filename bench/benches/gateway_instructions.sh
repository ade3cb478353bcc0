#!/usr/bin/env bash
# Instructions per request of a gateway binary (callgrind), first
# deliveries and replays: the figure to decide by on a busy machine, where
# wall-clock throughput is noise. Needs valgrind, nginx and python3.
#
#   bench/benches/gateway_instructions.sh BIN [BIN...]
#   N=2000 bench/benches/gateway_instructions.sh target/release/idempotency-gateway target/ab/target-*/release/idempotency-gateway
#   OTLP=1 RATIO=0.01 bench/benches/gateway_instructions.sh target/release/idempotency-gateway
#
#   STORE=redis://127.0.0.1:6399/ bench/benches/gateway_instructions.sh target/release/idempotency-gateway
#
#   PRESET=stripe bench/benches/gateway_instructions.sh target/release/idempotency-gateway
#   PRESET=stripe ORDER=stripe bench/benches/gateway_instructions.sh target/release/idempotency-gateway
#
# With PRESET (wechatpay-v3 or stripe) the route is a config file's
# `[[route]]` of that preset (`prefix = "/"`), with `order = "ORDER"` when
# ORDER is set, and the client sends that channel's notifications (a
# Stripe event's payment intent is the event's own: every first delivery is
# a new object, placed and its position advanced). Without either, the
# route is `--route /=wechatpay-v3`, as for every figure before.
#
# With OTLP=1 the gateway exports its traces (--otlp-endpoint) to the same
# nginx (`/v1/traces` answers 200, empty: an OTLP success), sampled at
# RATIO (default 1), batches every 200 ms: the export's own work (encoding,
# the HTTP call) is in the count.
#
# A binary named hyper_200 is the bare hyper server (`cargo build --release
# -p idempotency-bench --example hyper_200`, target/release/examples/): the
# ceiling, a Rust server that answers 200 and does nothing else, run with
# the same client; its "first" and "replay" are the same work.
#
# Each binary runs on one serving thread (`--workers 1`, `--route
# /=wechatpay-v3` or PRESET's route) under callgrind in front of nginx answering `return
# 200`, and gets 50 warm-up requests, then 100 or 100 + N requests over one
# keep-alive connection; the difference of the two runs' totals over N is
# the cost of one request (start-up and shutdown cancel out).
#
# KEEP=DIR keeps each binary's larger run per mode as DIR/N.MODE.callgrind
# and its smaller one as DIR/N.MODE.small.callgrind (N counts the binaries
# from 1), for `callgrind_annotate --inclusive=no`; `bench/benches/cg_diff.py
# DIR/N.MODE.small.callgrind DIR/N.MODE.callgrind REQUESTS` gives the
# instructions per request of each function (start-up cancels out).
# Build the binaries with debug info for callgrind_annotate's lines
# (`CARGO_PROFILE_RELEASE_DEBUG=1 cargo build --release -p
# idempotency-gateway`, as bench/benches/ab.sh and profile.sh do); the
# release profile ships without it.
set -euo pipefail

N=${N:-1000}
cd "$(dirname "$0")/../.."
[ "$#" -gt 0 ] || { echo "usage: bench/benches/gateway_instructions.sh BIN [BIN...]" >&2; exit 2; }
for tool in valgrind nginx python3; do
    command -v "$tool" >/dev/null || { echo "$tool not found" >&2; exit 1; }
done

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start gateway_instructions

UP_PORT=$(free_port)
start_nginx 1 <<EOF
    server {
        listen 127.0.0.1:$UP_PORT;
        location / { return 200 "ok\n"; }
        location = /v1/traces { default_type application/x-protobuf; return 200 ""; }
    }
EOF

cat >"$TMP/client.py" <<'EOF'
import http.client, sys
port, mode, n, prefix, preset = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
c = http.client.HTTPConnection("127.0.0.1", port)
if preset == "stripe":
    headers = {"content-type": "application/json"}
    body = ('{"id":"evt_%(i)s","object":"event","type":"payment_intent.succeeded","created":1764460800,'
            '"data":{"object":{"id":"pi_%(i)s","object":"payment_intent"}}}')
else:
    headers = {"content-type": "application/json", "wechatpay-signature": "x",
               "wechatpay-timestamp": "1764460800", "wechatpay-nonce": "fdasflkja484w",
               "wechatpay-serial": "5157F09EFDC096DE15EBE81A47057A7232F1B8E1"}
    body = ('{"id":"%(i)s","create_time":"2026-11-30T08:00:00+08:00","resource_type":"encrypt-resource",'
            '"event_type":"TRANSACTION.SUCCESS","summary":"ok","resource":{"original_type":"transaction",'
            '"algorithm":"AEAD_AES_256_GCM","ciphertext":"sRvt4YOGXeWyk3qNrYBlQX0YTr1MrJLm1w6R3ExSlXY0mAEOWX2qHSGgmAjtmg8=",'
            '"associated_data":"transaction","nonce":"fdasflkja484w"}}')
for k in range(n):
    i = "%s-%d" % (prefix, k) if mode == "first" else "rep-%d" % (k % 8)
    c.request("POST", "/notify", body=(body % {"i": i}).encode(), headers=headers)
    r = c.getresponse()
    r.read()
    if r.status != 200:
        sys.exit("status %d" % r.status)
EOF

# STORE=URL: the gateway's --store (default memory), e.g. a redis-server
# of your own (the gateway's local cache of completed records stays in
# front of it: a replay it holds does not ask Redis).
STORE_ARGS=()
[ -n "${STORE:-}" ] && STORE_ARGS=(--store "$STORE")
ROUTE_ARGS=(--route /=wechatpay-v3)
if [ -n "${PRESET:-}${ORDER:-}" ]; then
    {
        printf '[[route]]\nprefix = "/"\npreset = "%s"\n' "${PRESET:-wechatpay-v3}"
        if [ -n "${ORDER:-}" ]; then printf 'order = "%s"\n' "$ORDER"; fi
    } >"$TMP/route.toml"
    ROUTE_ARGS=(--config "$TMP/route.toml")
fi
TRACING=()
if [ "${OTLP:-0}" = 1 ]; then
    TRACING=(--otlp-endpoint "http://127.0.0.1:$UP_PORT" --trace-sample-ratio "${RATIO:-1}")
    export OTEL_BSP_SCHEDULE_DELAY=200
fi

# total BIN MODE COUNT: the callgrind total of a gateway that served COUNT.
total() {
    local port out vg
    port=$(free_port)
    out="$TMP/cg.$RANDOM.out"
    local args=(--listen "127.0.0.1:$port" --workers 1)
    # The bare hyper server (examples/hyper_200) takes only those two.
    case $(basename "$1") in
        hyper_200) ;;
        *) args+=(--upstream "http://127.0.0.1:$UP_PORT" "${ROUTE_ARGS[@]}" "${TRACING[@]}" "${STORE_ARGS[@]}") ;;
    esac
    RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out" "$1" "${args[@]}" >"$TMP/gw.out" 2>"$TMP/gw.err" &
    vg=$!
    # valgrind starts slowly on a loaded machine: up to a minute.
    local tries
    for tries in 1 2 3 4 5 6; do
        wait_line "$TMP/gw.out" "listening on " >/dev/null 2>&1 && break
    done
    python3 "$TMP/client.py" "$port" "$2" 50 "warm$RANDOM" "${PRESET:-wechatpay-v3}"
    python3 "$TMP/client.py" "$port" "$2" "$3" "m$RANDOM" "${PRESET:-wechatpay-v3}"
    kill -INT "$vg"
    wait "$vg" 2>/dev/null || true
    sed -n 's/^summary: *\([0-9]*\).*/\1/p' "$out"
    LAST_OUT=$out
}

echo "| binary | first delivery, instructions | replay, instructions |"
echo "|---|---|---|"
n=0
for bin in "$@"; do
    n=$((n + 1))
    row="| $bin |"
    for mode in first repeat; do
        # Not in a subshell: `total` sets LAST_OUT.
        total "$bin" "$mode" 100 >"$TMP/a"
        a=$(cat "$TMP/a")
        small=$LAST_OUT
        total "$bin" "$mode" $((100 + N)) >"$TMP/b"
        b=$(cat "$TMP/b")
        if [ -n "${KEEP:-}" ]; then
            mkdir -p "$KEEP"
            cp "$LAST_OUT" "$KEEP/$n.$mode.callgrind"
            cp "$small" "$KEEP/$n.$mode.small.callgrind"
        fi
        row="$row $(( (b - a) / N )) |"
    done
    echo "$row"
done
