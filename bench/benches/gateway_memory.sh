#!/usr/bin/env bash
# The gateway's resident memory under millions of unique notifications, with
# the memory store's default budget (--max-memory 256MiB): does the process
# plateau within 15 % of its baseline plus the budget?
#
# Starts `proxy_bench upstream` (answering BODY_BYTES-byte bodies, so each
# record the gateway keeps holds that many body bytes) and the gateway
# (`--route /=wechatpay-v3`, memory store, default budget, RUST_LOG=warn,
# metrics on a loopback port), warms it up with repeats (8 ids: connections,
# pools, buffers, but next to nothing stored), takes the baseline RSS, then
# sends unique WeChat Pay v3 notifications (`proxy_bench load --mode
# first`) in CHUNK-request chunks up to TOTAL, and after each chunk samples
# the gateway's VmRSS (from /proc/PID/status) and its store gauges from
# /metrics (bytes, records, early evictions). The table shows the growth
# over the baseline against the budget; the verdict is the largest ratio
# once the store is full (its bytes at 95 % of the budget) against 1.15.
#
# Usage (from the crate root):
#
#   bench/benches/gateway_memory.sh                      # 37-byte bodies, 3,000,000 requests
#   BODY_BYTES=65536 bench/benches/gateway_memory.sh     # 64 KiB bodies, 30,000 requests
#   BODY_BYTES=65536 TOTAL=40000 CHUNK=2000 CONNECTIONS=64 bench/benches/gateway_memory.sh
#   GATEWAY_ENV="MALLOC_ARENA_MAX=2" bench/benches/gateway_memory.sh   # allocator settings
#
# Exits 1 if the ratio is above 1.15 or a load run reported errors.
# Everything it starts is killed on exit.
set -euo pipefail

BODY_BYTES=${BODY_BYTES:-}
if [ -z "$BODY_BYTES" ] || [ "$BODY_BYTES" = 37 ]; then
    BODY_BYTES=""
    TOTAL=${TOTAL:-3000000}
    CHUNK=${CHUNK:-250000}
else
    TOTAL=${TOTAL:-30000}
    CHUNK=${CHUNK:-2000}
fi
CONNECTIONS=${CONNECTIONS:-64}
WARMUP=${WARMUP:-20000}
# The gateway's default --max-memory; only used to compute the ratio.
BUDGET_MIB=${BUDGET_MIB:-256}
# Extra environment for the gateway process, e.g. MALLOC_ARENA_MAX=2.
GATEWAY_ENV=${GATEWAY_ENV:-}

cd "$(dirname "$0")/../.."
echo "# building (release)" >&2
cargo build --release --quiet -p idempotency-gateway -p idempotency-bench --bin idempotency-gateway --example proxy_bench
BIN=${CARGO_TARGET_DIR:-target}/release/examples
GATEWAY_BIN=${CARGO_TARGET_DIR:-target}/release/idempotency-gateway

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start gateway_memory

"$BIN/proxy_bench" upstream --listen 127.0.0.1:0 ${BODY_BYTES:+--body-bytes "$BODY_BYTES"} \
    >"$TMP/upstream.out" &
PIDS+=($!)
UPSTREAM=$(wait_line "$TMP/upstream.out" "upstream on ")

METRICS="127.0.0.1:$(free_port)"
# shellcheck disable=SC2086 # GATEWAY_ENV is a list of VAR=value words
env RUST_LOG=warn $GATEWAY_ENV "$GATEWAY_BIN" --listen 127.0.0.1:0 --upstream "http://$UPSTREAM" \
    --route /=wechatpay-v3 --metrics-listen "$METRICS" >"$TMP/gateway.out" 2>"$TMP/gateway.err" &
