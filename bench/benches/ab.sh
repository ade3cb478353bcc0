#!/usr/bin/env bash
# A/B of the gateway: the working tree against another commit, with nginx
# and a bare hyper server in the same rounds, under wrk (apt-get install
# nginx wrk; valgrind for the instruction counts).
#
#   bench/benches/ab.sh REF                     # e.g. bench/benches/ab.sh 2068e03
#   ROUNDS=7 SECONDS_PER_RUN=4 bench/benches/ab.sh main
#   SERVER_CPUS=1 CLIENT_CPUS=0 bench/benches/ab.sh 2068e03
#
# REF is built (release, `-p idempotency-gateway`) in a git
# worktree of its own under AB_DIR (default target/ab) with a target
# directory of its own (seeded from the working tree's release build, so
# that the dependencies are not built again), both kept for the next run;
# the working tree's gateway and the bare hyper server
# (`--example hyper_200`) are built as they are. Then, all at once on
# loopback:
#
#   upstream   nginx answering `return 200` itself (also a target,
#              `return200`: a server that does nothing);
#   nginx      nginx `proxy_pass` to that upstream (keepalive pool);
#   hyper      the bare hyper server (bench/examples/hyper_200.rs): served
#              as the gateway serves (a runtime per core, SO_REUSEPORT, the
#              same allocator), it answers 200 and does nothing else: the
#              ceiling of a Rust server on this machine;
#   new, old   the working tree's gateway and REF's, `--route /=wechatpay-v3`
#              in front of that upstream, each with its own memory store.
#
# Each round runs, per mode, every target once (wrk, THREADS threads,
# CONNECTIONS connections, SECONDS_PER_RUN seconds), the order rotated every
# round so that no target always runs first or last:
#
#   first    WeChat Pay v3 notifications with ids never sent before
#            (bench/benches/wrk_notify.lua, MODE=first, a prefix per run): every
#            one a first delivery, forwarded;
#   repeat   the same 8 ids over and over (MODE=repeat): after the first 8,
#            every request a replay from the store (nginx forwards each).
#
# Pinning: with SERVER_CPUS (a taskset list) every server the script starts
# (both nginx, the bare hyper server and both gateways) runs on those CPUs,
# and wrk on CLIENT_CPUS (default: the others); without it nothing is
# pinned. Either way the table's header says which.
#
# Printed: per ratio, each round's value, the median and the inter-quartile
# range (Q1–Q3, the spread); for new ÷ old a verdict that only the spread
# can give: "faster" when even Q1 is above 1, "slower" when even Q3 is below
# 1, "within the spread" otherwise. Never absolute numbers, which move with
# the machine. Then (INSTRUCTIONS=0 skips it) the instructions per request
# of new, old and the bare hyper server under callgrind
# (bench/benches/gateway_instructions.sh), which do not move with the
# machine. Every process the script starts is killed on exit.
set -euo pipefail

REF=${1:?usage: bench/benches/ab.sh REF}
ROUNDS=${ROUNDS:-11}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-4}
THREADS=${THREADS:-2}
CONNECTIONS=${CONNECTIONS:-64}
NGINX_WORKERS=${NGINX_WORKERS:-auto}
SERVER_CPUS=${SERVER_CPUS:-}
CLIENT_CPUS=${CLIENT_CPUS:-}
INSTRUCTIONS=${INSTRUCTIONS:-1}

cd "$(dirname "$0")/../.."
# Release builds ship without debug info; perf's and callgrind's
# line-level symbols need it (both sides of an A/B alike: the variable
# works for commits from before the release profile dropped it too).
export CARGO_PROFILE_RELEASE_DEBUG=${CARGO_PROFILE_RELEASE_DEBUG:-1}
ROOT=$PWD
for tool in nginx wrk git cargo; do
    command -v "$tool" >/dev/null || { echo "$tool not found (apt-get install -y nginx wrk)" >&2; exit 1; }
done
AB_DIR=${AB_DIR:-$ROOT/target/ab}
SHA=$(git rev-parse --short=12 "$REF^{commit}")

# --- builds
OLD_TREE=$AB_DIR/tree-$SHA
OLD_TARGET=$AB_DIR/target-$SHA
# OLD_BIN=path: a gateway binary already built for REF (REF then only names it).
# A REF from before the workspace builds the gateway as an example.
if git cat-file -e "$SHA:gateway/Cargo.toml" 2>/dev/null; then
    OLD_BUILD=(-p idempotency-gateway); OLD_PATH=release/idempotency-gateway
else
    OLD_BUILD=(--all-features --example gateway); OLD_PATH=release/examples/gateway
