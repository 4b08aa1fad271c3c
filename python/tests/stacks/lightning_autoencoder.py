"""Lightning's LitAutoEncoder from its documentation's first example: a `training_step`
that calls the encoder and decoder (never the module's own forward), trained by
`L.Trainer(precision=...)` on the CPU.

    python lightning_autoencoder.py OUT_DIR [bf16-mixed|16-mixed|16-plugin|32] [--planted] [--manual] [--hooks]

`16-plugin` is fp16 through `MixedPrecision("16-mixed", "cpu", GradScaler)` given as a
plugin; `--manual` uses manual optimization (`self.manual_backward`); `--planted` scales
step 2's batch past fp16's range; `--hooks` names the first module whose output went
non-finite with plain forward hooks (`hooks.py`). The losses, the final parameters'
checksum and the hooks' finding are written to OUT_DIR/result.json."""

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hooks import first_nonfinite  # noqa: E402


class LitAutoEncoder(L.LightningModule):
    def __init__(self, manual=False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
        self.automatic_optimization = not manual
        self.losses = []
        self.seen = {"first": None, "step": 0}

    def training_step(self, batch, batch_idx):
        self.seen["step"] = batch_idx
        x = batch[0].view(batch[0].size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            return None
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main():
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "bf16-mixed"
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(40, 28 * 28, generator=g)
    if "--planted" in sys.argv:
        x[16:24] *= 1e5
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    manual = "--manual" in sys.argv
    model = LitAutoEncoder(manual=manual)
    if "--hooks" in sys.argv:
        model.seen = first_nonfinite(model)
    kw = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    if not manual:
        kw["gradient_clip_val"] = 1.0
    if precision == "16-plugin":
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    else:
        kw["precision"] = precision
    trainer = L.Trainer(**kw)
    trainer.fit(model, data)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": model.losses, "checksum": checksum, "hooks_first": model.seen["first"]}, f)


if __name__ == "__main__":
    main()
