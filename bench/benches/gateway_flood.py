#!/usr/bin/env python3
"""The gateway's resident memory under a flood of stalled request bodies.

N connections each send the head of a 1 MiB Stripe-looking notification to
the default `/`=auto route and 960 KiB of its body, then stall. The gateway
buffers what fits in --max-buffered (default 64 MiB) and sheds the rest at
once (503 + Retry-After); a genuine notification sent during the flood must
still be answered. Prints the resident-memory growth over the warmed-up
baseline, the bodies shed and the genuine answer.

Usage (from the crate root, after
`cargo build --release -p idempotency-gateway -p idempotency-bench --bin idempotency-gateway --example proxy_bench`):

    bench/benches/gateway_flood.py [N] [GATEWAY FLAGS...]
    bench/benches/gateway_flood.py 1000
    bench/benches/gateway_flood.py 1000 --max-buffered 32MiB

Binaries are taken from $CARGO_TARGET_DIR (or ./target)/release/examples.
Goal: growth <= --max-buffered + 15 %, the genuine notification answered.
"""
import os, socket, subprocess, sys, threading, time

BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release", "examples")
GATEWAY_BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release", "idempotency-gateway")

def line_after(proc, prefix):
    for raw in proc.stdout:
        text = raw.decode()
        if prefix in text:
            return text.split(prefix, 1)[1].strip()
    sys.exit(f"no `{prefix}` line")

def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) // 1024

def notification(id, content_length=None):
    body = ('{"id":"%s","object":"event","type":"charge.succeeded"}' % id).encode()
    head = ("POST /notify HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            "Content-Type: application/json\r\nStripe-Signature: t=1,v1=00\r\n"
            "Content-Length: %d\r\n\r\n" % (content_length or len(body))).encode()
    return head, body

def ask(addr, data, timeout=10):
    s = socket.create_connection(addr)
    s.settimeout(timeout)
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out

def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    flags = sys.argv[2:]
    up = subprocess.Popen([f"{BIN}/proxy_bench", "upstream", "--listen", "127.0.0.1:0"],
                          stdout=subprocess.PIPE)
    upstream = line_after(up, "upstream on ")
    gw = subprocess.Popen([GATEWAY_BIN, "--listen", "127.0.0.1:0", "--upstream",
                           f"http://{upstream}", "--body-timeout", "60s"] + flags,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          env=dict(os.environ, RUST_LOG="warn"))
    try:
        host, port = line_after(gw, "listening on ").rsplit(":", 1)
        addr = (host, int(port))
        ask(addr, b"".join(notification("evt_warm")))
        base = rss_mib(gw.pid)
        head, _ = notification("evt_flood", 1 << 20)
        part = b" " * (960 << 10)
        socks, lock = [], threading.Lock()

        def stall():
            s = socket.create_connection(addr)
            try:
                s.sendall(head + part)
            except OSError:
                pass
            with lock:
                socks.append(s)

        threads = [threading.Thread(target=stall) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)
        peak = rss_mib(gw.pid)
        shed = 0
        for s in socks:
            s.setblocking(False)
            try:
                shed += b" 503 " in s.recv(100)
            except OSError:
                pass
        started = time.time()
        genuine = ask(addr, b"".join(notification("evt_genuine")))[:15].decode(errors="replace")
        print(f"{n} connections x 960 KiB, flags {flags or 'default'}: RSS {base} -> {peak} MiB "
              f"(growth {peak - base} MiB); shed {shed}; genuine: {genuine!r} "
              f"after {time.time() - started:.1f} s")
    finally:
        gw.kill()
        up.kill()

if __name__ == "__main__":
    main()
