"""Lightning's LitAutoEncoder from its documentation's first example, trained by
`L.Trainer` on the CPU, and with `--amprobe` the one added line: amprobe's callback in the
Trainer's callbacks.

    python lightning_autoencoder_callback.py OUT_DIR [bf16-mixed|16-plugin] [--amprobe]

`16-plugin` is fp16 through `MixedPrecision("16-mixed", "cpu", GradScaler)` given as a
plugin. The losses, the final parameters' checksum and (with `--amprobe`) how many
watchers are still open after `trainer.fit` are written to OUT_DIR/result.json."""

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn


class LitAutoEncoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x = batch[0].view(batch[0].size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main():
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "bf16-mixed"
    watched = "--amprobe" in sys.argv
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(32, 28 * 28, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    model = LitAutoEncoder()
    kw = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    if precision == "16-plugin":
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    else:
        kw["precision"] = precision
    if watched:
        import amprobe_torch

        kw["callbacks"] = [amprobe_torch.LightningCallback()]
    trainer = L.Trainer(**kw)
    trainer.fit(model, data)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    open_watchers = None
    if watched:
        from amprobe_torch import _registry

        open_watchers = len(_registry.WATCHERS)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": model.losses, "checksum": checksum, "open_watchers": open_watchers}, f)


if __name__ == "__main__":
    main()
