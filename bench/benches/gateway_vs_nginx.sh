#!/usr/bin/env bash
# The idempotency gateway (the idempotency-gateway binary) against nginx `proxy_pass`,
# both in front of the same trivial upstream (bench/examples/proxy_bench/), for
# WeChat Pay v3 notifications:
#
#   first   every request carries a new notification id: both forward all;
#   repeat  the same few ids again and again: the gateway replays them from
#           its store without touching the upstream, nginx forwards each.
#
# Usage (from the crate root; needs nginx on PATH, e.g. `apt-get install nginx`):
#
#   bench/benches/gateway_vs_nginx.sh
#   REQUESTS=100000 CONNECTIONS=64 RUNS=3 NGINX_WORKERS=auto bench/benches/gateway_vs_nginx.sh
#   NGINX_WORKERS=1 GATEWAY_WORKERS=1 bench/benches/gateway_vs_nginx.sh   # one core each
#   OPEN_LOOP=1 bench/benches/gateway_vs_nginx.sh   # also honest latency, below
#
# With OPEN_LOOP=1, after the throughput table, each of nginx and the
# gateway is driven per mode in an open loop (`proxy_bench load --rate`,
# latency from each request's scheduled send time, as wrk2 does) at 25, 50
# and 75 % of its own median closed-loop throughput above, OPEN_SECONDS
# (default 4) each, and a second table shows p50/p99/p99.9/max.
#
# Per target and mode: one warm-up run (WARMUP requests, not reported), then
# RUNS measured runs, interleaved nginx / gateway so that drift on the
# machine hits both alike. The table shows the median run (by throughput)
# and the upstream hits summed over the measured runs. A `direct` row (the
# load generator straight at the upstream) shows the ceiling.
#
# Both proxies log no access lines (nginx `access_log off`, gateway
# RUST_LOG=warn): this compares proxying, not log writing.
#
# Everything it starts (upstream, nginx, gateway) is killed on exit.
set -euo pipefail

REQUESTS=${REQUESTS:-100000}
WARMUP=${WARMUP:-20000}
CONNECTIONS=${CONNECTIONS:-64}
RUNS=${RUNS:-3}
KEYS=${KEYS:-8}
# nginx worker processes: `auto` is one per core (2 here), which matches the
# gateway's serving threads (`--workers`, one per core by default). Set 1 to
# compare a single nginx worker.
NGINX_WORKERS=${NGINX_WORKERS:-auto}
# Gateway serving threads (`--workers`); empty means its default, one per core.
GATEWAY_WORKERS=${GATEWAY_WORKERS:-}

cd "$(dirname "$0")/../.."
command -v nginx >/dev/null || { echo "nginx not found (apt-get install -y nginx)" >&2; exit 1; }

echo "# building (release)" >&2
cargo build --release --quiet -p idempotency-gateway -p idempotency-bench --bin idempotency-gateway --example proxy_bench
BIN=${CARGO_TARGET_DIR:-target}/release/examples
GATEWAY_BIN=${CARGO_TARGET_DIR:-target}/release/idempotency-gateway

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start gateway_vs_nginx

# --- upstream
"$BIN/proxy_bench" upstream --listen 127.0.0.1:0 >"$TMP/upstream.out" &
PIDS+=($!)
UPSTREAM=$(wait_line "$TMP/upstream.out" "upstream on ")

