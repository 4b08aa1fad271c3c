#!/usr/bin/env python3
"""Where the PyTorch companion's time goes: the T5 encoder step of scripts/bench-capture.py,
plain and under `amprobe_torch.watch` in its default mode, profiled after warm-up — the
Python functions that take the most time (cProfile, self and cumulative), and per step the
kernel launches, host-device copies and synchronizations each variant makes
(torch.profiler), and the read backs a step (calls that bring a tensor's values to Python:
on a GPU each waits for the device's queue to drain).

    scripts/profile-capture.py [--device cpu|cuda] [--size mini|base] [--steps N] [--top N]
                               [--batch B] [--seq S] [--device-path] [--check modules|ops]
                               [--sample-every N]

--device-path runs the companion's device paths on the CPU (every figure gathered where it
is made and read back with the step, as on a GPU): its read backs and kernels a step are
then the GPU's, without one.

Needs torch and transformers.
"""

import argparse
import collections
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import amprobe_torch  # noqa: E402
from capture_workload import SIZES, Workload  # noqa: E402

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, choices=tuple(SIZES))
    ap.add_argument("--steps", type=int, default=4, help="profiled steps per variant (default 4)")
    ap.add_argument("--top", type=int, default=25, help="functions listed (default 25)")
    ap.add_argument("--batch", type=int, default=None, help="batch (default: the size's)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the size's)")
    ap.add_argument("--check", default="modules", choices=("modules", "ops"))
    ap.add_argument("--sample-every", type=int, default=0,
                    help="watch's sample_every (1: full statistics every step; default 0)")
    ap.add_argument("--device-path", action="store_true", help="the device paths on the CPU")
    a = ap.parse_args()
    if a.device_path:
        from amprobe_torch import _stats

        _stats.DEVICE_PATH_ON_CPU = True
    size = a.size or ("base" if a.device == "cuda" else "mini")
    work = Workload(a.device, size, a.batch, a.seq)
    s, dev, dtype, base = work.size, work.device, work.dtype, work.model
    tmp = tempfile.mkdtemp(prefix="amprobe-profile-")
    sync = work.sync

    print(f"device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
          f"T5 encoder {size} at batch {s['batch']}, seq {s['seq']}; {dtype} autocast; watch check={a.check}")
    reads = collections.Counter()
    counting = [None]

    def counted(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *args, **kw):
            out = orig(self, *args, **kw)
            if counting[0] and not getattr(self, "_profile_host", False):
                reads[counting[0]] += 1
                if isinstance(out, torch.Tensor):
                    out._profile_host = True  # its tolist is the same read
            return out

        setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        counted(name)
    for variant in ("eager", "watch"):
        model = copy.deepcopy(base)
        # foreach: the optimizer's update as on a GPU (a few multi-tensor ops)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
        scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
        w = None
        if variant == "watch":
            w = amprobe_torch.watch(model, opt, scaler, trace=os.path.join(tmp, "t.jsonl"), check=a.check,
                                   sample_every=a.sample_every)

        def one():
            opt.zero_grad(set_to_none=True)
            scaler.scale(work.loss(model)).backward()
            scaler.step(opt)
            scaler.update()
            sync()

        for _ in range(3):  # the first is watch's kept step
            one()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            one()
            times.append((time.perf_counter() - t0) * 1000.0)
        counting[0] = variant
        one()
        counting[0] = None
        print(f"\n== {variant}: median {statistics.median(times):.1f} ms, min {min(times):.1f} ms; "
              f"{reads[variant]} read backs a step")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            one()
        prof.disable()
        if variant == "watch":
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
                print(f"-- cProfile by {key}, {a.steps} steps")
                print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as p:
            for _ in range(a.steps):
                one()
        counts = collections.Counter()
        cpu_us = collections.Counter()
        for e in p.key_averages():
            counts[e.key] += e.count
            cpu_us[e.key] += e.self_cpu_time_total
        runtime = [k for k in counts if k.startswith("cuda") or k.startswith("Memcpy") or k.startswith("Memset")]
        print(f"-- per step: {sum(counts[k] for k in counts if k.startswith('aten::')) / a.steps:.0f} aten ops")
        for k in sorted(runtime, key=lambda k: -counts[k]):
            print(f"   {k:<40} {counts[k] / a.steps:>8.1f} calls  {cpu_us[k] / a.steps / 1000:>8.2f} ms host")
        top = sorted((k for k in counts if k.startswith("aten::")), key=lambda k: -cpu_us[k])[:15]
        for k in top:
            print(f"   {k:<40} {counts[k] / a.steps:>8.1f} calls  {cpu_us[k] / a.steps / 1000:>8.2f} ms self cpu")
        if w is not None:
            w.close()


if __name__ == "__main__":
    main()
