#!/usr/bin/env bash
# A/B of the gateway: the working tree against another commit, with nginx
# in the same rounds, under wrk (apt-get install nginx wrk).
#
#   bench/benches/ab.sh REF                     # e.g. bench/benches/ab.sh 2068e03
#   ROUNDS=7 SECONDS_PER_RUN=4 bench/benches/ab.sh main
#
# REF is built (release, `-p idempotency-gateway`) in a git
# worktree of its own under AB_DIR (default target/ab) with a target
# directory of its own (seeded from the working tree's release build, so
# that the dependencies are not built again), both kept for the next run;
# the working tree's gateway is built as it is. Then, all at once on loopback:
#
#   upstream   nginx answering `return 200` itself (also a target: the limit
#              a replay cannot beat, a server that does nothing);
#   nginx      nginx `proxy_pass` to that upstream (keepalive pool);
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
# Printed: per round, new ÷ old, new ÷ nginx, old ÷ nginx (first), new ÷
# old, new ÷ `return 200`, old ÷ `return 200` (repeat), and the median of
# each; never absolute numbers, which move with the machine. Every
# process the script starts is killed on exit.
set -euo pipefail

REF=${1:?usage: bench/benches/ab.sh REF}
ROUNDS=${ROUNDS:-5}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-4}
THREADS=${THREADS:-2}
CONNECTIONS=${CONNECTIONS:-64}
NGINX_WORKERS=${NGINX_WORKERS:-auto}

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
# NEW_BIN=path: the working tree's gateway, already built.
if [ -z "${NEW_BIN:-}" ]; then
    echo "# building the working tree (release)" >&2
    cargo build --release --quiet -p idempotency-gateway
    NEW_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/idempotency-gateway
fi

# shellcheck source=bench/benches/lib.sh
. bench/benches/lib.sh
bench_start ab

# --- nginx: the upstream (`return 200`) and the proxy in front of it
UP_PORT=$(free_port)
NGINX_PORT=$(free_port)
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
    RUST_LOG=warn "$2" --listen 127.0.0.1:0 --upstream "http://127.0.0.1:$UP_PORT" \
        --route /=wechatpay-v3 >"$TMP/$1.out" 2>"$TMP/$1.err" &
    PIDS+=($!)
}
start_gateway new "$NEW_BIN"
start_gateway old "$OLD_BIN"
NEW=$(wait_line "$TMP/new.out" "listening on ")
OLD=$(wait_line "$TMP/old.out" "listening on ")
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
)
NAMES=(new old nginx return200)

echo "# new: working tree ($(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +changes)) on $NEW;" \
    "old: $REF ($SHA) on $OLD; nginx proxy 127.0.0.1:$NGINX_PORT; return 200 127.0.0.1:$UP_PORT" >&2
echo "# $(nproc) cores; load: $(uptime)" >&2
echo "# rounds $ROUNDS, wrk -t$THREADS -c$CONNECTIONS -d${SECONDS_PER_RUN}s per target and mode" >&2

# run TARGET MODE SECONDS PREFIX: wrk's rps, and its errors checked.
run() {
    local out
    out=$(MODE=$2 PREFIX=$4 wrk -t"$THREADS" -c"$CONNECTIONS" -d"$3s" -s bench/benches/wrk_notify.lua "${TARGET[$1]}" 2>&1 | grep '^wrk: ')
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
        # Rotate the order: round 1 new old nginx return200, round 2 old nginx ...
        for k in 0 1 2 3; do
            t=${NAMES[$(( (k + r - 1) % 4 ))]}
            RPS[$t]=$(run "$t" "$mode" "$SECONDS_PER_RUN" "r$r-$t")
        done
        ratio() { awk -v a="${RPS[$1]}" -v b="${RPS[$2]}" 'BEGIN { printf "%.3f", a / b }'; }
        if [ "$mode" = first ]; then
            echo "first new/old $(ratio new old)" >>"$TMP/ratios"
            echo "first new/nginx $(ratio new nginx)" >>"$TMP/ratios"
            echo "first old/nginx $(ratio old nginx)" >>"$TMP/ratios"
            echo "first nginx/return200 $(ratio nginx return200)" >>"$TMP/ratios"
        else
            echo "repeat new/old $(ratio new old)" >>"$TMP/ratios"
            echo "repeat new/return200 $(ratio new return200)" >>"$TMP/ratios"
            echo "repeat old/return200 $(ratio old return200)" >>"$TMP/ratios"
            echo "repeat new/nginx $(ratio new nginx)" >>"$TMP/ratios"
        fi
        echo "# round $r $mode: $(grep -c . "$TMP/ratios") ratios so far" >&2
        unset RPS
    done
done

echo
echo "| mode | ratio | per round | median |"
echo "|---|---|---|---|"
awk '
    { key = $1 " " $2; if (!(key in n)) order[++k] = key; v[key, ++n[key]] = $3 }
    END {
        for (i = 1; i <= k; i++) {
            key = order[i]; m = n[key]; list = ""
            for (j = 1; j <= m; j++) { s[j] = v[key, j]; list = list (j > 1 ? ", " : "") v[key, j] }
            for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (s[b] < s[a]) { t = s[a]; s[a] = s[b]; s[b] = t }
            med = (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
            split(key, kv, " ")
            printf "| %s | %s | %s | **%.3f** |\n", kv[1], kv[2], list, med
        }
    }' "$TMP/ratios"
