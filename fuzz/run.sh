#!/usr/bin/env bash
# Short fuzzing run of every key-extraction target and of the one-parse
# target (bytes spliced into signed notifications), seeded with the channel
# fixtures of tests/fixtures. Usage: fuzz/run.sh [SECONDS per target, default 10]
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Uses the nightly toolchain when
# one is installed, otherwise the stable one with RUSTC_BOOTSTRAP=1 (cargo-fuzz
# passes nightly-only flags such as -Zsanitizer).
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-10}"
fixtures=../crates/tower-idempotency/tests/fixtures

if rustup run nightly rustc --version >/dev/null 2>&1; then
    fuzz=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
fi

# Seed corpus: each fixture, behind the prefix its target reads first (a field
# name line, or header lines and a blank line).
seed() { # target prefix glob...
    local target=$1 prefix=$2
    shift 2
    mkdir -p "corpus/$target"
    for f in "$@"; do
        { printf '%b' "$prefix"; cat "$f"; } >"corpus/$target/seed-$(basename "$f")"
    done
}
seed json_pointer '/id\n' "$fixtures"/*.json
seed json_pointer '/notificationItems/0/NotificationRequestItem/amount\n' "$fixtures"/adyen_*.json
seed xml_element 'transaction_id\n' "$fixtures"/*.xml
seed form_field 'notify_id\n' "$fixtures"/*.form
seed headers 'webhook-id: msg_p5jXN8AQM9LWM0D4loKWxJek\nx-part: a:b\nidempotency-key: "k-1"\n\n' "$fixtures"/standard_webhooks_*.json
seed headers 'x-part: a%3Ab\n\n' "$fixtures"/stripe_*.json
# one_parse: channel byte, offset (2 bytes, little-endian), bytes spliced in.
seed one_parse '\x00\x10\x00' /dev/null
printf '\x00\x20\x00<a>1</a>' >corpus/one_parse/seed-wechat-nested
printf '\x01\x05\x00trade_status=&' >corpus/one_parse/seed-alipay-repeat
printf '\x02\x02\x00"notificationItems":[],' >corpus/one_parse/seed-adyen-repeat

for target in json_pointer xml_element form_field headers one_parse; do
    echo "== $target (${secs}s)"
    "${fuzz[@]}" run "$target" "corpus/$target" -- \
        -max_total_time="$secs" -max_len=65536 -rss_limit_mb=1024 -print_final_stats=1
done