GATEWAY_PID=$!
PIDS+=($GATEWAY_PID)
GATEWAY=$(wait_line "$TMP/gateway.out" "listening on ")

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$GATEWAY_PID/status"; }
hwm_kib() { awk '/^VmHWM:/ { print $2 }' "/proc/$GATEWAY_PID/status"; }
# metric NAME [LABEL-MATCH]: the sum of the metric's samples (0 if none).
metric() {
    curl -sf "http://$METRICS/metrics" | awk -v n="$1" -v l="${2:-}" '
        $1 ~ "^" n "({|$)" && index($1, l) { s += $2 } END { printf "%.0f\n", s }'
}

load() {
    "$BIN/proxy_bench" load --target "http://$GATEWAY" --upstream "$UPSTREAM" \
        --connections "$CONNECTIONS" "$@"
}

echo "# upstream $UPSTREAM (body ${BODY_BYTES:-37 (WeChat success)} bytes), gateway $GATEWAY," \
    "metrics $METRICS, env '${GATEWAY_ENV}'" >&2
echo "# $(nproc) cores; load: $(uptime)" >&2
load --mode repeat --requests "$WARMUP" >/dev/null
sleep 1
BASE=$(rss_kib)
echo "# baseline after $WARMUP repeats: $(awk -v k="$BASE" 'BEGIN { printf "%.1f MiB", k / 1024 }')" >&2

BUDGET_KIB=$(( BUDGET_MIB * 1024 ))
echo
echo "| requests sent | RSS MiB | growth MiB | growth / budget | store MiB | records | early evictions | rps |"
echo "|---|---|---|---|---|---|---|---|"
sent=0
errors=0
worst=0
: >"$TMP/ratios"
while [ "$sent" -lt "$TOTAL" ]; do
    n=$(( TOTAL - sent < CHUNK ? TOTAL - sent : CHUNK ))
    line=$(load --mode first --requests "$n" || true)
    sent=$(( sent + n ))
    e=$(echo "$line" | sed -n 's/.* errors=\([0-9]*\).*/\1/p')
    rps=$(echo "$line" | sed -n 's/.* rps=\([0-9]*\).*/\1/p')
    errors=$(( errors + ${e:-1} ))
    rss=$(rss_kib)
    bytes=$(metric idempotency_store_bytes)
    records=$(metric idempotency_store_records)
    early=$(metric idempotency_store_evictions_total 'reason="early"')
    awk -v s="$sent" -v r="$rss" -v b="$BASE" -v bud="$BUDGET_KIB" -v by="$bytes" \
        -v rec="$records" -v ev="$early" -v rps="$rps" 'BEGIN {
        printf "| %d | %.1f | %.1f | %.3f | %.1f | %d | %d | %s |\n",
            s, r / 1024, (r - b) / 1024, (r - b) / bud, by / 1048576, rec, ev, rps
    }'
    # Once the store is full, this sample counts for the verdict.
    if awk -v by="$bytes" -v bud="$BUDGET_KIB" 'BEGIN { exit !(by >= 0.95 * bud * 1024) }'; then
        awk -v r="$rss" -v b="$BASE" -v bud="$BUDGET_KIB" 'BEGIN { printf "%.4f\n", (r - b) / bud }' >>"$TMP/ratios"
    fi
done

HWM=$(hwm_kib)
echo
awk -v b="$BASE" -v h="$HWM" -v bud="$BUDGET_KIB" 'BEGIN {
    printf "baseline %.1f MiB; peak RSS (VmHWM) %.1f MiB, growth %.1f MiB = %.3f × budget\n",
        b / 1024, h / 1024, (h - b) / 1024, (h - b) / bud }'
if [ ! -s "$TMP/ratios" ]; then
    echo "verdict: the store never filled (raise TOTAL); errors $errors"
    exit 1
fi
worst=$(sort -g "$TMP/ratios" | tail -n1)
last=$(tail -n1 "$TMP/ratios")
verdict=$(awk -v w="$worst" 'BEGIN { print (w <= 1.15 ? "PASS" : "FAIL") }')
echo "verdict: growth / budget once full: last $last, worst $worst (limit 1.15): $verdict; load errors $errors"
[ "$verdict" = PASS ] && [ "$errors" = 0 ]