fi
OLD_BIN=${OLD_BIN:-$OLD_TARGET/$OLD_PATH}
if [ ! -x "$OLD_BIN" ]; then
    mkdir -p "$AB_DIR"
    [ -d "$OLD_TREE" ] || git worktree add --detach "$OLD_TREE" "$SHA" >&2
    # The dependencies built for the working tree, if any, are not built again.
    NEW_RELEASE=${CARGO_TARGET_DIR:-$ROOT/target}/release
    if [ ! -d "$OLD_TARGET/release" ] && [ -d "$NEW_RELEASE/deps" ]; then
        mkdir -p "$OLD_TARGET"
        cp -a "$NEW_RELEASE" "$OLD_TARGET/release"
        # This crate's own artifacts are not reused: the copies are newer
        # than REF's checkout, so cargo would take them as REF's build.
        rm -rf "$OLD_TARGET"/release/.fingerprint/tower-idempotency-* \
            "$OLD_TARGET"/release/.fingerprint/idempotency-gateway-*
    fi
    echo "# building $REF ($SHA) in $OLD_TREE (release)" >&2
    (cd "$OLD_TREE" && CARGO_TARGET_DIR=$OLD_TARGET cargo build --release --quiet "${OLD_BUILD[@]}")
fi
# NEW_BIN=path: the working tree's gateway, already built; HYPER_BIN=path:
# the bare hyper server, already built.
if [ -z "${NEW_BIN:-}" ]; then
    echo "# building the working tree (release)" >&2
    cargo build --release --quiet -p idempotency-gateway
    NEW_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/idempotency-gateway
fi
if [ -z "${HYPER_BIN:-}" ]; then
    cargo build --release --quiet -p idempotency-bench --example hyper_200
    HYPER_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/hyper_200
fi

