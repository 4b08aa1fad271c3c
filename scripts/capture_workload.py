"""The workload scripts/bench-capture.py and scripts/profile-capture.py time: a T5 encoder
from transformers trained as a language model on its tied embedding, under autocast (fp16
with a GradScaler on a GPU, bf16 on the CPU)."""

import torch

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
