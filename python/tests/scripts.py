"""Small training scripts the tests run, with and without the companion."""

import torch


class Block(torch.nn.Module):
    def __init__(self, d, gain=1.0):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(4 * d, d)
        self.norm = torch.nn.LayerNorm(d)
        with torch.no_grad():
            self.down.weight.mul_(gain)

    def forward(self, x):
        return self.norm(x + self.down(self.act(self.up(x))))


class Net(torch.nn.Module):
    """An MLP tower whose block `boom` (index 1) can be given a gain that overflows fp16."""

    def __init__(self, d=16, classes=5, gain=1.0):
        super().__init__()
        self.embed = torch.nn.Linear(8, d)
        self.blocks = torch.nn.ModuleList([Block(d), Block(d, gain), Block(d)])
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def train(dtype, steps=4, watch=None, gain=1.0, init_scale=2.0**16, boom_step=None, seed=0):
    """Trains Net on fixed batches under CPU autocast with a GradScaler; returns the losses,
    the scale after each step and the final parameters. `watch(model, opt, scaler)` is
    called before the loop when given. At `boom_step` the input is scaled so that the
    forward overflows fp16."""
    torch.manual_seed(seed)
    model = Net(gain=gain)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=dtype == torch.float16)
    if watch is not None:
        watch(model, opt, scaler)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, 12), generator=g)
    losses, scales = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        x = xs[s] * (3.0e4 if s == boom_step else 1.0)
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.float(), ys[s])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, scales, params
