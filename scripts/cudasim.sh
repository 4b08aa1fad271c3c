#!/usr/bin/env bash
# Builds the simulated CUDA device (crates/cudasim) and prints the folder to put first on
# LD_LIBRARY_PATH: it holds the stand-in under the names cudarc opens (libcuda.so,
# libcublas.so). NVRTC is NVIDIA's real library and must be on the path too (.ci/run
# fetches NVIDIA's wheel from PyPI).
#
#   export LD_LIBRARY_PATH="$(scripts/cudasim.sh):$LD_LIBRARY_PATH"
#   AMPROBE_REQUIRE_GPU=1 cargo test --release --test gpu_parity -- --include-ignored
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p cudasim >&2
dir="$PWD/target/cudasim"
mkdir -p "$dir"
for name in libcuda.so libcuda.so.1 libcublas.so libcublasLt.so; do
    ln -sf ../release/libcudasim.so "$dir/$name"
done
echo "$dir"
