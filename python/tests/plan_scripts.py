"""A user's training script for the plan's tests and for `amprobe compare -- CMD` and
`amprobe fix -- CMD`: `python plan_scripts.py [options]` trains Tower under CPU autocast
(as the options say), calls amprobe_torch.watch unless --no-watch, and writes what it saw
(losses, scales, the dtype of each module's output, the final parameters) as JSON to --out.

Tower's `amplifier` multiplies by --gain; at --spike-step the batch is multiplied by
--spike, so the amplifier's output leaves fp16's range there (and only there, in that
module: the LayerNorm after it brings the values back)."""

import argparse
import json
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]


class Tower(torch.nn.Module):
    def __init__(self, gain, head_fp32=False):
        super().__init__()
        self.head_fp32 = head_fp32
        self.embed = torch.nn.Linear(8, 16)
        self.amplifier = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mid = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 5)
        with torch.no_grad():
            self.amplifier.weight.mul_(gain)

    def forward(self, x):
        h = self.norm(self.amplifier(self.embed(x)))
        h = h + self.mid(h)
        if self.head_fp32:
            with torch.autocast("cpu", enabled=False):
                return self.head(h.float())
        return self.head(h)


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", choices=["fp16", "bf16", "none"], default="fp16")
    p.add_argument("--form", choices=["with", "decorator", "cpu-amp"], default="with")
    p.add_argument("--scaler", choices=["on", "off"], default=None)
    p.add_argument("--init-scale", type=float, default=2.0**16)
    p.add_argument("--gain", type=float, default=200.0)
    p.add_argument("--spike-step", type=int, default=2)
    p.add_argument("--spike", type=float, default=1000.0)
    p.add_argument("--head-fp32", action="store_true", help="the head in a nested autocast(enabled=False)")
    p.add_argument("--no-watch", action="store_true")
    p.add_argument("--exec", default=None, help="a file of code run once the model is built (`model` in scope)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    torch.manual_seed(0)
    model = Tower(a.gain, a.head_fp32)
    if a.exec:
        with open(a.exec, encoding="utf-8") as f:
            exec(f.read(), {"model": model, "torch": torch})
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler_on = (a.scaler or ("on" if a.dtype == "fp16" else "off")) == "on"
    scaler = torch.amp.GradScaler("cpu", init_scale=a.init_scale, enabled=scaler_on)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.dtype)
    if dtype is not None and a.form == "decorator":
        # Made before watch, as a decorator at import time would be.
        run = torch.autocast("cpu", dtype=dtype)(lambda x: model(x))
    elif dtype is not None and a.form == "cpu-amp":
        def run(x):
            with torch.cpu.amp.autocast(dtype=dtype):
                return model(x)
    elif dtype is not None:
        def run(x):
            with torch.autocast("cpu", dtype=dtype):
                return model(x)
    else:
        run = model

    if not a.no_watch:
        import amprobe_torch

        amprobe_torch.watch(model, opt, scaler)
    seen = {}

    def note(name):
        def hook(module, args, out):
            seen.setdefault(name, str(out.dtype).replace("torch.", ""))

        return hook

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(note(name))
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(a.steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (a.steps, 12), generator=g)
    losses, scales = [], []
    for s in range(a.steps):
        opt.zero_grad(set_to_none=True)
        out = run(xs[s] * (a.spike if s == a.spike_step else 1.0))
        loss = torch.nn.functional.cross_entropy(out.float(), ys[s])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss).hex())
        scales.append(scaler.get_scale())
    result = {
        "losses": losses,
        "scales": scales,
        "scaler_enabled": scaler.is_enabled(),
        "dtypes": seen,
        "params": {n: [float(v).hex() for v in p.detach().reshape(-1).tolist()] for n, p in model.named_parameters()},
    }
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
