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

# Every line of the run, stamped with the time it was printed (the slowest-ten table at the
# end is read from the stamps: libtest on stable Rust times no test, cargo runs one test
# binary after another).
log=$(mktemp)
run=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$log" "$run"' EXIT
stamped() {
    "$@" 2>&1 | while IFS= read -r line; do
        printf '%s\t%s\n' "$EPOCHREALTIME" "$line" >>"$log"
        printf '%s\n' "$line"
    done
    local rc=${PIPESTATUS[0]}
    printf '%s\t=== end\n' "$EPOCHREALTIME" >>"$log"
    return "$rc"
}
t0=$SECONDS

# torch and the training libraries for the companion's tests, installed (the first time)
# while Rust builds.
scripts/python-tests.sh --setup &
stamped cargo build --release
build_s=$((SECONDS - t0))
# The companion's pytest suite, beside the Rust tests: its Rust test (tests/companion.rs)
# waits for this run and judges it.
py_start=$SECONDS
(
    rc=0
    AMPROBE_BIN="$PWD/target/release/amprobe" scripts/python-tests.sh --durations=10 >"$run/output" 2>&1 || rc=$?
    echo "$rc" >"$run/status.new"
    echo $((SECONDS - py_start)) >"$run/seconds"
    mv "$run/status.new" "$run/status"
) &
stamped cargo test --release -- --skip the_companions_pytest_suite_passes
echo "=== GPU part" >>"$log"
gpu_start=$SECONDS
sim_dir=$(scripts/cudasim.sh)
(
    export LD_LIBRARY_PATH="$sim_dir:$LD_LIBRARY_PATH" AMPROBE_REQUIRE_GPU=1
    # One test at a time: the stand-in's tests read process-wide state (the last error,
    # the traffic switch, which thread's page faults land in a launch's counts), so two of
    # them at once can see each other's (seen on a 2-core machine: 1 to 4 failures in 30
    # parallel runs, none in 30 serial ones).
    stamped cargo test --release -p cudasim -- --test-threads=1
    stamped cargo test --release --test gpu_parity --test cuda_kernels --test cli_backend --test device_step \
        --test device_counters --test engine_step --test tui_tmux -- --include-ignored
    target/release/amprobe doctor --selftest | tail -1
)
gpu_s=$((SECONDS - gpu_start))
echo "=== companion" >>"$log"
AMPROBE_COMPANION_RUN=$run stamped cargo test --release --test companion
echo
echo "build ${build_s} s; GPU part on the simulated device ${gpu_s} s; the companion's pytest suite" \
    "$(cat "$run/seconds") s beside them; all ${SECONDS} s"
# The slowest ten: each Rust test binary's run (its tests run in parallel; the companion's
# binary only waits) and each companion test's call (pytest's --durations).
{
    awk -F'\t' '
        /\t=== end$|\t *Running |\t *Doc-tests / { if (name != "") printf "%.1f\t%s\n", $1 - start, name; name = "" }
        /\t *Running / { split($2, w, " "); name = w[2] == "unittests" ? w[3] " (unit tests)" : w[2]; start = $1 }
        ' "$log" | grep -v 'tests/companion.rs'
    sed -n 's/^ *\([0-9.]*\)s call  *\(.*\)$/\1\tpython\/\2/p' "$run/output"
} | sort -t"$(printf '\t')" -k1,1 -rn | head -10 | awk -F'\t' 'BEGIN { print "slowest ten:" } { printf "  %7.1f s  %s\n", $1, $2 }'
# One closing line over all test binaries; an ignored test of the first part that the GPU
# part ran is not counted as ignored.
awk -F'\t' '
    /^=== GPU part/ { gpu = 1 }
    /^=== companion/ { gpu = 0 }
    { line = (NF > 1 ? $2 : $0) }
    line ~ /^test result:/ { split(line, w, " "); p += w[4]; f += w[6] }
    line ~ /^test .* \.\.\. ignored/ && !gpu { split(line, w, " "); ign[w[2]] = 1 }
    line ~ /^test .* \.\.\. ok$/ && gpu { split(line, w, " "); ran[w[2]] = 1 }
    END {
        n = 0; names = ""
        for (t in ign) if (!(t in ran)) { n++; names = names " " t }
        printf "%d passed, %d failed, %d ignored%s\n", p, f, n, (n ? ":" names : "")
    }' "$log"
