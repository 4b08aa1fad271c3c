"""A small MLP sharded by FSDP2 as its documentation teaches (`fully_shard` on each layer,
then on the root), on two ranks with gloo on the CPU, each rank on its own batches; AdamW,
gradient clipping by norm.

    torchrun --standalone --nproc-per-node 2 fsdp2_train.py OUT_DIR [mp|autocast]

`mp` (the default) is FSDP2's own mixed precision, `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`; `autocast` leaves the parameters fp32 and runs the forward under bf16
CPU autocast. Each rank writes OUT_DIR/result.rank{R}.json: its losses, the norms clipping
returned, its parameters' names and the final (unsharded) parameters' checksum."""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def main():
    out = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "mp"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mode == "mp" else {}
    for layer in (model.inp, model.hidden, model.out):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    xs, ys = torch.randn(4, 6, 8, generator=g), torch.randint(0, 4, (4, 6), generator=g)
    losses, norms = [], []
    for x, y in zip(xs, ys):
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
        else:
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    checksum = sum(float(p.full_tensor().detach().double().sum()) for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    # (gloo's worker threads drop finished work, and the tensors it holds, after it completes:
    # the barrier and freeing the sharded model let them do so before the interpreter exits)
    dist.barrier()
    del model, optimizer, norm
    gc.collect()
    dist.destroy_process_group()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": norms, "names": names, "checksum": checksum}, f)


if __name__ == "__main__":
    main()
