"""A tiny GPT-2 trained by the Hugging Face Trainer as its documentation teaches, in bf16
with gradient accumulation, and with `--amprobe` the one added line: amprobe's callback
in the Trainer's callbacks.

    python trainer_gpt2_callback.py OUT_DIR [--amprobe]

The per-step losses and gradient norms the Trainer logs, the final parameters' checksum
and (with `--amprobe`) how many watchers are still open after `trainer.train()` are
written to OUT_DIR/result.json."""

import json
import os
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
    watched = "--amprobe" in sys.argv
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        bf16=True,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    losses = Losses()
    callbacks = [losses]
    if watched:
        import amprobe_torch

        callbacks.append(amprobe_torch.TrainerCallback())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(12, 16, 128), callbacks=callbacks)
    trainer.train()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    open_watchers = None
    if watched:
        from amprobe_torch import _registry

        open_watchers = len(_registry.WATCHERS)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"logged": losses.logged, "checksum": checksum, "open_watchers": open_watchers}, f)


if __name__ == "__main__":
    main()
