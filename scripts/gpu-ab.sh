#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with binaries packed by `scripts/gpu-pack.sh --ab REV`:
# the T5-base step-time bench of the tip (gpu-bin/t5_base_gpu) and of REV
# (gpu-bin/ab/t5_base_gpu) timed in turns on this one machine, so that a change between
# two hardware runs can be told from a change of machine. Prints the median step of each
# build, mode and probe setting over all its rounds, and their ratio.
#
#   scripts/gpu-ab.sh [--rounds N] [--layers N] [--modes fp16,bf16,fp32] [--probes off,on]
#
# AB_ARGS adds arguments to both benches (on the simulated device, to check this script:
# AB_ARGS="--allow-simulated --batch 1 --seq 16 --vocab 64 --warmup 1 --steps 2").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
rounds=2 layers=12 modes=fp16,bf16,fp32 probes=off,on
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --layers) layers=$2; shift 2 ;;
        --modes) modes=$2; shift 2 ;;
        --probes) probes=$2; shift 2 ;;
        *) echo "gpu-ab.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x gpu-bin/ab/t5_base_gpu ] || { echo "gpu-ab.sh: no gpu-bin/ab/t5_base_gpu: run scripts/gpu-pack.sh --ab REV" >&2; exit 2; }
. scripts/gpu-libpath.sh
rev=$(cat gpu-bin/ab/REV 2>/dev/null || echo ab)
for r in $(seq 1 "$rounds"); do
    for b in tip "$rev"; do
        exe=gpu-bin/t5_base_gpu
        [ "$b" = tip ] || exe=gpu-bin/ab/t5_base_gpu
        echo "== round $r: $b"
        # shellcheck disable=SC2086
        timeout 300 "$exe" --layers "$layers" --modes "$modes" --probes "$probes" \
            --json "$out/ab-$b-$r.json" ${AB_ARGS:-} >"$out/ab-$b-$r.log" 2>&1 || echo "   FAILED (rc $?)"
        tail -n 12 "$out/ab-$b-$r.log" | grep -E '^(fp16|bf16|fp32) ' || true
    done
done
python3 - "$out" "$rev" "$rounds" <<'PY'
import glob, json, statistics, sys

out, rev, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
times = {}
for b in ("tip", rev):
    for path in sorted(glob.glob(f"{out}/ab-{b}-*.json")):
        with open(path) as f:
            data = json.load(f)
        for row in data["steps"]:
            probes = "full" if row["full_statistics"] else "on" if row["probes"] else "off"
            times.setdefault(b, {}).setdefault((row["mode"], probes), []).append(row["median_ms"])
print(f"\nstep time, ms: the median of the rounds' medians ({rounds} rounds of each build in turns on one machine)")
print(f"{'mode':<6} {'probes':<7} {rev:>10} {'tip':>10} {'tip/' + rev:>10}")
for key in sorted(set(times.get("tip", {})) | set(times.get(rev, {}))):
    a = times.get(rev, {}).get(key)
    b = times.get("tip", {}).get(key)
    ma = statistics.median(a) if a else float("nan")
    mb = statistics.median(b) if b else float("nan")
    print(f"{key[0]:<6} {key[1]:<7} {ma:>10.2f} {mb:>10.2f} {mb / ma:>10.3f}")
PY
