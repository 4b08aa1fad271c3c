#!/usr/bin/env python3
"""PyTorch on the GPT-2-mini, LLaMA-mini, BERT-mini and T5-mini workloads of `cargo bench
--bench hf_step`: transformers GPT2LMHeadModel / LlamaForCausalLM / BertForMaskedLM /
T5ForConditionalGeneration with hidden 256, MLP 1024, 4 layers (T5: 4 + 4, relu), 4 heads
(LLaMA: 2 key/value heads), vocab 512, batch 8, seq 128, each model's loss
(`model(input_ids, labels=input_ids).loss`), SGD(lr=0.01), torch.amp.GradScaler on CPU,
eager attention, dropout 0, --threads threads (default 2). One warm-up step, then the
median of --reps steps (default 5). Needs torch and transformers; CI does not run it.

    python3 scripts/bench_hf_torch.py gpt2 fp32 [--reps 5] [--threads 2] [--json]

It prints `gpt2:fp32: 123.4 ms` and, with --json, one JSON line with the warm-up step's
time and every timed step's (the fields of `scripts/bench_t5_torch.py --json`, plus the
model; the line scripts/bench-cpu.py --models reads).
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, T5Config, T5ForConditionalGeneration)


def model_for(name):
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "eager"
        return GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = BertConfig(vocab_size=512, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "eager"
        return BertForMaskedLM(cfg)
    if name == "t5":
        cfg = T5Config(vocab_size=512, d_model=256, d_ff=1024, d_kv=64, num_heads=4, num_layers=4,
                       feed_forward_proj="relu", dropout_rate=0.0, use_cache=False,
                       decoder_start_token_id=0, pad_token_id=0)
        cfg._attn_implementation = "eager"
        return T5ForConditionalGeneration(cfg)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=("gpt2", "llama", "bert", "t5"))
    ap.add_argument("mode", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--reps", type=int, default=5, help="timed steps after the warm-up (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line with every step's time")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    if a.threads < 1:
        ap.error("--threads must be at least 1")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = model_for(a.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[a.mode]
    scaler = torch.amp.GradScaler("cpu")  # as amprobe's default scaler, in every mode
    ids = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    warmup_ms, times = None, []
    for s in range(a.reps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ms = (time.perf_counter() - t0) * 1e3
        if s:
            times.append(ms)
        else:
            warmup_ms = ms
    med = statistics.median(times)
    print(f"{a.model}:{a.mode}: {med:.1f} ms")
    if a.json:
        print(json.dumps({"side": "torch", "config": f"{a.model}:{a.mode}", "model": a.model,
                          "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": a.reps,
                          "warmup_ms": warmup_ms, "median_ms": med, "times_ms": times}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
