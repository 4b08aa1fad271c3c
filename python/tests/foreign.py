"""Models amprobe does not implement natively, each with an fp16 overflow planted where the
tests know its origin: a custom module's own fp16 arithmetic, a small residual CNN, and a
transformers architecture (OPT)."""

import torch


class EnergyNorm(torch.nn.Module):
    """Normalises by the vector's energy computed in fp16 by hand (the model's own fp16
    failure: x·x passes 65504 once |x| > 256, whatever autocast does)."""

    def forward(self, x):
        h = x.to(torch.float16)
        energy = (h * h).sum(-1, keepdim=True)
        return (h / (energy.float().sqrt() + 1.0).to(h.dtype)).to(x.dtype)


class Custom(torch.nn.Module):
    def __init__(self, d=16, classes=5):
        super().__init__()
        self.embed = torch.nn.Linear(8, d)
        self.gain = torch.nn.Parameter(torch.ones(d))
        self.energy = EnergyNorm()
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.energy(self.embed(x) * self.gain))

    def plant(self):
        """A gain that takes the activations past 256."""
        with torch.no_grad():
            self.gain.fill_(1.0e3)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class SmallResNet(torch.nn.Module):
    def __init__(self, c=8, classes=10):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)
        self.layer1 = Block(c)
        self.layer2 = Block(c)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(c, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        h = self.layer2(self.layer1(h))
        return self.fc(self.pool(h).flatten(1))

    def plant(self):
        """layer2.conv2's weights all 1e4: its 72 products of ReLU outputs pass 65504."""
        with torch.no_grad():
            self.layer2.conv2.weight.fill_(1.0e4)


def opt_model():
    """A tiny OPTForCausalLM (ReLU FFN, learned positions, pre-norm)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    )
    model = OPTForCausalLM(cfg)

    def plant():
        """Decoder layer 1's FFN: fc1's bias 1 (its ReLU passes about 1 everywhere) and fc2's
        weights 1e4, so that fc2's 64 products pass 65504."""
        layer = model.model.decoder.layers[1]
        with torch.no_grad():
            layer.fc1.bias.fill_(1.0)
            layer.fc2.weight.fill_(1.0e4)

    model.plant = plant
    return model


def train(kind, watch=None, planted=True, steps=2, seed=0):
    """Trains one of the models (kind: custom, resnet, opt) under CPU fp16 autocast with a
    GradScaler, the overflow planted before the first step when `planted`; `watch(model,
    opt, scaler)` is called before the loop when given."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "custom":
        model = Custom()
        batch = (torch.randn(12, 8, generator=g), torch.randint(0, 5, (12,), generator=g))
    elif kind == "resnet":
        model = SmallResNet()
        batch = (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
    else:
        model = opt_model()
        ids = torch.randint(0, 64, (2, 12), generator=g)
        batch = (ids, ids)
    if planted:
        model.plant()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    if watch is not None:
        watch(model, opt, scaler)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            if kind == "opt":
                loss = model(input_ids=batch[0], labels=batch[1]).loss
            else:
                loss = torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model
