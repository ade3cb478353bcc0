#!/usr/bin/env bash
# The gateway (the idempotency-gateway binary, Redis store, `--route /=idempotency-key`)
# against idempotent-proxy-server (github.com/ldclabs/idempotent-proxy, a
# published Rust reverse proxy with idempotency keys over Redis), side by
# side on the same Redis, in front of the same trivial upstream
# (`proxy_bench upstream`), under the same load (`proxy_bench load --kind
# idempotency-key`: POST with an `Idempotency-Key` header, the header both
# proxies key on):
#
#   first   every request carries a new key: both forward all;
#   repeat  8 keys again and again: both answer from their record;
#   storm   new keys, each sent as 7 identical copies at the same instant
#           on 7 connections (`--copies 7`): how many times the upstream ran
#           each key (read from the upstream's per-key counts), and what the
#           copies got. STORMS lists CONNECTIONS:KEYS pairs, default
#           "7:500 63:90": 500 keys one at a time, then 90 keys 9 at a time.
#   retry   after each storm, every key of it once more on one connection, as
#           a client retries a request that failed or timed out: the row's
#           upstream hits are re-executions, and its executions per key count
#           the storm's and the retry's together.
#
# Every request has a TIMEOUT-second deadline (default 10; `--timeout`): a
# request still unanswered then counts as a `timeout` failure and its
# connection is closed, so a stalled proxy ends a run instead of hanging it.
# The repeat keys are first sent once each on one connection, so the
# repeat runs measure answers from records that exist.
#
# idempotent-proxy-server is a benchmark-only tool, not a dependency:
#
#   cargo install idempotent-proxy-server --root /some/dir
#   IDEMPOTENT_PROXY=/some/dir/bin/idempotent-proxy-server bench/benches/vs_idempotent_proxy.sh
#   REQUESTS=20000 RUNS=3 STORMS="7:500 63:90" TIMEOUT=10 bench/benches/vs_idempotent_proxy.sh
#
# Its configuration is a `.env` file in its working directory (read with
# dotenvy at start): SERVER_ADDR, REDIS_URL, URL_UPSTREAM (a request to
# /URL_UPSTREAM is forwarded to that URL), POLL_INTERVAL (how often a
# duplicate polls Redis for the first one's response; default 100 ms),
# REQUEST_TIMEOUT (the upstream deadline, which is also the TTL of its
# records; 30 s here), LOG_LEVEL=warn; no ECDSA_PUB_KEY_*/ED25519_PUB_KEY_*
# and no ALLOW_AGENTS, so access control is off. The gateway runs with
# RUST_LOG=warn and its defaults (4 s wait for a duplicate, 64 MiB local
# tier of completed records before Redis).
#
# Per mode: one warm-up run per target (WARMUP requests, not reported), then
# RUNS measured runs interleaved (idempotent-proxy, gateway); the table
# shows the median run by throughput and sums over the measured runs. Needs
# redis-server on PATH; starts its own on a free port (no persistence).
# Everything it starts is killed on exit.
set -euo pipefail

REQUESTS=${REQUESTS:-20000}
WARMUP=${WARMUP:-5000}
CONNECTIONS=${CONNECTIONS:-64}
RUNS=${RUNS:-3}
STORMS=${STORMS:-7:500 63:90}
TIMEOUT=${TIMEOUT:-10}
POLL_INTERVAL=${POLL_INTERVAL:-100}
IDEMPOTENT_PROXY=${IDEMPOTENT_PROXY:-$(command -v idempotent-proxy-server || true)}

cd "$(dirname "$0")/../.."
[ -x "$IDEMPOTENT_PROXY" ] || {
    echo "idempotent-proxy-server not found: cargo install idempotent-proxy-server --root DIR," \
        "then IDEMPOTENT_PROXY=DIR/bin/idempotent-proxy-server" >&2
    exit 1
}
command -v redis-server >/dev/null || { echo "redis-server not found" >&2; exit 1; }

echo "# building (release)" >&2
cargo build --release --quiet -p idempotency-gateway -p idempotency-bench --bin idempotency-gateway --example proxy_bench
BIN=${CARGO_TARGET_DIR:-target}/release/examples
GATEWAY_BIN=${CARGO_TARGET_DIR:-target}/release/idempotency-gateway

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start vs_idempotent_proxy

# wait_http ADDR: until something answers HTTP at ADDR (any status).
wait_http() {
    local i
    for i in $(seq 100); do
        if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$1/" || true)" != 000 ]; then
            return 0
        fi
        sleep 0.1
    done
    echo "nothing answers at $1" >&2
    return 1
}

