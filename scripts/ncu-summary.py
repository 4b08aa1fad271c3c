#!/usr/bin/env python3
"""Per-kernel table from an Nsight Compute CSV of gpu__time_duration (scripts/gpu-profile.sh):
launches and time per step, share of the kernels' total, the most common grid and block, and
the kernels' total against the step's wall time from the bench's --json.

    python3 scripts/ncu-summary.py NCU.csv --steps N [--wall BENCH.json --probes off|on] [--top K]
"""
import argparse
import collections
import csv
import json
import re
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "s": 1e6, "second": 1e6}


def short(name):
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).replace("void ", "").strip()[:60]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--steps", type=int, required=True, help="training steps the profiled run took")
    p.add_argument("--wall", help="the bench's --json, for the step's wall time")
    p.add_argument("--probes", choices=("off", "on", "full"), help="which row of --wall to compare with")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    with open(a.csv, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    if not lines:
        sys.exit(f"{a.csv}: no CSV rows (did ncu run?)")
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        sys.exit(f"{a.csv}: no gpu__time_duration.sum rows")
    kern = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for r in rows:
        us = float(r["Metric Value"].replace(",", "")) * UNITS.get(r["Metric Unit"], 1.0)
        k = kern[short(r["Kernel Name"])]
        k[0] += 1
        k[1] += us
        k[2][(r.get("Grid Size", "?"), r.get("Block Size", "?"))] += 1
    total = sum(k[1] for k in kern.values())
    n = a.steps
    print(f"{a.csv}: {len(rows)} launches over {n} steps; kernels {total / n / 1e3:.2f} ms per step")
    if a.wall and a.probes:
        with open(a.wall) as f:
            wall = json.load(f)
        for s in wall.get("steps", []):
            if s["probes"] == (a.probes != "off") and s.get("full_statistics", False) == (a.probes == "full"):
                ms = s["median_ms"]
                share = total / n / 1e3 / ms
                rest = ("the rest is host work and launch gaps" if share < 1 else
                        "kernels timed one by one under ncu (caches flushed) outlast the "
                        "unprofiled step: it is bound by its kernels")
                print(f"step wall time (median, no profiler) {ms:.2f} ms: kernels are "
                      f"{share:.0%} of it; {rest}")
    print(f"{'kernel':<60} {'launches':>8} {'ms/step':>9} {'share':>6}  grid x block (most common)")
    for name, (cnt, us, shapes) in sorted(kern.items(), key=lambda kv: -kv[1][1])[: a.top]:
        (grid, block), _ = shapes.most_common(1)[0]
        print(f"{name:<60} {cnt / n:>8.1f} {us / n / 1e3:>9.3f} {us / total:>6.1%}  {grid} x {block}")


if __name__ == "__main__":
    main(sys.argv[1:])