# --- nginx
NGINX_PORT=$(free_port)
start_nginx $NGINX_WORKERS <<EOF
    upstream app {
        server $UPSTREAM;
        keepalive 128;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
EOF

# --- gateway
RUST_LOG=warn "$GATEWAY_BIN" --listen 127.0.0.1:0 --upstream "http://$UPSTREAM" \
    --route /=wechatpay-v3 ${GATEWAY_WORKERS:+--workers "$GATEWAY_WORKERS"} >"$TMP/gateway.out" 2>"$TMP/gateway.err" &
PIDS+=($!)
GATEWAY=$(wait_line "$TMP/gateway.out" "listening on ")

# nginx is ready when it answers.
for i in $(seq 100); do
    if "$BIN/proxy_bench" load --target "http://127.0.0.1:$NGINX_PORT" --upstream "$UPSTREAM" \
        --requests 1 --connections 1 >/dev/null 2>&1; then
        break
    fi
    [ "$i" = 100 ] && { echo "nginx did not start:" >&2; cat "$TMP/nginx/stderr" "$TMP/nginx/error.log" >&2; exit 1; }
    sleep 0.1
done

echo "# upstream $UPSTREAM, nginx 127.0.0.1:$NGINX_PORT (worker_processes $NGINX_WORKERS)," \
    "gateway $GATEWAY (serving threads ${GATEWAY_WORKERS:-one per core})" >&2
echo "# $(nproc) cores; load: $(uptime)" >&2
echo "# requests/run $REQUESTS, connections $CONNECTIONS, runs $RUNS, repeat keys $KEYS" >&2

declare -A TARGET=(
    [direct]="http://$UPSTREAM"
    [nginx]="http://127.0.0.1:$NGINX_PORT"
    [gateway]="http://$GATEWAY"
)

# run TARGET MODE N: one load run, its key=value line on stdout.
run() {
    "$BIN/proxy_bench" load --target "${TARGET[$1]}" --upstream "$UPSTREAM" --mode "$2" \
        --requests "$3" --connections "$CONNECTIONS" --keys "$KEYS"
}

: >"$TMP/results"
for mode in first repeat; do
    for t in direct nginx gateway; do
        run "$t" "$mode" "$WARMUP" >/dev/null
    done
    for r in $(seq "$RUNS"); do
        for t in direct nginx gateway; do
            line=$(run "$t" "$mode" "$REQUESTS")
            echo "$t run=$r $line" >&2
            echo "$t $line" >>"$TMP/results"
        done
    done
done

# The median run by throughput per target and mode; upstream hits summed.
summary() {
    awk -v want_t="$1" -v want_m="$2" '
        $1 == want_t {
            delete f
            for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            if (f["mode"] != want_m) next
            n++; rps[n] = f["rps"]; p50[n] = f["p50_ms"]; p99[n] = f["p99_ms"]
            hits += f["upstream_hits"]; reqs += f["requests"]; errs += f["errors"]
        }
        END {
            # sort indices by rps
            for (i = 1; i <= n; i++) idx[i] = i
            for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
                if (rps[idx[j]] < rps[idx[i]]) { t = idx[i]; idx[i] = idx[j]; idx[j] = t }
            m = idx[int((n + 1) / 2)]
            printf "%s %s %d %.2f %.2f %d %d %d\n", want_t, want_m, rps[m], p50[m], p99[m], hits, reqs, errs
        }' "$TMP/results"
}

echo
echo "| mode | target | rps | p50 ms | p99 ms | upstream hits / requests | errors | rps vs nginx |"
echo "|---|---|---|---|---|---|---|---|"
for mode in first repeat; do
    nginx_rps=$(summary nginx "$mode" | awk '{print $3}')
    for t in direct nginx gateway; do
        read -r _ _ rps p50 p99 hits reqs errs < <(summary "$t" "$mode")
        ratio=$(awk -v a="$rps" -v b="$nginx_rps" 'BEGIN { printf "%.2f×", a / b }')
        echo "| $mode | $t | $rps | $p50 | $p99 | $hits / $reqs | $errs | $ratio |"
    done
done

[ "${OPEN_LOOP:-0}" = 1 ] || exit 0
OPEN_SECONDS=${OPEN_SECONDS:-4}
echo
echo "| mode | target | load | rate rps | achieved rps | p50 ms | p99 ms | p99.9 ms | max ms | pacer p99 ms | upstream hits / requests | errors |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for mode in first repeat; do
    for pct in 25 50 75; do
        for t in nginx gateway; do
            max=$(summary "$t" "$mode" | awk '{print $3}')
            rate=$(( max * pct / 100 ))
            n=$(( rate * OPEN_SECONDS ))
            line=$("$BIN/proxy_bench" load --target "${TARGET[$t]}" --upstream "$UPSTREAM" --mode "$mode" \
                --requests "$n" --connections "$CONNECTIONS" --keys "$KEYS" --rate "$rate" || true)
            echo "$t open $pct% $line" >&2
            echo "$line" | awk -v t="$t" -v pct="$pct" -v rate="$rate" '{
                for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
                printf "| %s | %s | %s %% | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s |\n",
                    f["mode"], t, pct, rate, f["rps"], f["p50_ms"], f["p99_ms"], f["p999_ms"], f["max_ms"],
                    f["pacer_p99_ms"], f["upstream_hits"], f["requests"], f["errors"]
            }'
        done
    done
done