# --- redis
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no >"$TMP/redis.log" 2>&1 &
PIDS+=($!)
for i in $(seq 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
    [ "$i" = 100 ] && { echo "redis did not start" >&2; cat "$TMP/redis.log" >&2; exit 1; }
    sleep 0.1
done

# --- upstream
"$BIN/proxy_bench" upstream --listen 127.0.0.1:0 >"$TMP/upstream.out" &
PIDS+=($!)
UPSTREAM=$(wait_line "$TMP/upstream.out" "upstream on ")

# --- idempotent-proxy-server, configured by its .env
IPX_ADDR="127.0.0.1:$(free_port)"
mkdir -p "$TMP/ipx"
cat >"$TMP/ipx/.env" <<ENV
SERVER_ADDR=$IPX_ADDR
REDIS_URL=127.0.0.1:$REDIS_PORT
POLL_INTERVAL=$POLL_INTERVAL
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UPSTREAM=http://$UPSTREAM/notify
ENV
(cd "$TMP/ipx" && exec "$IDEMPOTENT_PROXY") >"$TMP/ipx/out" 2>"$TMP/ipx/err" &
PIDS+=($!)
wait_http "$IPX_ADDR" || { cat "$TMP/ipx/out" "$TMP/ipx/err" >&2; exit 1; }

# --- gateway on the same Redis
env RUST_LOG=warn "$GATEWAY_BIN" --listen 127.0.0.1:0 --upstream "http://$UPSTREAM" \
    --store "redis://127.0.0.1:$REDIS_PORT" --route /=idempotency-key \
    >"$TMP/gateway.out" 2>"$TMP/gateway.err" &
PIDS+=($!)
GATEWAY=$(wait_line "$TMP/gateway.out" "listening on ")

declare -A TARGET=(
    [idempotent-proxy]="http://$IPX_ADDR/URL_UPSTREAM"
    [gateway]="http://$GATEWAY/URL_UPSTREAM"
)
TARGETS=(idempotent-proxy gateway)

echo "# upstream $UPSTREAM, redis 127.0.0.1:$REDIS_PORT, idempotent-proxy-server $IPX_ADDR" \
    "($("$IDEMPOTENT_PROXY" --version 2>/dev/null || echo "$IDEMPOTENT_PROXY")), gateway $GATEWAY" >&2
echo "# $(nproc) cores; load: $(uptime)" >&2
echo "# requests/run $REQUESTS, connections $CONNECTIONS, runs $RUNS, storms (connections:keys, 7 copies each) $STORMS, timeout $TIMEOUT s" >&2

# run TARGET ARGS...: one load run, its key=value line on stdout (errors
# are results here, not failures of the script).
run() {
    "$BIN/proxy_bench" load --target "${TARGET[$1]}" --upstream "$UPSTREAM" \
        --kind idempotency-key --timeout "$TIMEOUT" "${@:2}" || true
}

: >"$TMP/results"
for t in "${TARGETS[@]}"; do
    run "$t" --mode repeat --keys 8 --requests 8 --connections 1 >/dev/null
done
for mode in first repeat; do
    for t in "${TARGETS[@]}"; do
        run "$t" --mode "$mode" --requests "$WARMUP" --connections "$CONNECTIONS" >/dev/null
    done
    for r in $(seq "$RUNS"); do
        for t in "${TARGETS[@]}"; do
            line=$(run "$t" --mode "$mode" --requests "$REQUESTS" --connections "$CONNECTIONS")
            echo "$t $mode run=$r $line" >&2
            echo "$t $mode $line" >>"$TMP/results"
        done
    done
done
for storm in $STORMS; do
    sc=${storm%%:*}
    keys=${storm##*:}
    for t in "${TARGETS[@]}"; do
        prefix="storm-$sc-$t-$$-"
        line=$(run "$t" --mode first --copies 7 --connections "$sc" --requests $(( keys * 7 )) \
            --id-prefix "$prefix")
        echo "$t storm/$sc $line" >&2
        echo "$t storm/$sc $line" >>"$TMP/results"
        line=$(run "$t" --mode first --connections 1 --requests "$keys" --id-prefix "$prefix")
        echo "$t retry/$sc $line" >&2
        echo "$t retry/$sc $line" >>"$TMP/results"
    done
done

# summary TARGET SCENARIO: the median run by throughput, and sums.
summary() {
    awk -v want_t="$1" -v want_s="$2" '
        $1 == want_t && $2 == want_s {
            delete f
            for (i = 3; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            n++; rps[n] = f["rps"]; p50[n] = f["p50_ms"]; p99[n] = f["p99_ms"]; mx[n] = f["max_ms"]
            hits += f["upstream_hits"]; reqs += f["requests"]; errs += f["errors"]
            if (f["failures"] != "-") fails = fails (fails == "" ? "" : " ") f["failures"]
            kmax = f["key_max"] > kmax ? f["key_max"] : kmax
            dist = f["key_dist"]
        }
        END {
            for (i = 1; i <= n; i++) idx[i] = i
            for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
                if (rps[idx[j]] < rps[idx[i]]) { t = idx[i]; idx[i] = idx[j]; idx[j] = t }
            m = idx[int((n + 1) / 2)]
            printf "| %s | %s | %d | %.2f | %.2f | %.2f | %d / %d | %d | %s | %s | %s |\n",
                want_s, want_t, rps[m], p50[m], p99[m], mx[m], hits, reqs, errs,
                (fails == "" ? "-" : fails), (kmax == "" ? "-" : kmax), (dist == "" ? "-" : dist)
        }' "$TMP/results"
}

echo
echo "| scenario | target | rps | p50 ms | p99 ms | max ms | upstream hits / requests | errors | failures | executions per key, max | keys by executions |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for s in first repeat $(for storm in $STORMS; do echo "storm/${storm%%:*} retry/${storm%%:*}"; done); do
    for t in "${TARGETS[@]}"; do
        summary "$t" "$s"
    done
done
