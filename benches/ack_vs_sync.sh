#!/usr/bin/env bash
# Acknowledgement latency and ingest throughput of an ack-then-deliver route
# against the synchronous mode, and delivery throughput of the queue (what
# is still queued when the load ends, drained with no ingest beside it).
# Closed loop: examples/proxy_bench.rs load (C connections, one request in
# flight each), WeChat Pay v3 first deliveries.
#   benches/ack_vs_sync.sh [N] [C] [debug|release]
set -euo pipefail
N=${1:-3000}; C=${2:-64}; PROFILE=${3:-debug}
cd "$(dirname "$0")/.."
BIN=target/$PROFILE/examples
flag=""; [ "$PROFILE" = release ] && flag="--release"
cargo build -q $flag --all-features --example gateway --example proxy_bench
work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
start() { # name, args... -> prints the gateway's address
  "$BIN/gateway" "${@:2}" >"$work/$1.out" 2>"$work/$1.err" & echo $! >"$work/$1.pid"
  for _ in $(seq 100); do grep -q listening "$work/$1.out" 2>/dev/null && break; sleep 0.1; done
  sed -n 's/^listening on //p' "$work/$1.out"
}
stop() { kill "$(cat "$work/$1.pid")"; wait "$(cat "$work/$1.pid")" 2>/dev/null || true; }
"$BIN/proxy_bench" upstream >"$work/up.out" & sleep 0.5
UP=$(sed -n 's/^upstream on //p' "$work/up.out")
common=(--listen 127.0.0.1:0 --upstream "http://$UP" --route /notify=wechatpay-v3)
export RUST_LOG=warn
for round in 1 2; do
  gw=$(start sync "${common[@]}")
  echo "sync  #$round: $("$BIN/proxy_bench" load --target "http://$gw/notify" --upstream "$UP" --requests "$N" --connections "$C" --mode first)"
  stop sync
  gw=$(start ack "${common[@]}" --ack-then-deliver /notify --data-dir "$work/ack$round")
  h=$(curl -s "http://$UP/__hits")
  echo "ack   #$round: $("$BIN/proxy_bench" load --target "http://$gw/notify" --upstream "$UP" --requests "$N" --connections "$C" --mode first)"
  # Delivery: what is still queued when the load ends, drained alone.
  h0=$(curl -s "http://$UP/__hits"); t0=$(date +%s.%N)
  while [ $(( $(curl -s "http://$UP/__hits") - h )) -lt "$N" ]; do sleep 0.05; done
  t1=$(date +%s.%N)
  echo "delivery #$round: $((N - (h0 - h))) left after the load, drained in $(echo "$t1 - $t0" | bc) s: $(echo "($N - ($h0 - $h)) / ($t1 - $t0)" | bc) /s"
  stop ack
  echo "queue file after $N entries (waiting ones and delivered): $(stat -c %s "$work/ack$round/queue.redb") bytes"
done
