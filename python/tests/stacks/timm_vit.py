"""A small ViT made by timm (`timm.create_model`) and trained as timm's train.py does with
AMP: its optimizer factory (`create_optimizer_v2`), fp16 autocast on the CPU, and its
`NativeScaler` (a `torch.amp.GradScaler("cpu")` that scales the loss, unscales, clips and
steps).

    python timm_vit.py OUT_DIR [--planted] [--hooks]

`--planted` scales step PLANTED_STEP's images by 1e5, past fp16's range where the patch
embedding casts them; `--hooks` names the first module whose output went non-finite with
plain forward hooks (`hooks.py`). OUT_DIR/result.json holds the losses, the scaler's scale
before each step, the final parameters' checksum and the hooks' finding."""

import json
import os
import sys

import timm
import torch
from timm.optim import create_optimizer_v2
from timm.utils import NativeScaler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hooks import first_nonfinite  # noqa: E402

PLANTED_STEP = 2


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=10)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    loss_scaler = NativeScaler(device="cpu")
    criterion = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(5, 4, 3, 32, 32, generator=g)
    targets = torch.randint(0, 10, (5, 4), generator=g)
    if "--planted" in sys.argv:
        images[PLANTED_STEP] *= 1e5
    seen = first_nonfinite(model) if "--hooks" in sys.argv else {"first": None, "step": 0}
    model.train()
    losses, scales = [], []
    for step, (x, y) in enumerate(zip(images, targets)):
        seen["step"] = step
        with torch.autocast("cpu", dtype=torch.float16):
            loss = criterion(model(x), y)
        scales.append(loss_scaler._scaler.get_scale())
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
        losses.append(loss.item())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": losses, "scales": scales, "final_scale": loss_scaler._scaler.get_scale(),
                   "checksum": checksum, "hooks_first": seen["first"]}, f)


if __name__ == "__main__":
    main()
