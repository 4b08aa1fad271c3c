#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with binaries packed by scripts/gpu-pack.sh in gpu-bin/:
# what the machine offers, the kernel compile check, the device parity suite (GPU tests
# with AMPROBE_REQUIRE_GPU=1, so a missing GPU fails instead of skipping), and the T5-base
# step-time benchmark: PyTorch eager AMP and anomaly mode, then amprobe's device step with
# probes off and on, and the ratios (a)-(d) of the two (benches/t5_base_gpu.rs says which).
# Prints one summary table; results go to $OUT (or gpu-results/) as text and JSON.
#
#   scripts/gpu-check.sh [--quick]     # --quick: both benches with 2 layers
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
quick=${1:-}

# NVRTC and cuBLAS may live in the CUDA toolkit or in PyTorch's nvidia wheels.
extra=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
dirs = set()
for r in roots:
    for lib in glob.glob(os.path.join(r, "**", "lib"), recursive=True):
        if glob.glob(os.path.join(lib, "libnvrtc.so*")) or glob.glob(os.path.join(lib, "libcublas*.so*")):
            dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && extra="$extra:$d"
done
export LD_LIBRARY_PATH="${extra#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AMPROBE_REQUIRE_GPU=1

declare -a rows
step() { # name, command...
    local name=$1; shift
    local log="$out/$name.log"
    local t0=$(date +%s.%N)
    "$@" >"$log" 2>&1
    local rc=$?
    local t=$(python3 -c "print(f'{$(date +%s.%N)-$t0:.1f}')")
    rows+=("$(printf '%-22s %-6s %6ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" "$t" "$log")")
    echo "== $name (rc $rc)"; tail -n 40 "$log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >"$out/nvidia-smi.txt"
step doctor gpu-bin/amprobe doctor
gpu-bin/amprobe doctor --json >"$out/doctor.json" 2>/dev/null
step cuda_kernels gpu-bin/cuda_kernels --test-threads=1
step gpu_parity gpu-bin/gpu_parity --test-threads=1 --nocapture
step selftest gpu-bin/amprobe doctor --selftest
layers=12; [ "$quick" = "--quick" ] && layers=2
step torch_bench python3 scripts/bench_t5_gpu_torch.py --layers "$layers" --json "$out/torch_bench.json"
step amprobe_bench gpu-bin/t5_base_gpu --layers "$layers" --json "$out/amprobe_bench.json" \
    --torch "$out/torch_bench.json"

echo
echo "== summary ($(tail -n 1 "$out/nvidia-smi.txt"))"
printf '%s\n' "${rows[@]}"
