"""A small network trained with Accelerate as its quick tour teaches: `Accelerator`,
`prepare`, `accelerator.backward`, `accumulate` and `clip_grad_norm_`.

    python accelerate_basic.py OUT_DIR [bf16|fp16|no] [--planted] [--hooks]

`--planted` fills the hidden layer's weights with 1e38, so that its output overflows bf16;
`--hooks` names the first module whose output went non-finite with plain forward hooks
(`hooks.py`). The losses, the final parameters' checksum and the hooks' finding are
written to OUT_DIR/result.json."""

import json
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hooks import first_nonfinite  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def main():
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "bf16"
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=precision, cpu=True, gradient_accumulation_steps=2)
    model = Net()
    if "--planted" in sys.argv:
        with torch.no_grad():
            model.hidden.weight.fill_(1e38)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    seen = first_nonfinite(model) if "--hooks" in sys.argv else {"first": None, "step": 0}
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for i, (xb, yb) in enumerate(data):
        seen["step"] = i // 2
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": losses, "checksum": checksum, "hooks_first": seen["first"]}, f)


if __name__ == "__main__":
    main()