# Pinning: the same CPUs for every server, others for wrk, or none.
SERVER_PIN=()
CLIENT_PIN=()
if [ -n "$SERVER_CPUS" ]; then
    command -v taskset >/dev/null || { echo "taskset not found (util-linux)" >&2; exit 1; }
    if [ -z "$CLIENT_CPUS" ]; then
        CLIENT_CPUS=$(python3 -c "
import os, sys
mine = set()
for part in sys.argv[1].split(','):
    a, _, b = part.partition('-')
    mine.update(range(int(a), int(b or a) + 1))
rest = sorted(set(os.sched_getaffinity(0)) - mine)
print(','.join(map(str, rest)) or sys.argv[1])" "$SERVER_CPUS")
    fi
    SERVER_PIN=(taskset -c "$SERVER_CPUS")
    CLIENT_PIN=(taskset -c "$CLIENT_CPUS")
    PINNING="servers on CPUs $SERVER_CPUS, wrk on CPUs $CLIENT_CPUS"
else
    PINNING="nothing pinned (SERVER_CPUS unset)"
fi

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start ab

# --- nginx: the upstream (`return 200`) and the proxy in front of it
UP_PORT=$(free_port)
NGINX_PORT=$(free_port)
NGINX_PREFIX=("${SERVER_PIN[@]}")
start_nginx $NGINX_WORKERS <<EOF
    upstream app {
        server 127.0.0.1:$UP_PORT;
        keepalive 128;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$UP_PORT;
        location / {
            return 200 "ok\n";
        }
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

# --- the two gateways
start_gateway() { # NAME BIN
    RUST_LOG=warn "${SERVER_PIN[@]}" "$2" --listen 127.0.0.1:0 --upstream "http://127.0.0.1:$UP_PORT" \
        --route /=wechatpay-v3 >"$TMP/$1.out" 2>"$TMP/$1.err" &
    PIDS+=($!)
}
start_gateway new "$NEW_BIN"
start_gateway old "$OLD_BIN"
"${SERVER_PIN[@]}" "$HYPER_BIN" --listen 127.0.0.1:0 >"$TMP/hyper.out" 2>"$TMP/hyper.err" &
PIDS+=($!)
NEW=$(wait_line "$TMP/new.out" "listening on ")
OLD=$(wait_line "$TMP/old.out" "listening on ")
HYPER=$(wait_line "$TMP/hyper.out" "listening on ")
for i in $(seq 100); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$UP_PORT/" 2>/dev/null \
        && curl -fsS -o /dev/null "http://127.0.0.1:$NGINX_PORT/" 2>/dev/null; then
        break
    fi
    [ "$i" = 100 ] && { echo "nginx did not start:" >&2; cat "$TMP/nginx/stderr" "$TMP/nginx/error.log" >&2; exit 1; }
    sleep 0.1
done

declare -A TARGET=(
    [new]="http://$NEW/notify"
    [old]="http://$OLD/notify"
    [nginx]="http://127.0.0.1:$NGINX_PORT/notify"
    [return200]="http://127.0.0.1:$UP_PORT/notify"
    [hyper]="http://$HYPER/notify"
)
NAMES=(new old nginx return200 hyper)

echo "# new: working tree ($(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +changes)) on $NEW;" \
    "old: $REF ($SHA) on $OLD; nginx proxy 127.0.0.1:$NGINX_PORT; return 200 127.0.0.1:$UP_PORT; hyper $HYPER" >&2
echo "# $(nproc) cores; load: $(uptime)" >&2
echo "# $PINNING" >&2
echo "# rounds $ROUNDS, wrk -t$THREADS -c$CONNECTIONS -d${SECONDS_PER_RUN}s per target and mode" >&2

# run TARGET MODE SECONDS PREFIX: wrk's rps, and its errors checked.
run() {
    local out
    out=$(MODE=$2 PREFIX=$4 "${CLIENT_PIN[@]}" wrk -t"$THREADS" -c"$CONNECTIONS" -d"$3s" -s bench/benches/wrk_notify.lua "${TARGET[$1]}" 2>&1 | grep '^wrk: ')
    echo "$1 $2 $out" >>"$TMP/raw"
    local errors non2xx
    errors=$(sed -n 's/.* errors=\([0-9]*\).*/\1/p' <<<"$out")
    non2xx=$(sed -n 's/.* non2xx=\([0-9]*\).*/\1/p' <<<"$out")
    if [ "${errors:-1}" != 0 ] || [ "${non2xx:-1}" != 0 ]; then
        echo "# $1 $2: $out" >&2
    fi
    sed -n 's/.* rps=\([0-9]*\).*/\1/p' <<<"$out"
}

# Warm-up: connections, pools, and the 8 repeat ids stored by each gateway.
for t in "${NAMES[@]}"; do
    run "$t" first 1 "warm-$t" >/dev/null
    run "$t" repeat 1 "rep" >/dev/null
done

: >"$TMP/ratios"
for r in $(seq "$ROUNDS"); do
    for mode in first repeat; do
        declare -A RPS=()
        # Rotate the order: round 1 new old nginx return200 hyper, round 2
        # old nginx return200 hyper new, ...
        for k in 0 1 2 3 4; do
            t=${NAMES[$(( (k + r - 1) % 5 ))]}
            RPS[$t]=$(run "$t" "$mode" "$SECONDS_PER_RUN" "r$r-$t")
        done
        ratio() { awk -v a="${RPS[$1]}" -v b="${RPS[$2]}" 'BEGIN { printf "%.3f", a / b }'; }
        if [ "$mode" = first ]; then
            echo "first new/old $(ratio new old)" >>"$TMP/ratios"
            echo "first new/nginx $(ratio new nginx)" >>"$TMP/ratios"
            echo "first old/nginx $(ratio old nginx)" >>"$TMP/ratios"
            echo "first nginx/return200 $(ratio nginx return200)" >>"$TMP/ratios"
            echo "first new/hyper $(ratio new hyper)" >>"$TMP/ratios"
        else
            echo "repeat new/old $(ratio new old)" >>"$TMP/ratios"
            echo "repeat new/return200 $(ratio new return200)" >>"$TMP/ratios"
            echo "repeat old/return200 $(ratio old return200)" >>"$TMP/ratios"
            echo "repeat new/nginx $(ratio new nginx)" >>"$TMP/ratios"
            echo "repeat new/hyper $(ratio new hyper)" >>"$TMP/ratios"
            echo "repeat old/hyper $(ratio old hyper)" >>"$TMP/ratios"
            echo "repeat hyper/return200 $(ratio hyper return200)" >>"$TMP/ratios"
        fi
        echo "# round $r $mode: $(grep -c . "$TMP/ratios") ratios so far" >&2
        unset RPS
    done
done

echo
echo "$PINNING; wrk -t$THREADS -c$CONNECTIONS -d${SECONDS_PER_RUN}s, $ROUNDS rounds, the order rotated"
echo
echo "| mode | ratio | per round | median | Q1–Q3 | verdict |"
echo "|---|---|---|---|---|---|"
awk '
    # The p-quantile of the sorted s[1..m], linear between the two nearest.
    function q(p,   h, lo) { h = (m - 1) * p + 1; lo = int(h); return s[lo] + (h - lo) * (s[lo + 1] - s[lo]) }
    { key = $1 " " $2; if (!(key in n)) order[++k] = key; v[key, ++n[key]] = $3 }
    END {
        for (i = 1; i <= k; i++) {
            key = order[i]; m = n[key]; list = ""
            delete s
            for (j = 1; j <= m; j++) { s[j] = v[key, j]; list = list (j > 1 ? ", " : "") v[key, j] }
            for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (s[b] < s[a]) { t = s[a]; s[a] = s[b]; s[b] = t }
            s[m + 1] = s[m]
            med = q(0.5); q1 = q(0.25); q3 = q(0.75)
            split(key, kv, " ")
            verdict = ""
            if (kv[2] == "new/old") verdict = q1 > 1 ? "faster" : (q3 < 1 ? "slower" : "within the spread")
            printf "| %s | %s | %s | **%.3f** | %.3f–%.3f | %s |\n", kv[1], kv[2], list, med, q1, q3, verdict
        }
    }' "$TMP/ratios"

if [ "$INSTRUCTIONS" = 1 ]; then
    if command -v valgrind >/dev/null; then
        echo
        echo "Instructions per request (callgrind, one serving thread; new, old, hyper):"
        echo
        bench/benches/gateway_instructions.sh "$NEW_BIN" "$OLD_BIN" "$HYPER_BIN"
    else
        echo "# valgrind not found: no instruction counts (apt-get install valgrind)" >&2
    fi
fi
