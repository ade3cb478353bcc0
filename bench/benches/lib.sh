# Shared by the benchmark scripts (sourced from the crate root):
#
#   . bench/benches/lib.sh
#   bench_start NAME   # $TMP, a fresh directory; PIDS, killed on exit
#
# Every process a script starts and appends to PIDS is killed (and waited
# for) when the script exits, and TMP is removed.

bench_start() {
    TMP=$(mktemp -d "/tmp/$1.XXXXXX")
    PIDS=()
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}

bench_cleanup() {
    for p in "${PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
    rm -rf "$TMP"
}

# wait_line FILE PREFIX: the rest of the first line of FILE starting with
# PREFIX, waiting up to 10 s for it.
wait_line() {
    local i
    for i in $(seq 100); do
        if grep -q "^$2" "$1" 2>/dev/null; then
            sed -n "s/^$2//p" "$1" | head -n1
            return 0
        fi
        sleep 0.1
    done
    echo "timed out waiting for '$2' in $1" >&2
    return 1
}

# A free loopback port, for servers that cannot report one the kernel picked.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# start_nginx WORKERS: starts nginx (behind the command prefix NGINX_PREFIX,
# an array, e.g. a taskset, if set) with WORKERS worker processes, its pid,
# logs and temp files in $TMP/nginx, no access log and no limit on requests
# per client connection (the gateway has none); the http block's upstreams
# and servers are read from stdin.
start_nginx() {
    mkdir -p "$TMP/nginx"
    {
        if [ "$(id -u)" = 0 ]; then echo "user root;"; fi
        cat <<EOF
worker_processes $1;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx/client_body;
    proxy_temp_path $TMP/nginx/proxy;
    fastcgi_temp_path $TMP/nginx/fastcgi;
    uwsgi_temp_path $TMP/nginx/uwsgi;
    scgi_temp_path $TMP/nginx/scgi;
    keepalive_requests 1000000;
EOF
        cat
        echo "}"
    } >"$TMP/nginx/nginx.conf"
    ${NGINX_PREFIX[@]+"${NGINX_PREFIX[@]}"} nginx -c "$TMP/nginx/nginx.conf" -g 'daemon off;' 2>"$TMP/nginx/stderr" &
    PIDS+=($!)
}
