#!/usr/bin/env bash
# The wheel, tested as installed: builds it with `maturin build --release` (the root
# pyproject.toml), installs it into a fresh virtual environment that can import the test
# torch, and there, with that environment's bin/ first on PATH and outside the clone, runs
# `amprobe --version`, `python -c "import amprobe_torch"` and a small bf16 autocast script
# captured by the installed `amprobe run --trace ... -- python train.py`. `.ci/run` runs it.
#
# maturin (pinned) lives in a virtual environment kept in a cache outside the clone and
# reused when present: $AMPROBE_MATURIN_VENV, else ${XDG_CACHE_HOME:-~/.cache}/amprobe/maturin-venv.
# The torch is the companion tests' (scripts/python-tests.sh): $AMPROBE_TORCH_VENV, else
# ${XDG_CACHE_HOME:-~/.cache}/amprobe/torch-venv, made here the same way when missing. The
# fresh environment is made by that environment's Python and sees its site-packages through
# a .pth file, after its own: the wheel's amprobe_torch comes first.
#
# The build reuses target/release: maturin builds the same `amprobe` binary `cargo build
# --release` does. `--strip false` keeps it the same artifact (pyproject.toml's strip = true
# would relink the binary here and again at the next `cargo build --release`); the checked
# wheel differs from `pip install .`'s in its executable's line tables only.
#
#   scripts/wheel-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
maturin=1.16.0
cache=${XDG_CACHE_HOME:-$HOME/.cache}/amprobe
maturin_venv=${AMPROBE_MATURIN_VENV:-$cache/maturin-venv}
torch_venv=${AMPROBE_TORCH_VENV:-$cache/torch-venv}
start=$SECONDS

fail() {
    echo "scripts/wheel-check.sh: FAILED: $*" >&2
    exit 1
}

if ! "$maturin_venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('maturin') != '$maturin')" 2>/dev/null; then
    echo "amprobe: installing maturin $maturin into $maturin_venv to build the wheel (once; later runs reuse it)" >&2
    python3 -m venv "$maturin_venv"
    "$maturin_venv/bin/python" -m pip install -q --disable-pip-version-check "maturin==$maturin" >&2
fi
if ! "$torch_venv/bin/python" -c "import torch, pytest" 2>/dev/null; then
    # What scripts/python-tests.sh installs first, so that either script finds the other's.
    echo "amprobe: installing torch and pytest into $torch_venv for the companion's tests (once; later runs reuse it)" >&2
    python3 -m venv "$torch_venv"
    "$torch_venv/bin/python" -m pip install -q --disable-pip-version-check torch pytest >&2
fi

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
[ -n "$version" ] || fail "no version = \"...\" line in Cargo.toml"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "scripts/wheel-check.sh: building the wheel (maturin $maturin)"
"$maturin_venv/bin/maturin" build --release --strip false --out "$tmp/wheels" \
    || fail "maturin build --release failed"
