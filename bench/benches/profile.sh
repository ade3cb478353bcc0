#!/usr/bin/env bash
# Where the release gateway's time goes under wrk, per mode (first
# deliveries, replays): `perf record -g` for one run and the top of
# `perf report`, then syscalls per request (`strace -c -f` for one run).
# Needs nginx, wrk, perf (linux-perf) and strace.
#
#   bench/benches/profile.sh                  # the working tree's gateway
#   GATEWAY=path/to/gateway TOP=40 bench/benches/profile.sh
#
# Upstream: nginx answering `return 200` itself; the gateway on
# `--route /=wechatpay-v3` in front of it; wrk -t1 -c64 (bench/benches/wrk_notify.lua).
set -euo pipefail

SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
TOP=${TOP:-30}
cd "$(dirname "$0")/../.."
# Release builds ship without debug info; perf's and callgrind's
# line-level symbols need it (both sides of an A/B alike: the variable
# works for commits from before the release profile dropped it too).
export CARGO_PROFILE_RELEASE_DEBUG=${CARGO_PROFILE_RELEASE_DEBUG:-1}
for tool in nginx wrk perf strace; do
    command -v "$tool" >/dev/null || { echo "$tool not found (apt-get install -y nginx wrk linux-perf strace)" >&2; exit 1; }
done
if [ -z "${GATEWAY:-}" ]; then
    cargo build --release --quiet -p idempotency-gateway
    GATEWAY=${CARGO_TARGET_DIR:-target}/release/idempotency-gateway
fi

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start profile

UP_PORT=$(free_port)
start_nginx 1 <<EOF
    server {
        listen 127.0.0.1:$UP_PORT;
        location / { return 200 "ok\n"; }
    }
EOF

start() { # the gateway, its pid in GW_PID, address in GW
    RUST_LOG=warn "$GATEWAY" --listen 127.0.0.1:0 --upstream "http://127.0.0.1:$UP_PORT" \
        --route /=wechatpay-v3 >"$TMP/gw.out" 2>"$TMP/gw.err" &
    GW_PID=$!
    PIDS+=($GW_PID)
    GW=$(wait_line "$TMP/gw.out" "listening on ")
}

wrk_run() { # MODE SECONDS PREFIX
    MODE=$1 PREFIX=$3 wrk -t1 -c64 -d"$2s" -s bench/benches/wrk_notify.lua "http://$GW/notify" | grep '^wrk: '
}

start
wrk_run first 1 warm >/dev/null
wrk_run repeat 1 rep >/dev/null
for mode in first repeat; do
    perf record -F "${FREQ:-4999}" --call-graph "${CALLGRAPH:-fp}" -p "$GW_PID" -o "$TMP/$mode.data" -- sleep "$SECONDS_PER_RUN" 2>/dev/null &
    rec=$!
    wrk_run "$mode" "$SECONDS_PER_RUN" "prof-$mode"
    wait "$rec" || true
    # PERF_OUT=DIR keeps the recordings (first.data, repeat.data).
    [ -z "${PERF_OUT:-}" ] || { mkdir -p "$PERF_OUT"; cp "$TMP/$mode.data" "$PERF_OUT/"; }
    perf report -i "$TMP/$mode.data" --no-children --percent-limit 0 --sort symbol \
        --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | sed 's/ *$//' >"$TMP/$mode.txt"
    samples=$(perf report -i "$TMP/$mode.data" --stdio 2>/dev/null | sed -n 's/^# Samples: \([^ ]*\).*/\1/p' | head -n1 || true)
    echo
    echo "## $mode: self time by part ($samples samples)"
    # The kernel, the allocator, and user-space symbols by the crate they name first.
    awk '{
        pct = $1; sub("%", "", pct); kind = $2; $1 = ""; $2 = ""; sym = substr($0, 3)
        if (kind == "[k]") part = "kernel"
        else if (sym ~ /^_?mi_|malloc|free|memmove|memcpy|memset|realloc/) part = "allocator, memcpy"
        else if (sym ~ /clock_gettime|vdso/) part = "clock_gettime"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?tower_idempotency/) part = "tower_idempotency"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?hyper_util/) part = "hyper_util"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?hyper/) part = "hyper"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?tokio/) part = "tokio"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?(http|bytes|httparse)/) part = "http, bytes, httparse"
        else if (sym ~ /^(<)?(core::ptr::drop_in_place<)?(gateway|tower_http|tower)/) part = "gateway example, tower"
        else if (sym ~ /serde_json/) part = "serde_json"
        else if (sym ~ /sha2|ring::/) part = "sha2, ring"
        else if (sym ~ /moka|hashbrown|foldhash|metrics/) part = "hash maps, metrics"
        else part = "other"
        sum[part] += pct
    } END { for (p in sum) printf "%6.2f%%  %s\n", sum[p], p }' "$TMP/$mode.txt" | sort -nr
    echo
    echo "## $mode: top $TOP symbols (self time)"
    cut -c1-150 "$TMP/$mode.txt" | head -n "$TOP" || true
done

# Syscalls per request: strace attached to every thread of the running
# gateway for one run per mode (the warm-up runs above are not counted).
for mode in first repeat; do
    tids=$(ls "/proc/$GW_PID/task" | sed 's/^/-p /')
    # shellcheck disable=SC2086
    strace -c -f -o "$TMP/strace.$mode" $tids 2>/dev/null &
    st=$!
    sleep 1
    line=$(wrk_run "$mode" "$SECONDS_PER_RUN" "strace-$mode")
    kill -INT "$st"
    wait "$st" 2>/dev/null || true
    n=$(sed -n 's/.* requests=\([0-9]*\).*/\1/p' <<<"$line")
    echo
    echo "## $mode: syscalls per request under strace ($line)"
    awk -v n="$n" '$1 ~ /^[0-9.]+$/ && NF >= 5 { name = $NF; calls = $4; if (name != "total") printf "%-16s %.2f\n", name, calls / n }' \
        "$TMP/strace.$mode" | sort -k2 -nr | head -n 12 || true
done
