#!/usr/bin/env python3
"""Instructions per request of each function, from two callgrind runs of
one gateway that differ only in how many requests they served (kept by
`KEEP=DIR bench/benches/gateway_instructions.sh`): the difference of the two
runs' counts per function, over the difference of the requests, so that
start-up and shutdown cancel out.

    bench/benches/cg_diff.py SMALL LARGE REQUESTS [--inclusive] [--top N]
    bench/benches/cg_diff.py --compare OLD_SMALL OLD_LARGE NEW_SMALL NEW_LARGE REQUESTS

With --compare: per function, the old and new costs per request and
their difference, largest differences first.
"""
import re
import subprocess
import sys


def costs(path, inclusive):
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=" + ("yes" if inclusive else "no"),
         "--threshold=100", path],
        check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        # `IR (PCT)  FILE:FUNCTION [OBJECT]`: the file has no colon.
        m = re.match(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?[^:\s]*:(.*?)(?:\s+\[[^\]]*\])?$", line)
        if not m:
            continue
        ir = int(m.group(1).replace(",", ""))
        name = m.group(2).strip()
        if not name or name.startswith("PROGRAM TOTALS") or name.startswith("file:function"):
            continue
        table[name] = table.get(name, 0) + ir
    return table


def per_request(small, large, n, inclusive):
    a, b = costs(small, inclusive), costs(large, inclusive)
    return {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b)}


def short(name, width=110):
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    args = sys.argv[1:]
    inclusive = "--inclusive" in args
    args = [a for a in args if a != "--inclusive"]
    top = 40
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    if args and args[0] == "--compare":
        old_s, old_l, new_s, new_l, n = args[1:6]
        n = float(n)
        old = per_request(old_s, old_l, n, inclusive)
        new = per_request(new_s, new_l, n, inclusive)
        rows = []
        for k in set(old) | set(new):
            o, w = old.get(k, 0.0), new.get(k, 0.0)
            if abs(w - o) >= 20:
                rows.append((w - o, o, w, k))
        rows.sort(key=lambda r: -abs(r[0]))
        print("| old | new | new - old | function |")
        print("|---:|---:|---:|---|")
        for d, o, w, k in rows[:top]:
            print(f"| {o:,.0f} | {w:,.0f} | {d:+,.0f} | `{short(k)}` |")
        print(f"| {sum(old.values()):,.0f} | {sum(new.values()):,.0f} | "
              f"{sum(new.values()) - sum(old.values()):+,.0f} | (sum{' of inclusive, not meaningful' if inclusive else ''}) |")
        return
    small, large, n = args[0], args[1], float(args[2])
    table = per_request(small, large, n, inclusive)
    rows = sorted(table.items(), key=lambda kv: -kv[1])
    total = sum(v for v in table.values()) if not inclusive else None
    print("| per request | function |")
    print("|---:|---|")
    for k, v in rows[:top]:
        print(f"| {v:,.0f} | `{short(k)}` |")
    if total is not None:
        print(f"| {total:,.0f} | (all) |")


if __name__ == "__main__":
    main()
