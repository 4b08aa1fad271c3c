#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and Nsight Compute, with gpu-bin/ from scripts/gpu-pack.sh:
# where the device step's time goes. Times the T5-base-size step (benches/t5_base_gpu.rs)
# without a profiler, then has ncu time every kernel of the same step (one metric,
# gpu__time_duration, clocks not locked), probes off and on, and prints per kernel: launches
# per step, time per step and share, and the grid and block it ran with; the kernels'
# total against the step's wall time says how much of the step the host or the launch
# gaps take. Results go to $OUT (or gpu-results/).
#
#   scripts/gpu-profile.sh [LAYERS] [MODE]      # default: 2 layers, fp16
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
layers=${1:-2}
mode=${2:-fp16}
. scripts/gpu-libpath.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
steps=2
gpu-bin/t5_base_gpu --layers "$layers" --modes "$mode" --warmup 2 --steps 5 \
    --json "$out/wall.json" >"$out/wall.log" 2>&1
cat "$out/wall.log"
for probes in off on; do
    timeout --kill-after=5 240 "$ncu" --clock-control none --metrics gpu__time_duration.sum --print-units base --csv \
        --log-file "$out/ncu-$probes.csv" \
        gpu-bin/t5_base_gpu --layers "$layers" --modes "$mode" --probes "$probes" \
        --warmup 1 --steps $((steps - 1)) >"$out/ncu-$probes.log" 2>&1
    echo "ncu, probes $probes: rc $?"
    python3 scripts/ncu-summary.py "$out/ncu-$probes.csv" --steps "$steps" \
        --wall "$out/wall.json" --probes "$probes" | tee "$out/kernels-$probes.txt"
done
