"""Trains one of amprobe's Hugging Face samples (samples/NAME: config.json, model.safetensors,
inputs.safetensors) the way the native engine's run of it does: the same checkpoint and
batch, the family's own objective, SGD, CPU autocast with a GradScaler at its defaults, the
companion watching.

    python train_hf.py SAMPLE_DIR [--steps N] [--lr LR] [--precision fp16|bf16]
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import amprobe_torch  # noqa: E402


def build(sample):
    """The model of a sample directory (its class from `architectures`, eager attention as
    the native engine computes it) and a function from the batch to the family's loss."""
    import transformers

    with open(os.path.join(sample, "config.json"), encoding="utf-8") as f:
        arch = json.load(f)["architectures"][0]
    cls = getattr(transformers, arch)
    model = cls.from_pretrained(sample, attn_implementation="eager", dtype=torch.float32)
    if arch == "T5EncoderModel":
        # The encoder's objective (src/models/t5.rs): logits = (h · d_model^-0.5) · sharedᵀ,
        # mean cross-entropy against the input ids.
        scale = model.config.d_model**-0.5

        def loss_of(batch):
            h = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).last_hidden_state
            logits = torch.nn.functional.linear(h * scale, model.shared.weight)
            labels = batch.get("labels", batch["input_ids"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    elif arch in ("GPT2LMHeadModel", "LlamaForCausalLM"):

        def loss_of(batch):
            return model(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss

    else:  # BertForMaskedLM, T5ForConditionalGeneration: the batch names its labels

        def loss_of(batch):
            return model(**batch).loss

    return model, loss_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sample")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--precision", default="fp16", choices=("fp16", "bf16"))
    a = ap.parse_args()
    torch.manual_seed(0)
    model, loss_of = build(a.sample)
    model.train()
    batch = load_file(os.path.join(a.sample, "inputs.safetensors"))
    dtype = torch.float16 if a.precision == "fp16" else torch.bfloat16
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    amprobe_torch.watch(model, opt, scaler)
    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


if __name__ == "__main__":
    main()
