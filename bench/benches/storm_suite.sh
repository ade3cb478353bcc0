#!/usr/bin/env bash
# Every retry-storm scenario of BENCHMARKS.md in one run: burst, backlog and
# double submit, for the bare handler, axum-idempotent 0.6 and our stack on
# the memory store, a standalone Redis and a 3-master Redis Cluster (1 and 3
# instances). Each row runs RUNS times (default 3); the table shows medians
# (worst for duplicates and lost).
#
#   bench/benches/storm_suite.sh            # needs redis-server and redis-cli on PATH
#   RUNS=1 bench/benches/storm_suite.sh
#
# It starts its own Redis servers in a temp dir on free ports (each Cluster
# node with an explicit bus port: port + 10000 may not exist) and stops them
# on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}
cargo build -q --release --example retry_storm
B=${CARGO_TARGET_DIR:-target}/release/examples/retry_storm

dir=$(mktemp -d)
ports=()
cleanup() {
    for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
    rm -rf "$dir"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_redis() { # port extra-args...
    local p=$1; shift
    mkdir -p "$dir/$p"
    redis-server --port "$p" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
        --dir "$dir/$p" --logfile "$dir/$p/log" "$@" >/dev/null
    ports+=("$p")
    for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && return; sleep 0.1; done
    echo "redis on $p did not start" >&2; exit 1
}
R=$(free_port); start_redis "$R"
C=(); for _ in 1 2 3; do p=$(free_port); C+=("$p"); start_redis "$p" --cluster-enabled yes --cluster-config-file "$dir/$p/nodes.conf" --cluster-port "$(free_port)"; done
redis-cli --cluster create "127.0.0.1:${C[0]}" "127.0.0.1:${C[1]}" "127.0.0.1:${C[2]}" --cluster-replicas 0 --cluster-yes >/dev/null
until redis-cli -p "${C[0]}" cluster info | grep -q cluster_state:ok; do sleep 0.2; done
sleep 1
REDIS="redis://127.0.0.1:$R"
CLUSTER="redis+cluster://127.0.0.1:${C[0]},127.0.0.1:${C[1]},127.0.0.1:${C[2]}"

BURST="--transactions 2000 --duplicates 7"
BACKLOG="--transactions 5000 --duplicates 10 --concurrency 500"
DOUBLE="--scenario double-submit --transactions 1000 --duplicates 3 --handler-ms 200 --concurrency 256"
UNIQUE="--transactions 20000 --duplicates 1 --handler-ms 0"

rows=(
    "burst|none|$BURST --baseline none"
    "burst|axum-idempotent (cookie)|$BURST --baseline axum-idempotent"
    "burst|axum-idempotent (no cookie)|$BURST --baseline axum-idempotent-nocookie"
    "burst|ours, memory|$BURST"
    "burst|ours, Redis|$BURST --store $REDIS"
    "burst|ours, 3 instances, Redis|$BURST --store $REDIS --instances 3"
    "burst|ours, Cluster|$BURST --store $CLUSTER"
    "burst|ours, 3 instances, Cluster|$BURST --store $CLUSTER --instances 3"
    "backlog|none|$BACKLOG --baseline none"
    "backlog|axum-idempotent (cookie)|$BACKLOG --baseline axum-idempotent"
    "backlog|ours, memory|$BACKLOG"
    "backlog|ours, Redis|$BACKLOG --store $REDIS"
    "backlog|ours, 3 instances, Redis|$BACKLOG --store $REDIS --instances 3"
    "double submit|none|$DOUBLE --baseline none"
    "double submit|axum-idempotent (cookie)|$DOUBLE --baseline axum-idempotent"
    "double submit|ours, memory|$DOUBLE"
    "double submit|ours, Redis|$DOUBLE --store $REDIS"
    "double submit|ours, 3 instances, Redis|$DOUBLE --store $REDIS --instances 3"
    "unique keys|none|$UNIQUE --baseline none"
    "unique keys|axum-idempotent (cookie)|$UNIQUE --baseline axum-idempotent"
    "unique keys|ours, memory|$UNIQUE"
    "unique keys|ours, Redis|$UNIQUE --store $REDIS"
)
out="$dir/results"
for row in "${rows[@]}"; do
    IFS='|' read -r scenario system flags <<<"$row"
    for _ in $(seq "$RUNS"); do
        # shellcheck disable=SC2086
        echo "$scenario|$system|$($B $flags --json | tail -n 1)" >>"$out"
    done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    scenario, system, js = line.rstrip("\n").split("|", 2)
    rows.setdefault((scenario, system), []).append(json.loads(js))
print("| scenario | system | executions per notification | duplicate executions | lost | rps | p50 ms | p99 ms | max ms | peak RSS MB |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (scenario, system), ds in rows.items():
    med = lambda k: statistics.median(d[k] for d in ds)
    per = med("handler_executions") / ds[0]["transactions"]
    print(f"| {scenario} | {system} | {per:.2f} | {max(d['duplicate_executions'] for d in ds)} | "
          f"{max(d['lost'] for d in ds)} | {med('throughput_rps'):,.0f} | {med('p50_ms'):.1f} | "
          f"{med('p99_ms'):.1f} | {med('max_ms'):.1f} | {med('peak_rss_mb'):.1f} |")
PY
