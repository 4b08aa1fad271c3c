#!/usr/bin/env bash
# Fuzzes every parser a user feeds, ten million inputs per target by default:
# tests/fuzz.rs's targets (run config TOML, config.json, safetensors, trace JSONL, step
# lists, the lockfile, the command line's check of the AMPROBE_* variables) and the
# companion's readers of them (scripts/fuzz_env.py).
#   scripts/fuzz.sh [INPUTS_PER_TARGET] [TARGET]
# TARGET: run_config hf_config safetensors trace overflow_steps lockfile env, or python.
# Prints a table per side and exits 1 on any panic, hang or over-allocation (or a finding
# of the Python side). Failing inputs are saved into tests/fuzz_corpus/TARGET/crash-*,
# which CI replays; a run stopped by a refused allocation or a stuck input leaves that
# input in target/fuzz/TARGET.current, kept as a crash file too. The Python side runs under
# the test torch's environment when torch imports there (so that _plan.from_env is fuzzed
# too), else under python3.
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-10000000}"
only="${2:-}"
targets=(run_config hf_config safetensors trace overflow_steps lockfile env)
status=0

wanted() { [[ -z "$only" || "$only" == "$1" ]]; }

# One target in its own process (an abort stops that target only); prints its table row
# (and the table's head, the first time).
rust_target() {
  local t=$1 head=$2 rows="^\| $t "
  [[ -n "$head" ]] && rows="^\|"
  AMPROBE_FUZZ_INPUTS="$n" AMPROBE_FUZZ_TARGET="$t" \
    timeout 7200 cargo test --release --test fuzz -q -- --ignored --nocapture fuzz_long 2>&1 \
    | grep --line-buffered -E "$rows|\(saved |over-allocation: |: a hang|panicked"
  # (the test's own status: the grep's, or a `|| true` after it, would hide a failed build)
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] && return 0
  local cur="target/fuzz/$t.current"
  if [[ -f "$cur" ]]; then
    local keep="tests/fuzz_corpus/$t/crash-abort-$(sha256sum "$cur" | cut -c1-16)"
    mkdir -p "$(dirname "$keep")" && cp "$cur" "$keep"
    echo "$t: the run stopped (exit $rc); the input it was on is kept as $keep"
  else
    echo "$t: the run failed (exit $rc)"
  fi
  return 1
}

if [[ "$only" != python ]]; then
  cargo test --release --test fuzz --no-run >/dev/null 2>&1 || { echo "build failed" >&2; exit 2; }
  head=1
  start=$SECONDS
  for t in "${targets[@]}"; do
    wanted "$t" || continue
    rust_target "$t" "$head" || status=1
    head=
  done
  echo "tests/fuzz.rs: $((SECONDS - start)) s on $(nproc) cores"
fi

if wanted python; then
  py=python3
  venv=${AMPROBE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/torch-venv}
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    py="$venv/bin/python"
  fi
  echo
  "$py" scripts/fuzz_env.py "$n" || status=1
fi
exit $status
