#!/usr/bin/env bash
# Regenerates the example reports under reports/.
#
#   scripts/make-gallery.sh [CONFIG [STEPS [RUN FLAGS...]]]
#
# What it runs: the training config CONFIG (default samples/t5_overflow.toml, the T5 fixture) for
# STEPS steps (default 2) in fp16, bf16 and fp32, on the same weights, data and seed, with op
# records kept for every step and any extra RUN FLAGS passed to `amprobe run` (default, for
# the seed MLP only: --growth-interval 5, so the loss scale grows into fp16's overflow within
# the run and the skips show). Then, for each precision, `amprobe report`; a comparison of
# the three against fp32 (`amprobe compare`); and a Perfetto export of the fp16 run.
# For the seed MLP: scripts/make-gallery.sh samples/mlp.toml 60
#
# Output, for a config named NAME (its file name without .toml):
#   reports/NAME/README.md                      links to everything below
#   reports/NAME/{fp16,bf16,fp32}/              summary.md, index.html, charts (PNG + SVG)
#   reports/NAME/compare/                       summary.md, index.html, overlays, op diff
#   reports/NAME/fp16.perfetto.json             open in https://ui.perfetto.dev
#   reports/NAME/traces/PRECISION.{jsonl,txt}   the traces and what `run` printed
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${1:-samples/t5_overflow.toml}
STEPS=${2:-2}
if [ $# -ge 3 ]; then
  RUN_FLAGS=("${@:3}")
elif [ "$CONFIG" = samples/mlp.toml ]; then
  RUN_FLAGS=(--growth-interval 5)
else
  RUN_FLAGS=()
fi
[ -f "$CONFIG" ] || { echo "make-gallery: no config at $CONFIG" >&2; exit 2; }

NAME=$(basename "$CONFIG" .toml)
OUT=reports/$NAME
cargo build --release --quiet
BIN=target/release/amprobe

rm -rf "$OUT"
mkdir -p "$OUT/traces"
for p in fp16 bf16 fp32; do
  echo "== $NAME $p"
  "$BIN" run "$CONFIG" --precision "$p" --steps "$STEPS" --sample-every 1 \
    --trace "$OUT/traces/$p.jsonl" ${RUN_FLAGS[@]+"${RUN_FLAGS[@]}"} > "$OUT/traces/$p.txt"
  "$BIN" report "$OUT/traces/$p.jsonl" --out "$OUT/$p"
done
echo "== $NAME compare"
"$BIN" compare "$OUT/traces/fp16.jsonl" "$OUT/traces/bf16.jsonl" "$OUT/traces/fp32.jsonl" \
  --out "$OUT/compare" | tee "$OUT/traces/compare.txt"
"$BIN" export --perfetto "$OUT/traces/fp16.jsonl" --out "$OUT/fp16.perfetto.json"

{
  echo "# Example reports: \`$CONFIG\`"
  echo
  echo "Made by \`scripts/make-gallery.sh${*:+ $*}\`: $STEPS steps in fp16, bf16 and fp32 on the same"
  echo "weights, data and seed${RUN_FLAGS[*]+ (run flags: \`${RUN_FLAGS[*]}\`)}."
  echo
  echo "- fp16 vs bf16 vs fp32: [compare/summary.md](compare/summary.md) ([HTML](compare/index.html))"
  for p in fp16 bf16 fp32; do
    echo "- $p run: [$p/summary.md]($p/summary.md) ([HTML]($p/index.html))"
  done
  echo "- fp16 run in Perfetto: [fp16.perfetto.json](fp16.perfetto.json) (open it in <https://ui.perfetto.dev>)"
  echo
  echo "First divergences:"
  echo
  echo '```'
  grep -v '^report:\|^summary:' "$OUT/traces/compare.txt"
  echo '```'
} > "$OUT/README.md"
echo "gallery: $OUT/README.md"
