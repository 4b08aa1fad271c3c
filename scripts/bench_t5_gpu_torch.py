#!/usr/bin/env python3
"""PyTorch side of amprobe's GPU benchmark: training-step time of a T5-base-sized encoder
under PyTorch AMP on one GPU, and device-to-device copy bandwidth.

Workload (defaults; --batch, --seq and --layers override): transformers T5EncoderModel with
d_model 768, 12 layers, d_ff 3072, 12 heads, d_kv 64, relu FFN, vocab 32128, dropout 0, eager
attention, random weights from torch.manual_seed(0); batch 8, seq 512, input ids uniform in
[0, vocab). One training step is the objective of scripts/bench_t5_torch.py:
logits = (h * d_model**-0.5) @ shared.weight.T, mean cross-entropy (logits cast to float)
against the input ids, GradScaler scale/backward/step/update, SGD(lr=0.01).

Modes: fp16 and bf16 (torch.autocast with that dtype) and fp32 (no autocast). TF32 is switched
off for matmuls and cuDNN for the whole run, so fp32 is IEEE fp32 (autocast modes run their
matmuls in 16 bits and are not affected). Variants per mode: `eager` (plain step) and
`anomaly` (forward and backward inside torch.autograd.detect_anomaly()). Every (mode, variant)
starts from a fresh model with the same weights. After --warmup untimed steps, each of --steps
steps is timed with a pair of CUDA events and a synchronize; the table gives median and min ms.

Bandwidth: dst.copy_(src) on fp32, fp16 and bf16 tensors of 2^24 and 2^26 elements, counted
as bytes read + bytes written, median of 20 copies.

The numbers pair with amprobe's GPU bench, which runs the same model size, batch, sequence
length and objective: compare step times mode by mode (fp16 with fp16, and so on). Needs torch
and transformers, no network (weights are random). CI does not run it.

    python3 scripts/bench_t5_gpu_torch.py                       # H100 defaults
    python3 scripts/bench_t5_gpu_torch.py --modes bf16 --json gpu_torch.json
    python3 scripts/bench_t5_gpu_torch.py --device cpu --batch 1 --seq 16 --layers 2 \\
        --warmup 1 --steps 2 --modes bf16,fp32      # smoke run without a GPU

--model llama times transformers' LlamaForCausalLM instead, with the widths of a model of
about 1B parameters (hidden 2048, intermediate 8192, 32 query and 8 key-value heads of 64,
vocabulary 32000, tied embedding, eager attention, random weights from
torch.manual_seed(0)) and, by default, 16 layers, batch 1, seq 2048, bf16, eager only: the
causal LM loss of the input ids (transformers' own), GradScaler and SGD(lr=0.01) as above.
It pairs with `cargo bench --bench t5_base_gpu -- --model llama`.

With --device cpu, autocast and GradScaler use "cpu" and time.perf_counter replaces CUDA
events, so the script can be checked anywhere; those figures are not GPU figures.
"""
import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel

MODE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
BW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("eager", "anomaly")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="t5", choices=("t5", "llama"),
                   help="t5 (default) or llama (about 1B parameters)")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of fp16,bf16,fp32 (default: all three; bf16 "
                        "for llama)")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of eager,anomaly (default: both; eager for "
                        "llama)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 8; llama 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default 512; llama 2048)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 12; llama 16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--bw-log2", default="24,26",
                   help="comma-separated log2 element counts for the copy bandwidth test "
                        "(default 24,26; empty string skips it)")
    p.add_argument("--bw-reps", type=int, default=20, help="timed copies per size (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default) or cpu for a smoke run without a GPU")
    a = p.parse_args(argv)
    llama = a.model == "llama"
    for name, t5, ll in (("modes", "fp16,bf16,fp32", "bf16"),
                         ("variants", ",".join(VARIANTS), "eager"),
                         ("batch", 8, 1), ("seq", 512, 2048), ("layers", 12, 16)):
        if getattr(a, name) is None:
            setattr(a, name, ll if llama else t5)
    a.modes = [m for m in a.modes.split(",") if m]
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [m for m in a.modes if m not in MODE_DTYPES] + [v for v in a.variants if v not in VARIANTS]
    if bad or not a.modes or not a.variants:
        p.error(f"unknown or empty --modes/--variants entries {bad}; modes are fp16,bf16,fp32 "
                "and variants eager,anomaly")
    a.bw_log2 = [int(x) for x in a.bw_log2.split(",") if x]
    for name in ("batch", "seq", "layers", "steps", "bw_reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must be at least 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False (use --device cpu for a smoke run)")
    return a