wheels=("$tmp"/wheels/*.whl)
[ "${#wheels[@]}" = 1 ] && [ -f "${wheels[0]}" ] || fail "maturin wrote ${#wheels[@]} wheels, not one: ${wheels[*]}"
wheel=${wheels[0]}
case "$(basename "$wheel")" in
    "amprobe-$version-"*) ;;
    *) fail "the wheel $(basename "$wheel") is not amprobe $version (Cargo.toml's version)" ;;
esac

# What the wheel holds: the executable, the companion's modules (every one, and nothing
# else from python/), and its own metadata.
python3 - "$wheel" "$version" python/amprobe_torch/*.py <<'EOF' || fail "the wheel's contents (above)"
import sys, zipfile, os
wheel, version, sources = sys.argv[1], sys.argv[2], sys.argv[3:]
z = zipfile.ZipFile(wheel)
names = set(z.namelist())
info = f"amprobe-{version}.dist-info/"
want = {f"amprobe-{version}.data/scripts/amprobe"} | {"amprobe_torch/" + os.path.basename(p) for p in sources}
bad = False
for n in sorted(want - names):
    print(f"  missing from the wheel: {n}", file=sys.stderr)
    bad = True
for n in sorted(names - want):
    if not n.startswith(info):
        print(f"  in the wheel but not the package: {n}", file=sys.stderr)
        bad = True
meta = z.read(info + "METADATA").decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist:"):
        print(f"  the wheel depends on something (torch is the user's): {line}", file=sys.stderr)
        bad = True
    if not line:
        break
sys.exit(bad)
EOF

echo "scripts/wheel-check.sh: installing $(basename "$wheel") into a fresh virtual environment"
venv=$tmp/venv
"$torch_venv/bin/python" -m venv "$venv" || fail "making a virtual environment with $torch_venv/bin/python"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index "$wheel" \
    || fail "pip install of the wheel (with no index: it must need nothing else)"
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$torch_venv/bin/python" -c "
import sysconfig
paths = sysconfig.get_paths()
print('\n'.join(dict.fromkeys([paths['purelib'], paths['platlib']])))" >"$site/amprobe-test-torch.pth"

mkdir "$tmp/run"
cd "$tmp/run"
export PATH="$venv/bin:$PATH"
unset PYTHONPATH

found=$(command -v amprobe || true)
[ "$found" = "$venv/bin/amprobe" ] || fail "amprobe on PATH is '${found:-nothing}', not the installed $venv/bin/amprobe"
out=$(amprobe --version) || fail "the installed amprobe --version exited $?"
[ "$out" = "amprobe $version" ] || fail "the installed amprobe --version says '$out', not 'amprobe $version'"
echo "  $found: $out"

python -c "
import sys, amprobe_torch, torch
where = amprobe_torch.__file__
if not where.startswith(sys.argv[1]):
    sys.exit(f'amprobe_torch was imported from {where}, not the wheel\'s copy under {sys.argv[1]}')
if amprobe_torch.__version__ != sys.argv[2]:
    sys.exit(f'amprobe_torch is version {amprobe_torch.__version__}, the wheel {sys.argv[2]}')
print(f'  import amprobe_torch: {amprobe_torch.__version__} from the wheel, torch {torch.__version__}')
" "$site/" "$version" || fail "python -c 'import amprobe_torch' in the installed environment"

# A script with no amprobe line: four bf16 autocast steps of a small model on the CPU.
steps=4
cat >train.py <<EOF
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
for step in range($steps):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
print("trained", $steps, "steps")
EOF
amprobe run --trace trace.jsonl -- python train.py >run.log 2>&1 \
    || { cat run.log >&2; fail "the installed amprobe run --trace trace.jsonl -- python train.py exited non-zero (its output above)"; }
[ -s trace.jsonl ] || { cat run.log >&2; fail "amprobe run -- python train.py wrote no trace.jsonl (its output above)"; }
python - "$version" "$steps" <<'EOF' || fail "the captured trace (above)"
import json, sys
version, steps = sys.argv[1], int(sys.argv[2])
records = [json.loads(line) for line in open("trace.jsonl")]
kinds = [r.get("type") for r in records]
problems = []
if not kinds or kinds[0] != "header":
    problems.append(f"the first record is {kinds[:1]}, not a header")
else:
    h = records[0]
    if h.get("tool_version") != version:
        problems.append(f"the header's tool_version is {h.get('tool_version')!r}, not {version!r}")
    if (h.get("source") or {}).get("kind") != "pytorch":
        problems.append(f"the header's source is {h.get('source')!r}, not a PyTorch capture")
if kinds.count("step") != steps:
    problems.append(f"{kinds.count('step')} step records, not {steps}")
for p in problems:
    print(f"  trace.jsonl: {p}", file=sys.stderr)
if not problems:
    print(f"  amprobe run -- python train.py: trace with a header and {steps} step records")
sys.exit(bool(problems))
EOF
echo "scripts/wheel-check.sh: the installed wheel passed ($((SECONDS - start)) s)"
