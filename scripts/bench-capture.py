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
    scripts/bench-capture.py --zoo | --model NAME[,NAME...]  [--rounds N] [--steps N] [--variants ...]
                             [--threads N] [--clock wall|cpu]

Needs torch and transformers. mini: T5-mini-sized (d_model 384, 4 layers, 8 heads, d_ff
1536, batch 4, seq 128; CPU default). base: T5-base-sized (d_model 768, 12 layers, 12
heads, d_ff 3072, batch 8, seq 512; for a GPU). fp16 autocast with a GradScaler on CUDA,
bf16 autocast on the CPU (CPU autocast's usual dtype). --penalty-every N times a WGAN-GP
critic instead (an MLP, 512 features, three hidden layers of 1024, batch 128) whose gradient
penalty by `torch.autograd.grad` is taken every N steps (1: every step).

--zoo (all of them) or --model times real stacks instead (scripts/bench_zoo.py): t5-mini,
vit-tiny, resnet (timm), gpt2-lora-trainer (PEFT under transformers.Trainer) and lightning
(a LightningModule under lightning.Trainer), by default eager, watch, watch-full and
anomaly, each model's first step timed apart, and a table of them all at the end. It needs
timm, peft and lightning besides.
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import bench_zoo  # noqa: E402
import capture_workload  # noqa: E402
from bench_zoo import ZOO  # noqa: E402
from capture_workload import SIZES, CriticWorkload, Workload, loop_times  # noqa: E402

VARIANTS = ("eager", "watch", "watch-ops", "watch-full", "anomaly")
ZOO_VARIANTS = ("eager", "watch", "watch-full", "anomaly")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, choices=tuple(SIZES))
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every variant (default 5)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant and round (default 4)")
    ap.add_argument("--penalty-every", type=int, default=None,
                    help="time a WGAN-GP critic, its gradient penalty every N steps, instead of the T5 encoder")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, eager first (default {','.join(VARIANTS)}; the zoo's "
                         f"{','.join(ZOO_VARIANTS)})")
    ap.add_argument("--model", default=None, help=f"the zoo's models, comma-separated: {','.join(ZOO)} or all")
    ap.add_argument("--zoo", action="store_true", help="every model of the zoo (--model all)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="a step's time: the wall clock (default), or the process's CPU time, which other "
                         "processes on a shared machine do not move (on the CPU device only)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's intra-op threads (default torch's own: one per core)")
    a = ap.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.clock == "cpu":
        if a.device != "cpu":
            ap.error("--clock cpu: only on the CPU device (a GPU's time is not the process's)")
        capture_workload.use_cpu_clock()
    zoo = _zoo_models(ap, "all" if a.zoo else a.model)
    variants = [v for v in (a.variants or ",".join(ZOO_VARIANTS if zoo else VARIANTS)).split(",") if v]
    if any(v not in VARIANTS for v in variants) or variants[:1] != ["eager"]:
        ap.error(f"--variants: {','.join(VARIANTS)} (eager first), not {a.variants}")
    if a.penalty_every is not None and a.penalty_every < 1:
        ap.error(f"--penalty-every: a number of steps, at least 1, not {a.penalty_every}")
    tmp = tempfile.mkdtemp(prefix="amprobe-bench-")
    if zoo:
        bench_zoo.main(zoo, variants, a.rounds, a.steps, a.device, tmp)
        return
    size = a.size or ("base" if a.device == "cuda" else "mini")
    work = Workload(a.device, size) if a.penalty_every is None else CriticWorkload(a.device, a.penalty_every)
    results = {v: [] for v in variants}
    # Per round, each variant's median over the eager one's of the same round: a machine
    # whose speed drifts moves both.
    ratios = {v: [] for v in variants}
    for rnd in range(a.rounds):
        medians = {}
        for v in variants:
            # (the first step of each run warms it up, and is watch's kept step)
            times = loop_times(work, work.model, v, a.steps, os.path.join(tmp, f"{v}-{rnd}.jsonl"))[1:]
            results[v].extend(times)
            medians[v] = statistics.median(times)
        for v in variants:
            ratios[v].append(medians[v] / medians["eager"])
    _print(work, size, a, variants, results, ratios)


def _zoo_models(ap, model):
    if model is None:
        return None
    names = list(ZOO) if model == "all" else [m for m in model.split(",") if m]
    if not names or any(m not in ZOO for m in names):
        ap.error(f"--model: {','.join(ZOO)} or all, not {model}")
    return names


def _print(work, size, a, variants, results, ratios):
    dev, dtype = work.device, work.dtype
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({os.cpu_count()} threads visible)"
    what = f"T5 encoder {size}: " if a.penalty_every is None else "WGAN-GP critic: "
    print(f"device {name}, torch {torch.__version__}; {what}{work.describe()}; "
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


if __name__ == "__main__":
    main()
