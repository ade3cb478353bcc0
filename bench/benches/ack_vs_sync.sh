#!/usr/bin/env bash
# Acknowledgement latency and ingest throughput of an ack-then-deliver route
# against the synchronous mode, and delivery throughput of the queue (what
# is still queued when the load ends, drained with no ingest beside it).
# Closed loop: bench/examples/proxy_bench load (C connections, one request in
# flight each), WeChat Pay v3 first deliveries.
#   bench/benches/ack_vs_sync.sh [N] [C] [debug|release]
#   OPEN_LOOP=1 bench/benches/ack_vs_sync.sh 3000 64 release   # also open loop
#   RATE="500 1000" bench/benches/ack_vs_sync.sh                # open loop at these rates
#
# With OPEN_LOOP=1 (or RATE set), after the closed-loop rounds both modes
# are driven in an open loop (`proxy_bench load --rate`, latency from each
# request's scheduled send time, as wrk2 does, so no coordinated omission)
# at the same fixed rates, OPEN_SECONDS (default 4) each, interleaved sync /
# ack, each against a fresh gateway (and an empty queue). The rates are
# RATE (requests per second, space-separated) or else OPEN_PCTS (default
# "25 50 75") percent of the lower of the two modes' closed-loop maxima (the
# lower of its rounds each), so that both modes can sustain them. A table
# shows the acknowledgement latency p50/p99/p99.9/max per mode and rate.
set -euo pipefail
N=${1:-3000}; C=${2:-64}; PROFILE=${3:-debug}
cd "$(dirname "$0")/../.."
BIN=target/$PROFILE/examples
GATEWAY_BIN=target/$PROFILE/idempotency-gateway
flag=""; [ "$PROFILE" = release ] && flag="--release"
cargo build -q $flag -p idempotency-gateway -p idempotency-bench --bin idempotency-gateway --example proxy_bench
work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
start() { # name, args... -> prints the gateway's address
  "$GATEWAY_BIN" "${@:2}" >"$work/$1.out" 2>"$work/$1.err" & echo $! >"$work/$1.pid"
  for _ in $(seq 100); do grep -q listening "$work/$1.out" 2>/dev/null && break; sleep 0.1; done
  sed -n 's/^listening on //p' "$work/$1.out"
}
stop() { kill "$(cat "$work/$1.pid")"; wait "$(cat "$work/$1.pid")" 2>/dev/null || true; }
"$BIN/proxy_bench" upstream >"$work/up.out" & sleep 0.5
UP=$(sed -n 's/^upstream on //p' "$work/up.out")
common=(--listen 127.0.0.1:0 --upstream "http://$UP" --route /notify=wechatpay-v3)
export RUST_LOG=warn
load() { # gateway address, extra load flags...
  "$BIN/proxy_bench" load --target "http://$1/notify" --upstream "$UP" --connections "$C" --mode first "${@:2}"
}
for round in 1 2; do
  gw=$(start sync "${common[@]}")
  line=$(load "$gw" --requests "$N"); echo "sync $line" >>"$work/closed"
  echo "sync  #$round: $line"
  stop sync
  gw=$(start ack "${common[@]}" --ack-then-deliver /notify --data-dir "$work/ack$round")
  h=$(curl -s "http://$UP/__hits")
  line=$(load "$gw" --requests "$N"); echo "ack $line" >>"$work/closed"
  echo "ack   #$round: $line"
  # Delivery: what is still queued when the load ends, drained alone.
  h0=$(curl -s "http://$UP/__hits"); t0=$(date +%s.%N)
  while [ $(( $(curl -s "http://$UP/__hits") - h )) -lt "$N" ]; do sleep 0.05; done
  t1=$(date +%s.%N)
  echo "delivery #$round: $((N - (h0 - h))) left after the load, drained in $(echo "$t1 - $t0" | bc) s: $(echo "($N - ($h0 - $h)) / ($t1 - $t0)" | bc) /s"
  stop ack
  echo "queue file after $N entries (waiting ones and delivered): $(stat -c %s "$work/ack$round/queue.redb") bytes"
done

[ "${OPEN_LOOP:-0}" = 1 ] || [ -n "${RATE:-}" ] || exit 0
OPEN_SECONDS=${OPEN_SECONDS:-4}
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
if [ -n "${RATE:-}" ]; then
  rates=$RATE
else
  max=$(awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^rps=/) { split($i, kv, "="); if (!($1 in m) || kv[2] < m[$1]) m[$1] = kv[2] } }
    END { print (m["sync"] < m["ack"]) ? m["sync"] : m["ack"] }' "$work/closed")
  rates=""; for pct in ${OPEN_PCTS:-25 50 75}; do rates="$rates $(( max * pct / 100 ))"; done
  echo "open loop at ${OPEN_PCTS:-25 50 75} % of $max rps (the lower closed-loop maximum): $rates rps"
fi
table="| mode | rate rps | achieved rps | p50 ms | p99 ms | p99.9 ms | max ms | pacer p99 ms | errors |"$'\n'"|---|---|---|---|---|---|---|---|---|"
for rate in $rates; do
  [ "$rate" -gt 0 ] || continue
  n=$(( rate * OPEN_SECONDS ))
  for mode in sync ack; do
    if [ "$mode" = sync ]; then
      gw=$(start open "${common[@]}")
    else
      gw=$(start open "${common[@]}" --ack-then-deliver /notify --data-dir "$work/open-$rate")
    fi
    line=$(load "$gw" --requests "$n" --rate "$rate" || true)
    stop open
    echo "$mode open $rate/s: $line"
    table+=$'\n'"| $mode | $rate | $(echo "$line" | field rps) | $(echo "$line" | field p50_ms) | $(echo "$line" | field p99_ms) | $(echo "$line" | field p999_ms) | $(echo "$line" | field max_ms) | $(echo "$line" | field pacer_p99_ms) | $(echo "$line" | field errors) |"
  done
done
echo
echo "$table"
