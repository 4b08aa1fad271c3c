#!/usr/bin/env python3
"""Fuzzes the companion's readers of its AMPROBE_* variables with N values per variable:
python/amprobe_torch/_env.py's (loaded alone: it is torch-free) and _plan.py's `from_env`
where torch imports (_plan imports torch at module level; without it the plan's variables
are fuzzed on the command line's side only, by tests/fuzz.rs). Every outcome must be a value
of the right type or a ValueError whose message names the variable; anything else, and any
call over a second, is a finding.

    scripts/fuzz_env.py [N] [--seed S] [--jobs J]

Values are mutants of valid ones and near misses (characters flipped, inserted from a pool
of Unicode digits, spaces and surrogate escapes, deleted, repeated, spliced, case changed,
boundary numbers, thousands of digits), each chunk from the seed, the variable and its index.
Prints a table; exits 1 on a finding. Standard library only."""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 100_000
HANG_S = 1.0

SEEDS = {
    "AMPROBE_DISABLE": ["1", "0", "", " 1 ", "yes", "true"],
    "AMPROBE_AUTO": ["1", "0", "", "2"],
    "AMPROBE_SAMPLE_EVERY": ["0", "12", " 3 ", "18446744073709551615", "abc", "-3", "1.5"],
    "AMPROBE_CHECK": ["modules", "ops", "", "Modules", "sometimes"],
    "AMPROBE_AUTOCAST": ["fp16", "bf16", "fp32", "BF16", " fp16 ", "fp8", ""],
    "AMPROBE_FP32_MODULES": ["wo", "encoder.block.*.layer.1", "a,b.c", " x , y ", "a..b", ","],
    "AMPROBE_INIT_SCALE": ["65536", "1024.0", "1e-3", "2.5e4", "-1", "inf", "nan", "0"],
}

# Characters that trip readers: other scripts' digits (str.isdigit takes them, int() not
# all), spaces str.strip removes, surrogate escapes (what os.environ holds for bytes that
# are not UTF-8), letters whose case maps oddly.
POOL = (
    "0123456789+-._,*eExXabfpsmo \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2000\u2028\u3000\ufeff"
    "\xb2\xb3\xb9\u0663\u06f4\u07c0\u0966\u09e7\u0a67\u0ae6\u0e53\u17e0\u1812\uff11"
    "\U0001d7ce\xbd\u2167\udc80\udcff\u0130\u0131\u017f\u212a"
)
BOUNDARY = [
    "0", "-0", "1e309", "-1e309", "1e-400", "nan", "NaN", "inf", "-inf", "infinity",
    "18446744073709551615", "18446744073709551616", "9223372036854775808", "1_000",
    "0x10", "0b1", "1e5", ".5", "5.", "+1", "\u0661\u0662",
]


def load_readers() -> dict:
    """Each variable's reader (a function of one value) and the check of what it returns."""
    spec = importlib.util.spec_from_file_location("amprobe_env", ROOT / "python/amprobe_torch/_env.py")
    env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env)
    readers = {
        "AMPROBE_DISABLE": (lambda v: env.disabled({"AMPROBE_DISABLE": v}), lambda o: type(o) is bool),
        "AMPROBE_AUTO": (lambda v: env.auto({"AMPROBE_AUTO": v}), lambda o: type(o) is bool),
        "AMPROBE_SAMPLE_EVERY": (
            lambda v: env.sample_every({"AMPROBE_SAMPLE_EVERY": v}),
            lambda o: type(o) is int and o >= 0,
        ),
        "AMPROBE_CHECK": (lambda v: env.check({"AMPROBE_CHECK": v}), lambda o: o in ("modules", "ops")),
    }
    plan = load_plan()
    if plan is not None:
        readers.update(plan_readers(plan))
    return readers


def load_plan():
    if importlib.util.find_spec("torch") is None:
        return None
    sys.path.insert(0, str(ROOT / "python"))
    from amprobe_torch import _plan

    return _plan


def plan_readers(plan) -> dict:
    def ok(o, field, good) -> bool:
        return o is None or (isinstance(o, plan.Plan) and good(getattr(o, field)))

    def modules_ok(m) -> bool:
        return isinstance(m, list) and m and all(isinstance(p, str) and all(p.split(".")) for p in m)

    return {
        "AMPROBE_AUTOCAST": (
            lambda v: plan.from_env({"AMPROBE_AUTOCAST": v}),
            lambda o: ok(o, "autocast", lambda a: a in ("fp16", "bf16", "fp32")),
        ),
        "AMPROBE_FP32_MODULES": (
            lambda v: plan.from_env({"AMPROBE_FP32_MODULES": v}),
            lambda o: ok(o, "fp32_modules", modules_ok),
        ),
        "AMPROBE_INIT_SCALE": (
            lambda v: plan.from_env({"AMPROBE_INIT_SCALE": v}),
            lambda o: ok(o, "init_scale", lambda s: type(s) is float and 0 < s < math.inf),
        ),
    }


