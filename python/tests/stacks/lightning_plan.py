"""lightning_autoencoder.py's LitAutoEncoder trained by `L.Trainer`, seen from
outside the companion: a Lightning callback reads, at each step's backward, the GradScaler
the precision plugin holds (whether it is enabled, the scale the loss it was handed was
multiplied by), and plain forward hooks note the dtype of each Linear's output at each step.

    python lightning_plan.py OUT_DIR [16-plugin|16-mixed|bf16-mixed] [cpu|cuda]

`16-plugin` gives Lightning a GradScaler through `MixedPrecision("16-mixed", DEVICE,
GradScaler)`; `16-mixed` lets Lightning make its own (on a GPU: on the CPU it trains in
bf16-mixed, without one). OUT_DIR/result.json holds the losses, the
scaler per step ({"enabled", "scale", "scaled_loss"}, or null without one) and the Linears' output dtypes
per step."""

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_autoencoder import LitAutoEncoder  # noqa: E402


class Scaler(L.Callback):
    def __init__(self):
        self.seen = []

    def on_before_backward(self, trainer, pl_module, loss):
        s = getattr(trainer.precision_plugin, "scaler", None)
        self.seen.append(
            None if s is None else {"enabled": s.is_enabled(), "scale": s.get_scale(), "scaled_loss": loss.item()}
        )


def dtype_hooks(model):
    """{step: {module name: output dtype}} for the model's Linears, the step taken from
    `model.seen["step"]` (set by its training_step)."""
    dtypes = {}

    def hook(name):
        def f(module, args, out):
            dtypes.setdefault(str(model.seen["step"]), {})[name] = str(out.dtype).replace("torch.", "")

        return f

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook(name))
    return dtypes


def main():
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 else "16-plugin"
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    L.seed_everything(0, verbose=False)
    x = torch.rand(32, 28 * 28, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    model = LitAutoEncoder()
    dtypes = dtype_hooks(model)
    scaler = Scaler()
    kw = dict(max_epochs=1, accelerator=device, devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[scaler])
    if precision == "16-plugin":
        kw["plugins"] = [MixedPrecision("16-mixed", device, torch.amp.GradScaler(device))]
    else:
        kw["precision"] = precision
    L.Trainer(**kw).fit(model, data)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": model.losses, "scaler": scaler.seen, "dtypes": dtypes}, f)


if __name__ == "__main__":
    main()
