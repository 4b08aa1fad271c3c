"""A plain loop training a `torch.compile`d model, as torch.compile's tutorial shows it
(`model = torch.compile(model)`), in bf16 autocast on the CPU.

    python compiled.py OUT_DIR [--no-compile]

The losses and the final parameters' checksum are written to OUT_DIR/result.json."""

import json
import os
import sys

import torch


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    if "--no-compile" not in sys.argv:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": losses, "checksum": checksum}, f)


if __name__ == "__main__":
    main()