def mutate(r: random.Random, v: str, seeds: list) -> str:
    for _ in range(1 + r.randrange(4)):
        n = len(v)
        op = r.randrange(10)
        i = r.randrange(n + 1)
        if op == 0 and n:
            c = ord(v[i % n]) ^ (1 << r.randrange(21))
            v = v[: i % n] + chr(min(c, 0x10FFFF)) + v[i % n + 1 :]
        elif op == 1:
            v = v[:i] + r.choice(POOL) + v[i:]
        elif op == 2 and n:
            v = v[:i] + v[i + 1 + r.randrange(8) :]
        elif op == 3:
            v = v[:i] + v[i : i + 1 + r.randrange(16)] * (1 + r.randrange(4)) + v[i:]
        elif op == 4:
            other = r.choice(seeds)
            v = v[:i] + other[r.randrange(len(other) + 1) :]
        elif op == 5:
            v = r.choice(BOUNDARY)
        elif op == 6:
            v = r.choice((str.upper, str.lower, str.swapcase, str.title))(v)
        elif op == 7:
            v = r.choice(("9", "0", "1,", "a.", " ")) * r.choice((21, 4300, 4301, 10_000)) + v
        elif op == 8:
            v = v[:i]
        else:
            v = r.choice(POOL) + v + r.choice(POOL)
    return v


_READERS: dict = {}


def _init() -> None:
    _READERS.update(load_readers())


def run_chunk(task: tuple) -> tuple:
    """`count` values of `name` (chunk `chunk`): accepted, refused, findings, the first
    few of them, the slowest call and the chunk's seconds."""
    name, chunk, count, seed = task
    reader, good = _READERS[name]
    r = random.Random(f"{seed}:{name}:{chunk}")
    seeds = SEEDS[name]
    accepted = refused = found = 0
    slowest = 0.0
    examples = []
    t_chunk = time.perf_counter()
    for k in range(count):
        v = mutate(r, r.choice(seeds), seeds) if k % 8 else r.choice(seeds)
        t0 = time.perf_counter()
        why = judge(name, reader, good, v)
        took = time.perf_counter() - t0
        slowest = max(slowest, took)
        if took > HANG_S:
            why = f"took {took:.1f} s"
        if why is None:
            accepted += 1
        elif why == "refused":
            refused += 1
        else:
            found += 1
            if len(examples) < 5:
                examples.append((v, why))
    return accepted, refused, found, examples, slowest, time.perf_counter() - t_chunk


def judge(name: str, reader, good, v: str):
    """None: a good value; "refused": a ValueError naming the variable; else the finding."""
    try:
        out = reader(v)
    except ValueError as e:
        return "refused" if name in str(e) else f"a ValueError that does not name {name}: {e}"
    except Exception as e:  # any other exception is what is looked for
        return f"{type(e).__name__}: {e}"
    return None if good(out) else f"returned {out!r}"


def fuzz(names: list, n: int, seed: int, jobs: int) -> dict:
    """Per variable: accepted, refused, findings, examples, slowest call, seconds of work."""
    chunks = range((n + CHUNK - 1) // CHUNK)
    tasks = [(name, c, min(CHUNK, n - c * CHUNK), seed) for name in names for c in chunks]
    rows = {name: [0, 0, 0, [], 0.0, 0.0] for name in names}
    with multiprocessing.Pool(jobs, initializer=_init) as pool:
        for task, out in zip(tasks, pool.imap(run_chunk, tasks)):
            row = rows[task[0]]
            for i in (0, 1, 2, 5):
                row[i] += out[i]
            row[3] += out[3][: 5 - len(row[3])]
            row[4] = max(row[4], out[4])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=10_000_000, help="values per variable")
    ap.add_argument("--seed", type=int, default=0x0A3B7C2D)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    names = list(load_readers())
    skipped = [v for v in SEEDS if v not in names]
    print("| variable | values | accepted | refused (naming it) | findings | slowest | values/s per core |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    bad = []
    for name, (acc, ref, found, examples, slow, work) in fuzz(names, a.n, a.seed, a.jobs).items():
        total = acc + ref + found
        print(f"| {name} | {total:,} | {acc:,} | {ref:,} | {found} | {slow * 1e3:.2f} ms | {total / max(work, 1e-9):,.0f} |")
        bad += [(name, e) for e in examples]
    print(f"{a.jobs} processes, {time.perf_counter() - t0:.0f} s")
    if skipped:
        print(f"not fuzzed here: {', '.join(skipped)} (_plan imports torch, which does not import)")
    for name, (v, why) in bad:
        print(f"{name}={v[:120]!r}{'...' if len(v) > 120 else ''} ({len(v)} characters): {why[:300]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
