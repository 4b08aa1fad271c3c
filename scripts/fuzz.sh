#!/usr/bin/env bash
# Fuzzes every parser a user feeds (tests/fuzz.rs): a million inputs per target by default.
#   scripts/fuzz.sh [INPUTS_PER_TARGET] [TARGET]
# Targets: run_config hf_config safetensors trace overflow_steps. Failing inputs are saved
# into tests/fuzz_corpus/TARGET/crash-*, which CI replays. An abort (an allocation larger
# than the input justifies) leaves the input that caused it in target/fuzz/TARGET.current;
# this script keeps it as a crash file too.
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-1000000}"
only="${2:-}"
targets=(run_config hf_config safetensors trace overflow_steps)
cargo test --release --test fuzz --no-run >/dev/null 2>&1 || { echo "build failed" >&2; exit 2; }
status=0
for t in "${targets[@]}"; do
  [[ -n "$only" && "$only" != "$t" ]] && continue
  AMPROBE_FUZZ_INPUTS="$n" AMPROBE_FUZZ_TARGET="$t" \
    timeout 3600 cargo test --release --test fuzz -q -- --ignored --nocapture fuzz_long 2>&1 \
    | grep -E "^$t: |saved|panicked|memory allocation" || true
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then
    status=1
    cur="target/fuzz/$t.current"
    if [[ -f "$cur" ]]; then
      keep="tests/fuzz_corpus/$t/crash-abort-$(sha256sum "$cur" | cut -c1-16)"
      cp "$cur" "$keep"
      echo "$t: the run stopped (exit $rc); the input it was on is kept as $keep"
    else
      echo "$t: the run failed (exit $rc)"
    fi
  fi
done
exit $status
