"""A data-parallel training script for the distributed tests, run by torchrun with the gloo
backend on the CPU: scripts.Net in DistributedDataParallel (or FSDP: FullyShardedDataParallel
with a ShardedGradScaler, or fully_shard per block) under fp16 CPU autocast with a
GradScaler, each rank on its own fixed batches. At step BOOM_STEP the input of rank
BOOM_RANK only is scaled so that its first cast to fp16 overflows.

    torchrun --standalone --nproc-per-node 2 ddp_train.py [--wrap ddp|fsdp|fsdp2]
        [--watch wrapper|model] [--steps N]
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import amprobe_torch  # noqa: E402
from scripts import Net  # noqa: E402

BOOM_STEP = 2
BOOM_RANK = 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", choices=["ddp", "fsdp", "fsdp2"], default="ddp")
    ap.add_argument("--watch", choices=["wrapper", "model"], default="wrapper")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu")
    if a.wrap == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    elif a.wrap == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        ddp = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        scaler = ShardedGradScaler("cpu")
    else:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        ddp = fully_shard(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    # The batches exist before the capture starts, as a data loader's would.
    g = torch.Generator().manual_seed(1 + rank)
    xs = torch.randn(a.steps, 12, 8, generator=g)
    ys = torch.randint(0, 5, (a.steps, 12), generator=g)
    amprobe_torch.watch(ddp if a.watch == "wrapper" else model, opt, scaler)
    for s in range(a.steps):
        opt.zero_grad(set_to_none=True)
        x = xs[s] * (3.0e4 if (s == BOOM_STEP and rank == BOOM_RANK) else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(ddp(x).float(), ys[s])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
