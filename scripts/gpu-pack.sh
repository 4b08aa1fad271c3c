#!/usr/bin/env bash
# Builds the release binary, the GPU test binaries (kernels, parity, the device step, the
# step engine) and the GPU step-time bench here (the GPU
# machine has no Rust toolchain) and copies them, stripped, into gpu-bin/ (ignored by git)
# for the device run:
#
#   scripts/gpu-pack.sh            # then carry gpu-bin/ and run scripts/gpu-check.sh there
#   scripts/gpu-pack.sh --ab REV   # also the step-time bench built at REV, in gpu-bin/ab/,
#                                  # for scripts/gpu-ab.sh (both builds timed on one machine)
set -euo pipefail
cd "$(dirname "$0")/.."
ab=
if [ "${1:-}" = "--ab" ]; then
    ab=$(git rev-parse --short "${2:?--ab needs a revision}")
fi
cargo build --release
tests=$(cargo test --release --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("gpu_parity", "cuda_kernels", "device_step", "engine_step"):
        print(m["target"]["name"], m["executable"])
')
bench=$(cargo bench --bench t5_base_gpu --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "t5_base_gpu":
        print(m["executable"])
')
rm -rf gpu-bin && mkdir -p gpu-bin
strip -o gpu-bin/t5_base_gpu "$bench"
strip -o gpu-bin/amprobe target/release/amprobe
while read -r name exe; do
    strip -o "gpu-bin/$name" "$exe"
done <<< "$tests"
if [ -n "$ab" ]; then
    # A worktree at REV with its own target folder (both under target/, ignored), built
    # as the tip's bench is.
    git worktree remove --force target/ab-src 2>/dev/null || true
    git worktree add --detach target/ab-src "$ab" >/dev/null
    exe=$(CARGO_TARGET_DIR=target/ab-target cargo bench --manifest-path target/ab-src/Cargo.toml \
        --bench t5_base_gpu --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "t5_base_gpu":
        print(m["executable"])
')
    mkdir -p gpu-bin/ab
    strip -o gpu-bin/ab/t5_base_gpu "$exe"
    echo "$ab" > gpu-bin/ab/REV
    git worktree remove --force target/ab-src
fi
ls -la gpu-bin