def make_config(model, layers, seq):
    if model == "llama":
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=64, max_position_embeddings=seq,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, attention_dropout=0.0,
                          use_cache=False)
        cfg._attn_implementation = "eager"
        return cfg
    cfg = T5Config(vocab_size=32128, d_model=768, d_ff=3072, d_kv=64, num_heads=12,
                   num_layers=layers, feed_forward_proj="relu", dropout_rate=0.0,
                   is_encoder_decoder=False, use_cache=False)
    cfg._attn_implementation = "eager"
    return cfg


class Timer:
    """Times one region: CUDA events + synchronize on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    @contextlib.contextmanager
    def region(self, out):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def train_step(model, opt, scaler, ids, cfg, device, dtype, anomaly):
    opt.zero_grad(set_to_none=True)
    amp = (torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext())
    guard = torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext()
    with guard:
        with amp:
            if isinstance(model, LlamaForCausalLM):
                loss = model(input_ids=ids, labels=ids).loss
            else:
                h = model(input_ids=ids).last_hidden_state
                logits = (h * cfg.d_model ** -0.5) @ model.shared.weight.t()
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, cfg.vocab_size).float(), ids.reshape(-1))
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def bench_step(args, cfg, ids, mode, variant):
    device, dtype, anomaly = args.device, MODE_DTYPES[mode], variant == "anomaly"
    torch.manual_seed(0)
    model = (LlamaForCausalLM if isinstance(cfg, LlamaConfig) else T5EncoderModel)(cfg)
    model = model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer = Timer(device)
    times, losses, skipped, error = [], [], 0, None
    try:
        for _ in range(args.warmup):
            train_step(model, opt, scaler, ids, cfg, device, dtype, anomaly)
        sync(device)
        for _ in range(args.steps):
            scale_before = scaler.get_scale()
            with timer.region(times):
                loss = train_step(model, opt, scaler, ids, cfg, device, dtype, anomaly)
            # Read back only after the timed region has been synchronized.
            losses.append(loss.item())
            skipped += scaler.get_scale() < scale_before
    except RuntimeError as e:
        # Anomaly mode raises when a backward op yields NaN (e.g. an fp16 overflow that
        # GradScaler would have skipped); that is a result of the run, not a script failure.
        error = str(e).splitlines()[0]
    row = {
        "mode": mode, "variant": variant,
        "autocast_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "median_ms": statistics.median(times) if times else None,
        "min_ms": min(times) if times else None,
        "times_ms": times, "losses": losses, "final_scale": scaler.get_scale(),
        "skipped_steps": int(skipped), "error": error,
    }
    if device == "cuda":
        row["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    del model, opt, scaler
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_copy(args, name, log2):
    dtype, n, device = BW_DTYPES[name], 1 << log2, args.device
    src = torch.empty(n, dtype=dtype, device=device).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    timer, times = Timer(device), []
    for _ in range(args.bw_reps):
        with timer.region(times):
            dst.copy_(src)
    moved = 2 * n * src.element_size()
    med = statistics.median(times)
    row = {"dtype": name, "log2_numel": log2, "numel": n, "bytes_moved": moved,
           "median_ms": med, "min_ms": min(times), "median_gb_s": moved / (med * 1e-3) / 1e9,
           "times_ms": times}
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def environment(device):
    env = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda"
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        "python": platform.python_version(),
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                 "cudnn": torch.backends.cudnn.allow_tf32},
    }
    if device == "cpu":
        env["cpu_threads"] = torch.get_num_threads()
    return env


def main(argv=None):
    args = parse_args(argv)
    # fp32 must mean IEEE fp32, not TF32; autocast modes do their matmuls in 16 bits anyway.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # detect_anomaly warns on every entry; one line in the header says it is on instead.
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
    cfg = make_config(args.model, args.layers, args.seq)
    env = environment(args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    run = {"attn_implementation": "eager", "seed": 0,
           "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
           "optimizer": "SGD(lr=0.01)", "grad_scaler": f'GradScaler("{args.device}")',
           "modes": args.modes, "variants": args.variants,
           "bw_log2": args.bw_log2, "bw_reps": args.bw_reps}
    if args.model == "llama":
        # One layer's parameters and the rest, counted on the meta device (no memory).
        with torch.device("meta"):
            one = LlamaForCausalLM(make_config("llama", 1, 8))
        n_params = sum(p.numel() for p in one.parameters())
        config = {"model": "LlamaForCausalLM", "hidden_size": cfg.hidden_size,
                  "num_layers": cfg.num_hidden_layers,
                  "intermediate_size": cfg.intermediate_size,
                  "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
                  "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                  "tie_word_embeddings": True,
                  "objective": "LlamaForCausalLM's loss with labels = input_ids", **run}
        per_layer = n_params - (cfg.vocab_size + 1) * cfg.hidden_size
        config["parameters"] = per_layer * cfg.num_hidden_layers + (cfg.vocab_size + 1) * cfg.hidden_size
        workload = (f"LlamaForCausalLM hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                    f"intermediate {cfg.intermediate_size}, {cfg.num_attention_heads} heads "
                    f"({cfg.num_key_value_heads} key-value), vocab {cfg.vocab_size} (tied), "
                    f"{config['parameters'] / 1e9:.2f}B parameters")
    else:
        config = {"model": "T5EncoderModel", "d_model": cfg.d_model,
                  "num_layers": cfg.num_layers, "d_ff": cfg.d_ff, "num_heads": cfg.num_heads,
                  "d_kv": cfg.d_kv, "vocab_size": cfg.vocab_size,
                  "feed_forward_proj": cfg.feed_forward_proj, "dropout_rate": cfg.dropout_rate,
                  "objective": "mean CE((h * d_model**-0.5) @ shared.weight.T as float, input_ids)",
                  **run}
        workload = (f"T5EncoderModel d_model {cfg.d_model}, {cfg.num_layers} layers, "
                    f"d_ff {cfg.d_ff}, {cfg.num_heads} heads, vocab {cfg.vocab_size}")

    print(f"device {env['device_name']} ({args.device}), torch {env['torch']}, "
          f"transformers {env['transformers']}, CUDA {env['cuda']}")
    print(f"{workload}; batch {args.batch}, seq {args.seq}; "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    print("TF32 off (matmul and cuDNN): fp32 is IEEE fp32; "
          "'anomaly' = forward+backward inside torch.autograd.detect_anomaly()")
    if args.device == "cpu":
        print("CPU smoke run: perf_counter timing, autocast/GradScaler on \"cpu\"")
    print()

    steps = []
    print(f"{'mode':<6} {'variant':<8} {'median ms':>11} {'min ms':>11}  note")
    for mode in args.modes:
        for variant in args.variants:
            r = bench_step(args, cfg, ids, mode, variant)
            steps.append(r)
            med = f"{r['median_ms']:11.2f}" if r["median_ms"] is not None else f"{'-':>11}"
            mn = f"{r['min_ms']:11.2f}" if r["min_ms"] is not None else f"{'-':>11}"
            note = f"error: {r['error']}" if r["error"] else (
                f"{r['skipped_steps']} skipped" if r["skipped_steps"] else "")
            print(f"{mode:<6} {variant:<8} {med} {mn}  {note}", flush=True)

    bandwidth = []
    if args.bw_log2:
        print()
        print(f"{'dtype':<6} {'elements':>9} {'MB moved':>10} {'median ms':>10} {'GB/s':>9}")
        for name in BW_DTYPES:
            for log2 in args.bw_log2:
                r = bench_copy(args, name, log2)
                bandwidth.append(r)
                print(f"{name:<6} {'2^' + str(log2):>9} {r['bytes_moved'] / 1e6:10.1f} "
                      f"{r['median_ms']:10.3f} {r['median_gb_s']:9.1f}", flush=True)
        print("(GB/s = (bytes read + bytes written) / median time, 1 GB = 1e9 bytes)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"script": "bench_t5_gpu_torch.py", "env": env, "config": config,
                       "steps": steps, "bandwidth": bandwidth}, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
