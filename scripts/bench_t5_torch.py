#!/usr/bin/env python3
"""PyTorch on the T5-mini workload of `cargo bench --bench t5_step`, for side-by-side
figures: transformers T5EncoderModel (relu FFN, d_model 256, d_ff 1024, 4 layers, 4 heads,
d_kv 64, vocab 512), batch 8, seq 128, logits = (h * d_model**-0.5) @ shared.weight.T,
mean cross-entropy against the input ids, SGD(lr=0.01), torch.amp.GradScaler on CPU.
Prints the median step time per mode. Needs torch and transformers; CI does not run it.

    python3 scripts/bench_t5_torch.py                            # every configuration, a table
    python3 scripts/bench_t5_torch.py fp32 --reps 5 --json       # one configuration alone

A configuration named on the command line (fp32, bf16, fp16, hooks = fp32 + per-module
forward hooks, anomaly = fp32 + autograd anomaly mode) runs alone: one warm-up step, then
--reps timed steps (default 5, 2 for fp16) on --threads threads (default 2). It prints
`fp32: 123.4 ms` and, with --json, one JSON line with every step's time (the line
scripts/bench-cpu.py reads, which runs each configuration in its own process).
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import T5Config, T5EncoderModel

torch.set_num_threads(2)
cfg = T5Config(vocab_size=512, d_model=256, d_ff=1024, d_kv=64, num_heads=4, num_layers=4,
               feed_forward_proj="relu", dropout_rate=0.0, is_encoder_decoder=False, use_cache=False)
cfg._attn_implementation = "eager"


def step_fn(model, opt, scaler, ids, dtype):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        h = model(input_ids=ids).last_hidden_state
        logits = (h * cfg.d_model ** -0.5) @ model.shared.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), ids.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def step_times(dtype, hooks=False, anomaly=False, reps=5):
    """Warm-up step time and the time of each of `reps` steps after it, in milliseconds."""
    torch.manual_seed(0)
    model = T5EncoderModel(cfg).train()
    if hooks:
        def probe(_m, _i, o):
            # Per-module statistics as a hook-based probe computes them (returns None, so
            # the output is unchanged).
            for t in (o if isinstance(o, tuple) else (o,)):
                if torch.is_tensor(t) and t.is_floating_point():
                    (t.isinf().sum().item(), t.isnan().sum().item(), t.abs().max().item())

        for m in model.modules():
            m.register_forward_hook(probe)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(0, cfg.vocab_size, (8, 128))
    t0 = time.perf_counter()
    step_fn(model, opt, scaler, ids, dtype)
    warmup_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.autograd.set_detect_anomaly(anomaly):
            step_fn(model, opt, scaler, ids, dtype)
        times.append((time.perf_counter() - t0) * 1e3)
    return warmup_ms, times


def bench(dtype, hooks=False, anomaly=False, reps=5):
    return statistics.median(step_times(dtype, hooks, anomaly, reps)[1])


# Configurations that can run alone: name -> (autocast dtype or None, hooks, anomaly, default reps).
CONFIGS = {
    "fp32": (None, False, False, 5),
    "bf16": (torch.bfloat16, False, False, 5),
    "fp16": (torch.float16, False, False, 2),
    "hooks": (None, True, False, 5),
    "anomaly": (None, False, True, 5),
}


def run_one(name, reps, as_json):
    dtype, hooks, anomaly, default_reps = CONFIGS[name]
    reps = default_reps if reps is None else reps
    warmup_ms, times = step_times(dtype, hooks=hooks, anomaly=anomaly, reps=reps)
    med = statistics.median(times)
    print(f"{name}: {med:.1f} ms")
    if as_json:
        print(json.dumps({"side": "torch", "config": name, "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "reps": reps,
                          "warmup_ms": warmup_ms, "median_ms": med, "times_ms": times}))
    sys.stdout.flush()


if __name__ == "__main__" and len(sys.argv) > 1:
    ap = argparse.ArgumentParser(description="One PyTorch configuration of the T5-mini step alone.")
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("--reps", type=int, default=None, help="timed steps after the warm-up (default 5, 2 for fp16)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line with every step's time")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    args = ap.parse_args()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    torch.set_num_threads(args.threads)
    run_one(args.config, args.reps, args.json)
elif __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = [("fp32", bench(None)), ("bf16 autocast", bench(torch.bfloat16)), ("fp32 + module hooks", bench(None, hooks=True)),
            ("fp32 + anomaly mode", bench(None, anomaly=True)), ("fp16 autocast", bench(torch.float16, reps=2))]
    for name, ms in rows:
        print(f"{name:<22} {ms:9.1f} ms")
