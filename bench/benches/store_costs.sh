#!/usr/bin/env bash
# What a first delivery and a replay cost on each store, side by side in one
# run: memory, Redis, PostgreSQL, Redis in front of PostgreSQL (tiered) and
# SQLite. Each store gets `retry_storm --duplicates 1 --handler-ms 0
# --repeat`: TRANSACTIONS distinct notifications (every one a first
# delivery), then each once more (every one a replay of its completed
# record). The stores take turns, RUNS rounds (default 3); the table shows
# medians and the ratio of each to the memory store.
#
#   bench/benches/store_costs.sh       # needs redis-server and PostgreSQL (initdb, postgres)
#   RUNS=5 TRANSACTIONS=10000 bench/benches/store_costs.sh
#   PG_SYNC=off bench/benches/store_costs.sh   # PostgreSQL's commits not waiting for the disk
#
# It starts its own Redis (no persistence) and PostgreSQL (its defaults:
# fsync and synchronous_commit on, unless PG_SYNC=off; as the `postgres`
# user when run as root) on free ports in a temp dir, and stops them on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/benches/lib.sh
RUNS=${RUNS:-3}
N=${TRANSACTIONS:-5000}
cargo build -q --release --example retry_storm
B=${CARGO_TARGET_DIR:-target}/release/examples/retry_storm
bench_start store_costs
chmod 755 "$TMP"

R=$(free_port)
redis-server --port "$R" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$TMP" --logfile "$TMP/redis.log" >/dev/null &
PIDS+=($!)
for _ in $(seq 50); do redis-cli -p "$R" ping >/dev/null 2>&1 && break; sleep 0.1; done

initdb=$(command -v initdb || ls /usr/lib/postgresql/*/bin/initdb | tail -n1)
pgbin=$(dirname "$initdb")
as_pg=()
if [ "$(id -u)" = 0 ]; then
    as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups --)
    mkdir "$TMP/pg" && chown postgres: "$TMP/pg"
fi
"${as_pg[@]}" "$pgbin/initdb" -D "$TMP/pg/data" -U postgres -A trust -E UTF8 >/dev/null
P=$(free_port)
"${as_pg[@]}" "$pgbin/postgres" -D "$TMP/pg/data" -p "$P" -k "$TMP/pg" \
    -c listen_addresses=127.0.0.1 -c max_connections=300 \
    -c synchronous_commit="${PG_SYNC:-on}" >"$TMP/pg/log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do grep -q "ready to accept connections" "$TMP/pg/log" && break; sleep 0.1; done

REDIS="redis://127.0.0.1:$R"
PG="postgres://postgres@127.0.0.1:$P/postgres"
stores=(
    "memory|memory"
    "Redis|$REDIS"
    "PostgreSQL|$PG"
    "tiered (Redis + PostgreSQL)|tiered:$REDIS+$PG"
    "SQLite|sqlite:$TMP/store.db"
)
flags="--baseline dedup --transactions $N --duplicates 1 --handler-ms 0 --repeat --json"
echo "retry_storm $flags --store S, $RUNS rounds" >&2
out=$TMP/results
for run in $(seq "$RUNS"); do
    for row in "${stores[@]}"; do
        name=${row%%|*}
        store=${row#*|}
        # The storm's line, then the repeat's.
        $B $flags --store "$store" 2>/dev/null | tail -n 2 | tr '\n' '\t' |
            sed "s/^/$name|/" >>"$out"
        echo >>"$out"
        echo "round $run: $name done" >&2
    done
done

python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    line = line.rstrip("\n\t")
    if not line:
        continue
    name, rest = line.split("|", 1)
    first, again = (json.loads(x) for x in rest.split("\t"))
    assert first["duplicate_executions"] == 0 and first["lost"] == 0, line
    assert again["handler_executions"] == 0 and again.get("phase") == "repeat", line
    rows.setdefault(name, []).append((first, again))
med = lambda xs: statistics.median(xs)
def cols(name):
    runs = rows[name]
    return {
        "first_rps": med([f["throughput_rps"] for f, _ in runs]),
        "first_p50": med([f["p50_ms"] for f, _ in runs]),
        "first_p99": med([f["p99_ms"] for f, _ in runs]),
        "replay_rps": med([a["throughput_rps"] for _, a in runs]),
        "replay_p50": med([a["p50_ms"] for _, a in runs]),
        "replay_p99": med([a["p99_ms"] for _, a in runs]),
    }
base = cols("memory")
print("| store | first delivery rps | × memory | p50 / p99 ms | replay rps | × memory | p50 / p99 ms |")
print("|---|---|---|---|---|---|---|")
for name in rows:
    c = cols(name)
    print(f"| {name} | {c['first_rps']:,.0f} | {c['first_rps'] / base['first_rps']:.2f}× "
          f"| {c['first_p50']:.2f} / {c['first_p99']:.2f} | {c['replay_rps']:,.0f} "
          f"| {c['replay_rps'] / base['replay_rps']:.2f}× | {c['replay_p50']:.2f} / {c['replay_p99']:.2f} |")
PY
