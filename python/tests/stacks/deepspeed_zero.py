"""A small network trained with DeepSpeed as its getting-started guide teaches:
`deepspeed.initialize` with a config (fp16 with dynamic loss scaling, ZeRO stage 1 or 2,
its own AdamW), `model_engine(batch)`, `model_engine.backward(loss)` and
`model_engine.step()`, launched by torchrun.

    torchrun --nproc_per_node 1 deepspeed_zero.py OUT_DIR [--stage N] [--planted] [--hooks]

DeepSpeed's CPU accelerator reports fp16 as unsupported and DeepSpeed then refuses an fp16
config; the CPU runs fp16 arithmetic, so this script tells the accelerator it is supported
(on a GPU that line changes nothing). `--planted` feeds the batches of steps 3 and 5 with
inputs of 6e4 (finite in fp16), whose first layer overflows fp16: DeepSpeed skips both and
halves its scale at the second (its hysteresis is 2). `--hooks` names the first module
whose output went non-finite with plain forward hooks (`hooks.py`). Each step's loss, the
loss scale it ran with, whether DeepSpeed skipped it (its `skipped_steps`), and the final
parameters' checksum are written to OUT_DIR/result.json."""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hooks import first_nonfinite  # noqa: E402

if get_accelerator().device_name() == "cpu":
    get_accelerator().is_fp16_supported = lambda: True


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 2},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def main():
    out = sys.argv[1]
    stage = int(sys.argv[sys.argv.index("--stage") + 1]) if "--stage" in sys.argv else 2
    torch.manual_seed(0)
    model = Net()
    seen = first_nonfinite(model) if "--hooks" in sys.argv else {"first": None, "step": 0}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    if "--planted" in sys.argv:
        x[12:16] = x[20:24] = 6e4
    steps = []
    for i in range(8):
        seen["step"] = i
        xb = x[4 * i : 4 * i + 4].to(engine.device).half()
        yb = y[4 * i : 4 * i + 4].to(engine.device).half()
        scale = float(engine.optimizer.loss_scale)
        skipped = engine.skipped_steps
        loss = torch.nn.functional.mse_loss(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        steps.append({"loss": loss.item(), "scale": scale, "skipped": engine.skipped_steps > skipped})
    checksum = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"steps": steps, "checksum": checksum, "hooks_first": seen["first"]}, f)


if __name__ == "__main__":
    main()
