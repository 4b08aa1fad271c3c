#!/usr/bin/env python3
"""What the PyTorch companion costs: the same AMP training step of a T5 encoder timed in one
process, the variants interleaved round by round — plain eager, `amprobe_torch.watch` in its
default mode (full records of the first step; after it, every module's output, the script's
own ops, the loss and the gradients checked, a failing step replayed), `watch` checking
every op of every step (AMPROBE_CHECK=ops), `watch` with full statistics every step, and
`torch.autograd.detect_anomaly` — and printed as a table of median step times and their
ratio to eager.

    scripts/bench-capture.py [--device cpu|cuda] [--size mini|base] [--rounds N] [--steps N]
                             [--variants eager,watch,watch-ops,watch-full,anomaly]
                             [--penalty-every N]

Needs torch and transformers. mini: T5-mini-sized (d_model 384, 4 layers, 8 heads, d_ff
1536, batch 4, seq 128; CPU default). base: T5-base-sized (d_model 768, 12 layers, 12
heads, d_ff 3072, batch 8, seq 512; for a GPU). fp16 autocast with a GradScaler on CUDA,
bf16 autocast on the CPU (CPU autocast's usual dtype). --penalty-every N times a WGAN-GP
critic instead (an MLP, 512 features, three hidden layers of 1024, batch 128) whose gradient
penalty by `torch.autograd.grad` is taken every N steps (1: every step).
"""

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import amprobe_torch  # noqa: E402
from capture_workload import SIZES, CriticWorkload, Workload  # noqa: E402

VARIANTS = ("eager", "watch", "watch-ops", "watch-full", "anomaly")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, choices=tuple(SIZES))
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every variant (default 5)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant and round (default 4)")
    ap.add_argument("--penalty-every", type=int, default=None,
                    help="time a WGAN-GP critic, its gradient penalty every N steps, instead of the T5 encoder")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, eager first (default {','.join(VARIANTS)})")
    a = ap.parse_args()
    size = a.size or ("base" if a.device == "cuda" else "mini")
    if a.penalty_every is not None and a.penalty_every < 1:
        ap.error(f"--penalty-every: a number of steps, at least 1, not {a.penalty_every}")
    work = Workload(a.device, size) if a.penalty_every is None else CriticWorkload(a.device, a.penalty_every)
    s, dev, dtype, base = work.size, work.device, work.dtype, work.model
    tmp = tempfile.mkdtemp(prefix="amprobe-bench-")
    sync = work.sync

    def run(variant, rnd):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
        w = None
        if variant.startswith("watch"):
            w = amprobe_torch.watch(
                model, opt, scaler,
                trace=os.path.join(tmp, f"{variant}-{rnd}.jsonl"),
                sample_every=1 if variant == "watch-full" else 0,
                check="ops" if variant == "watch-ops" else "modules",
            )
        times = []
        for step in range(a.steps + 1):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            ctx = torch.autograd.detect_anomaly(check_nan=True) if variant == "anomaly" else _null()
            with ctx:
                work.backward(model, scaler, step)
            scaler.step(opt)
            scaler.update()
            sync()
            if step > 0:  # the first step of each variant warms it up (and is watch's kept step)
                times.append((time.perf_counter() - t0) * 1000.0)
        if w is not None:
            w.close()
        return times

    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[:1] != ["eager"]:
        ap.error(f"--variants: {','.join(VARIANTS)} (eager first), not {a.variants}")
    results = {v: [] for v in variants}
    # Per round, each variant's median over the eager one's of the same round: a machine
    # whose speed drifts moves both.
    ratios = {v: [] for v in variants}
    for rnd in range(a.rounds):
        medians = {}
        for v in variants:
            times = run(v, rnd)
            results[v].extend(times)
            medians[v] = statistics.median(times)
        for v in variants:
            ratios[v].append(medians[v] / medians["eager"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({os.cpu_count()} threads visible)"
    if a.penalty_every is None:
        what = (f"T5 encoder {size}: d_model {s['d_model']}, {s['num_layers']} layers, d_ff {s['d_ff']}, "
                f"{s['num_heads']} heads, batch {s['batch']}, seq {s['seq']}")
    else:
        what = (f"WGAN-GP critic: MLP {s['features']}-{s['width']}x3-1, batch {s['batch']}, gradient penalty "
                f"every {a.penalty_every} steps")
    print(f"device {name}, torch {torch.__version__}; {what}; "
          f"{dtype} autocast{' + GradScaler' if dtype == torch.float16 else ''}; "
          f"{a.rounds} rounds x {a.steps} timed steps per variant, interleaved")
    eager = statistics.median(results["eager"])
    print(f"{'variant':<12} {'median ms':>10} {'min ms':>10} {'/ eager':>8} {'by round':>9}")
    for v in variants:
        m = statistics.median(results[v])
        print(f"{v:<12} {m:>10.1f} {min(results[v]):>10.1f} {m / eager:>8.2f} {statistics.median(ratios[v]):>9.2f}")
    print("/ eager: the medians' ratio; by round: the median over rounds of each round's ratio")
    print("watch: records of the first step of each run (not timed), the steps after it checked by "
          "modules (a failing step replayed); watch-ops: NaN/Inf counts of every op after it; "
          "watch-full: full statistics of every op every step")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
