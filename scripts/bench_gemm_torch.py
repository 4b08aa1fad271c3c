#!/usr/bin/env python3
"""PyTorch's matrix products on the shapes of benches/gemm_shapes.rs (fp32, --threads
threads, default 2): the same table, median of 40 calls after one warm-up, in
microseconds and GFLOP/s, so the two can be read side by side.

    /path/to/venv-with-torch/bin/python scripts/bench_gemm_torch.py
"""
import argparse
import statistics
import sys
import time

SHAPES = [
    ("bmm 32x 128x64 . 64x128", (32, 128, 64), (32, 64, 128)),
    ("bmm 32x 128x128 . 128x64", (32, 128, 128), (32, 128, 64)),
    ("matmul 1024x256 . 256x256", (1024, 256), (256, 256)),
    ("matmul 1024x256 . 256x1024", (1024, 256), (256, 1024)),
    ("matmul 1024x1024 . 1024x256", (1024, 1024), (1024, 256)),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"bench_gemm_torch.py: error: PyTorch is needed ({e})", file=sys.stderr)
        sys.exit(1)
    torch.set_num_threads(args.threads)
    print(f"{'product':<32} {'median us':>10} {'GFLOP/s':>10}")
    for label, sa, sb in SHAPES:
        a, b = torch.rand(sa) - 0.5, torch.rand(sb) - 0.5
        times = []
        for _ in range(41):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        flop = 2.0 * a.numel() * sb[-1]
        print(f"{label:<32} {med * 1e6:>10.0f} {flop / med / 1e9:>10.1f}")


if __name__ == "__main__":
    main()
