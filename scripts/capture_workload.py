"""The workload scripts/bench-capture.py and scripts/profile-capture.py time: a T5 encoder
from transformers trained as a language model on its tied embedding, under autocast (fp16
with a GradScaler on a GPU, bf16 on the CPU); timm image classifiers trained the same way;
and the script's own training loop that times them, plain, watched or in anomaly mode."""

import contextlib
import copy
import time

import torch

# What a step's time is read with: the wall clock, or this process's CPU time (every thread
# of it), which other processes on a shared machine do not move (`use_cpu_clock`).
clock = time.perf_counter


def use_cpu_clock():
    global clock
    clock = time.process_time

SIZES = {
    "mini": dict(d_model=384, num_layers=4, num_heads=8, d_ff=1536, d_kv=48, batch=4, seq=128),
    "base": dict(d_model=768, num_layers=12, num_heads=12, d_ff=3072, d_kv=64, batch=8, seq=512),
}


class _OnDevice:
    def sync(self):
        """Waits for the device's queued work (a step's time is then its work's)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class Workload(_OnDevice):
    """The model of size `size` (a key of SIZES; batch and seq may be overridden) on `device`,
    its batch and targets, and the autocast dtype."""

    def __init__(self, device, size, batch=None, seq=None):
        from transformers import T5Config, T5EncoderModel

        s = dict(SIZES[size])
        s["batch"] = batch or s["batch"]
        s["seq"] = seq or s["seq"]
        self.size = s
        self.device = torch.device(device)
        cfg = T5Config(
            vocab_size=32128,
            d_model=s["d_model"],
            d_kv=s["d_kv"],
            d_ff=s["d_ff"],
            num_layers=s["num_layers"],
            num_heads=s["num_heads"],
            dropout_rate=0.0,
            feed_forward_proj="relu",
        )
        torch.manual_seed(0)
        self.model = T5EncoderModel(cfg).to(self.device)
        self.ids = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"]), device=self.device)
        # Targets other than the inputs: against its own ids a tied-embedding LM is already
        # near zero loss, with gradients near 1e-28 that no real run has.
        self.labels = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"]), device=self.device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def describe(self):
        s = self.size
        return (f"d_model {s['d_model']}, {s['num_layers']} layers, d_ff {s['d_ff']}, {s['num_heads']} heads, "
                f"batch {s['batch']}, seq {s['seq']}")

    def loss(self, model):
        """The step's loss with `model` (a copy of `self.model`), under autocast."""
        with torch.autocast(self.device.type, dtype=self.dtype):
            h = model(input_ids=self.ids).last_hidden_state
            logits = h @ model.shared.weight.t()
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), self.labels.flatten())

    def backward(self, model, scaler, step):
        """The step's loss with `model`, scaled and backpropagated (the same every step)."""
        scaler.scale(self.loss(model)).backward()


class CriticWorkload(_OnDevice):
    """A WGAN-GP critic step (an MLP critic scoring real and generated batches, its gradient
    penalty on their interpolates by `torch.autograd.grad` every `penalty_every` steps, as
    lazily regularised GANs take it), under autocast as `Workload`'s is."""

    def __init__(self, device, penalty_every, width=1024, batch=128, features=512):
        self.device = torch.device(device)
        self.penalty_every = penalty_every
        self.size = dict(width=width, batch=batch, features=features)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(features, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        ).to(self.device)
        self.real = torch.randn(batch, features, device=self.device)
        self.fake = torch.randn(batch, features, device=self.device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def describe(self):
        s = self.size
        return (f"MLP {s['features']}-{s['width']}x3-1, batch {s['batch']}, gradient penalty "
                f"every {self.penalty_every} steps")

    def backward(self, model, scaler, step):
        """The critic's loss (and, on a penalty step, its gradient penalty) backpropagated."""
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = model(self.fake).float().mean() - model(self.real).float().mean()
        if step % self.penalty_every == 0:
            eps = torch.rand(self.real.shape[0], 1, device=self.device)
            x = (eps * self.real + (1 - eps) * self.fake).requires_grad_(True)
            with torch.autocast(self.device.type, dtype=self.dtype):
                out = model(x).float()
            # (the scaled output's gradients, unscaled: PyTorch's AMP recipe for a penalty)
            (g,) = torch.autograd.grad(scaler.scale(out.sum()), x, create_graph=True)
            g = g / scaler.get_scale()
            loss = loss + 10.0 * ((g.norm(2, dim=1) - 1.0) ** 2).mean()
        scaler.scale(loss).backward()


class ImageWorkload(_OnDevice):
    """A timm image classifier built from its config (no weights fetched), trained on one
    batch of random images against random labels under autocast as `Workload`'s is:
    `vit-tiny` is timm's `vit_tiny_patch16_224` cut to 2 blocks at 64 px (16 patches),
    `resnet` timm's `resnet18` at 64 px."""

    MODELS = {
        "vit-tiny": ("vit_tiny_patch16_224", dict(depth=2, img_size=64)),
        "resnet": ("resnet18", {}),
    }

    def __init__(self, device, kind, batch=8, pixels=64, classes=10):
        import timm

        name, extra = self.MODELS[kind]
        self.device = torch.device(device)
        self.size = dict(name=name, batch=batch, pixels=pixels, classes=classes, **extra)
        torch.manual_seed(0)
        self.model = timm.create_model(name, pretrained=False, num_classes=classes, **extra).to(self.device)
        self.images = torch.randn(batch, 3, pixels, pixels, device=self.device)
        self.labels = torch.randint(0, classes, (batch,), device=self.device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def describe(self):
        s = self.size
        depth = f", {s['depth']} blocks" if "depth" in s else ""
        return f"timm {s['name']}{depth}, {s['pixels']} px, batch {s['batch']}, {s['classes']} classes"

    def backward(self, model, scaler, step):
        """The step's cross-entropy, scaled and backpropagated (the same every step)."""
        with torch.autocast(self.device.type, dtype=self.dtype):
            logits = model(self.images)
        loss = torch.nn.functional.cross_entropy(logits.float(), self.labels)
        scaler.scale(loss).backward()


def watch_options(variant, trace):
    """`amprobe_torch.watch`'s options for a benchmark variant: the default mode for
    `watch`, every op checked for `watch-ops`, full statistics every step for `watch-full`
    (explicit, so that the environment's AMPROBE_* cannot change what a variant is)."""
    return dict(trace=trace, sample_every=1 if variant == "watch-full" else 0,
                check="ops" if variant == "watch-ops" else "modules")


def loop_times(work, base, variant, steps, trace):
    """The times in ms of `steps` + 1 optimizer steps of a copy of `base` trained by
    `work` in the script's own loop (SGD, a GradScaler enabled for fp16), under `variant`:
    `eager`, a `watch-*` (watched, writing `trace`) or `anomaly` (`detect_anomaly`). The
    first is the run's warm-up, and watch's kept step."""
    import amprobe_torch

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(work.device.type, enabled=work.dtype == torch.float16)
    w = None
    if variant.startswith("watch"):
        w = amprobe_torch.watch(model, opt, scaler, **watch_options(variant, trace))
    times = []
    for step in range(steps + 1):
        work.sync()
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        ctx = torch.autograd.detect_anomaly(check_nan=True) if variant == "anomaly" else contextlib.nullcontext()
        with ctx:
            work.backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
        work.sync()
        times.append((clock() - t0) * 1000.0)
    if w is not None:
        w.close()
    return times
