#!/usr/bin/env bash
# The one test command: every Rust test, the companion's pytest suite (tests/companion.rs,
# torch installed into a cache outside the clone), and the GPU suite on the simulated device
# (crates/cudasim) with NVIDIA's real NVRTC. Nothing passes by skipping: a test that needs a
# GPU is listed as ignored in the first part (plain `cargo test`) and runs in the second,
# where AMPROBE_REQUIRE_GPU=1 turns a missing device into a failure.
#
#     scripts/test.sh            everything
#     scripts/test.sh --tools    only makes sure of the tools it needs (a C++ compiler, tmux)
set -euo pipefail
cd "$(dirname "$0")/.."

# The simulated device's kernels are the project's .cu files built as C++; the terminal
# UI's tmux test drives a real tmux.
need() {
    command -v "$1" >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: installing $2 (needed for $3)"
        apt-get update -qq && apt-get install -y -qq "$2" >/dev/null
    else
        echo "scripts/test.sh: $1 is missing; install $2 (needed for $3)" >&2
        exit 2
    fi
}
need c++ g++ "the simulated device's kernels"
need tmux tmux "tests/tui_tmux.rs"
[ "${1:-}" = --tools ] && exit 0

# NVRTC from NVIDIA's wheel on PyPI, kept under target/.
nvrtc_dir=target/ci-nvrtc
if [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    echo "scripts/test.sh: fetching NVRTC (nvidia-cuda-nvrtc 13.0) into $nvrtc_dir"
    python3 -m pip download -q --no-deps -d "$nvrtc_dir/whl" 'nvidia-cuda-nvrtc==13.0.*' >/dev/null
    python3 -m zipfile -e "$nvrtc_dir"/whl/*.whl "$nvrtc_dir"
fi
export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release 2>&1 | tee "$log"
echo "=== GPU part" >>"$log"
gpu_start=$SECONDS
sim_dir=$(scripts/cudasim.sh)
(
    export LD_LIBRARY_PATH="$sim_dir:$LD_LIBRARY_PATH" AMPROBE_REQUIRE_GPU=1
    # One test at a time: the stand-in's tests read process-wide state (the last error,
    # the traffic switch, which thread's page faults land in a launch's counts), so two of
    # them at once can see each other's (seen on a 2-core machine: 1 to 4 failures in 30
    # parallel runs, none in 30 serial ones).
    cargo test --release -p cudasim -- --test-threads=1
    cargo test --release --test gpu_parity --test cuda_kernels --test cli_backend --test device_step \
        --test device_counters --test engine_step --test tui_tmux -- --include-ignored
    target/release/amprobe doctor --selftest | tail -1
) 2>&1 | tee -a "$log"
echo "GPU part on the simulated device: $((SECONDS - gpu_start)) s"
# One closing line over all test binaries; an ignored test of the first part that the GPU
# part ran is not counted as ignored.
awk '
    /^=== GPU part/ { gpu = 1 }
    /^test result:/ { p += $4; f += $6 }
    /^test .* \.\.\. ignored/ && !gpu { ign[$2] = 1 }
    /^test .* \.\.\. ok$/ && gpu { ran[$2] = 1 }
    END {
        n = 0; names = ""
        for (t in ign) if (!(t in ran)) { n++; names = names " " t }
        printf "%d passed, %d failed, %d ignored%s\n", p, f, n, (n ? ":" names : "")
    }' "$log"
