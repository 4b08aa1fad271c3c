"""A tiny GPT-2 fine-tuned by the Hugging Face Trainer, as its documentation teaches
(TrainingArguments + Trainer.train), in bf16 with gradient accumulation and clipping.

    python trainer_gpt2.py OUT_DIR [--fp16] [--planted]

`--planted` multiplies one MLP output weight so that the first step overflows fp16/bf16
at that module. The per-step losses the Trainer logs and the final parameters' checksum
are written to OUT_DIR/result.json."""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm")})


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    model = GPT2LMHeadModel(config)
    if "--planted" in sys.argv:
        with torch.no_grad():
            model.transformer.h[1].mlp.c_proj.weight.mul_(3e4)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        bf16="--fp16" not in sys.argv,
        fp16="--fp16" in sys.argv,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(16, 16, 128), callbacks=[losses])
    trainer.train()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    with open(f"{out}/result.json", "w") as f:
        json.dump({"logged": losses.logged, "checksum": checksum}, f)


if __name__ == "__main__":
    main()
