#!/usr/bin/env python3
"""PyTorch on the T5-mini workload of `cargo bench --bench t5_step`, for side-by-side
figures: transformers T5EncoderModel (relu FFN, d_model 256, d_ff 1024, 4 layers, 4 heads,
d_kv 64, vocab 512), batch 8, seq 128, logits = (h * d_model**-0.5) @ shared.weight.T,
mean cross-entropy against the input ids, SGD(lr=0.01), torch.amp.GradScaler on CPU.
Prints the median step time per mode. Needs torch and transformers; CI does not run it.

    python3 scripts/bench_t5_torch.py
"""
import statistics
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


def bench(dtype, hooks=False, anomaly=False, reps=5):
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
    step_fn(model, opt, scaler, ids, dtype)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.autograd.set_detect_anomaly(anomaly):
            step_fn(model, opt, scaler, ids, dtype)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = [("fp32", bench(None)), ("bf16 autocast", bench(torch.bfloat16)), ("fp32 + module hooks", bench(None, hooks=True)),
            ("fp32 + anomaly mode", bench(None, anomaly=True)), ("fp16 autocast", bench(torch.float16, reps=2))]
    for name, ms in rows:
        print(f"{name:<22} {ms:9.1f} ms")
