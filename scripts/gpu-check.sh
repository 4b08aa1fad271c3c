#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with binaries packed by scripts/gpu-pack.sh in gpu-bin/:
# what the machine offers, the kernel compile check, the device parity suites (GPU tests
# with AMPROBE_REQUIRE_GPU=1, so a missing GPU fails instead of skipping: kernels, the
# whole step against the emulator, the step engine), the user's view (`run --backend cuda`
# beside `--backend cpu`, and what `--backend auto` picks), and the T5-base step-time
# benchmark: PyTorch eager AMP and anomaly mode, then amprobe's device step with probes off,
# on and full, the ratios of the two (benches/t5_base_gpu.rs says which) and peak memory;
# then the same for a LLaMA of about 1B parameters in bf16 (eager only); then what the
# PyTorch companion (python/) costs there (scripts/bench-capture.py).
# Each part runs under its own time limit, so one that hangs costs its limit, not the
# machine. Prints one summary table; results go to $OUT (or gpu-results/) as text and JSON.
#
# The Hugging Face samples (GPT-2, LLaMA, BERT, the full T5) each run one step on the
# device and on the CPU; their diagnoses must read the same.
#
#   scripts/gpu-check.sh [--quick | --no-bench | --ab]  # --quick: both benches with 2 layers
#                                                      # --ab: then scripts/gpu-ab.sh (fp16 and
#                                                      # fp32, probes off; gpu-pack.sh --ab REV)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
quick=${1:-}

# One step of samples/$1.toml on each backend: the diagnoses (all but the header line,
# which names the backend) must be equal.
same_diagnosis() {
    local s=$1
    gpu-bin/amprobe run "samples/$s.toml" --steps 1 --backend cuda >"$out/$s-cuda.txt" 2>&1
    gpu-bin/amprobe run "samples/$s.toml" --steps 1 --backend cpu >"$out/$s-cpu.txt" 2>&1
    cat "$out/$s-cuda.txt"
    diff <(tail -n +2 "$out/$s-cpu.txt") <(tail -n +2 "$out/$s-cuda.txt")
}
export -f same_diagnosis
export out

. scripts/gpu-libpath.sh
export AMPROBE_REQUIRE_GPU=1

declare -a rows
step() { # name, time limit in seconds, command...
    local name=$1 limit=$2; shift 2
    local log="$out/$name.log"
    local t0=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    local t=$(python3 -c "print(f'{$(date +%s.%N)-$t0:.1f}')")
    rows+=("$(printf '%-22s %-6s %6ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" "$t" "$log")")
    echo "== $name (rc $rc)"; tail -n 40 "$log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >"$out/nvidia-smi.txt"
step doctor 60 gpu-bin/amprobe doctor
gpu-bin/amprobe doctor --json >"$out/doctor.json" 2>/dev/null
step cuda_kernels 120 gpu-bin/cuda_kernels --include-ignored --test-threads=1
step gpu_parity 180 gpu-bin/gpu_parity --include-ignored --test-threads=1 --nocapture
step device_step 240 gpu-bin/device_step --include-ignored --test-threads=1 --nocapture
step engine_step 120 gpu-bin/engine_step --test-threads=1
step run_cuda 60 gpu-bin/amprobe run samples/t5_overflow.toml --backend cuda --trace "$out/t5_cuda.jsonl"
step run_cpu 60 gpu-bin/amprobe run samples/t5_overflow.toml --backend cpu --trace "$out/t5_cpu.jsonl"
step run_auto 60 gpu-bin/amprobe run samples/t5_overflow.toml --backend auto --trace "$out/t5_auto.jsonl"
step selftest 120 gpu-bin/amprobe doctor --selftest
for s in gpt2_overflow llama_overflow bert_overflow t5_seq2seq; do
    step "hf_$s" 60 bash -c "same_diagnosis $s"
done
if [ "$quick" = "--no-bench" ]; then
    echo; echo "== summary ($(tail -n 1 "$out/nvidia-smi.txt"))"; printf '%s\n' "${rows[@]}"
    exit 0
fi
layers=12; [ "$quick" = "--quick" ] && layers=2
step torch_bench 240 python3 scripts/bench_t5_gpu_torch.py --layers "$layers" --json "$out/torch_bench.json"
step amprobe_bench 300 gpu-bin/t5_base_gpu --layers "$layers" --json "$out/amprobe_bench.json" \
    --torch "$out/torch_bench.json"
# A LLaMA of about 1B parameters (batch 1, seq 2048, bf16): step time and peak memory
# beside PyTorch eager's (2 layers with --quick).
llama_layers=16; [ "$quick" = "--quick" ] && llama_layers=2
step torch_llama 240 python3 scripts/bench_t5_gpu_torch.py --model llama --layers "$llama_layers" \
    --bw-log2 "" --json "$out/torch_llama.json"
step amprobe_llama 300 gpu-bin/t5_base_gpu --model llama --layers "$llama_layers" \
    --json "$out/amprobe_llama.json" --torch "$out/torch_llama.json"
# The PyTorch companion's cost on the GPU (T5-base size): eager, watch (checked by
# modules), watch checking every op, watch with full statistics, detect_anomaly,
# interleaved (the mini size with --quick).
capture_size=base; [ "$quick" = "--quick" ] && capture_size=mini
step bench_capture 240 python3 scripts/bench-capture.py --device cuda --size "$capture_size" \
    --rounds 3 --steps 3
# A WGAN-GP critic whose gradient penalty (torch.autograd.grad) comes every 4 steps and
# every step: such a step is decided at that call and checked op by op after it.
step bench_capture_gp4 120 python3 scripts/bench-capture.py --device cuda --penalty-every 4 \
    --rounds 2 --steps 8 --variants eager,watch,watch-ops
step bench_capture_gp1 120 python3 scripts/bench-capture.py --device cuda --penalty-every 1 \
    --rounds 2 --steps 4 --variants eager,watch,watch-ops

if [ "$quick" = "--ab" ]; then
    step ab 240 scripts/gpu-ab.sh --rounds 2 --modes fp16,fp32 --probes off
fi

echo
echo "== summary ($(tail -n 1 "$out/nvidia-smi.txt"))"
printf '%s\n' "${rows[@]}"
