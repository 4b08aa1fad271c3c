"""A tiny GPT-2 given LoRA adapters by PEFT as its documentation teaches
(`get_peft_model(model, LoraConfig(...))`, `print_trainable_parameters`), trained by a
plain loop: AdamW over the trainable parameters, bf16 CPU autocast, gradient clipping.

    python peft_lora.py OUT_DIR [--planted]

`--planted` sets one element of a frozen base weight (the first block's `mlp.c_fc`) to
PLANTED, so that its largest |value| is known. OUT_DIR/result.json holds the losses, the
norms clipping returned, each LoRA parameter's gradient L2 norm at each step (read before
the optimizer's step), the frozen weight's largest |value| after each step (read from the
weight itself), the names of the model's parameters and the final parameters' checksum."""

import json
import os
import sys

import torch
from peft import LoraConfig, TaskType, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

PLANTED = 10630.0
FROZEN = "base_model.model.transformer.h.0.mlp.c_fc.weight"


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    base = GPT2LMHeadModel(config)
    if "--planted" in sys.argv:
        with torch.no_grad():
            base.transformer.h[0].mlp.c_fc.weight[3, 5] = PLANTED
    lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(base, lora)
    model.print_trainable_parameters()
    params = dict(model.named_parameters())
    frozen = params[FROZEN]
    assert not frozen.requires_grad
    lora_names = [n for n, p in params.items() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 2, 16), generator=g)
    model.train()
    losses, norms, lora_grads, frozen_max = [], [], [], []
    for batch in ids:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        lora_grads.append({n: float(params[n].grad.double().norm()) for n in lora_names})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        frozen_max.append(float(frozen.detach().abs().max()))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": norms, "lora_grads": lora_grads, "frozen": FROZEN,
                   "frozen_max_abs": frozen_max, "names": list(params), "lora": lora_names,
                   "checksum": checksum}, f)


if __name__ == "__main__":
    main()
