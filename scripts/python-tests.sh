#!/usr/bin/env bash
# The PyTorch companion's tests (python/tests, pytest), in a virtual environment with torch,
# pytest, transformers, Accelerate and Lightning (the tests train Hugging Face models and run
# scripts under those trainers; the companion itself needs only torch) kept in a cache outside the clone and reused when present:
# $AMPROBE_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/amprobe/torch-venv. The first run
# installs them from PyPI (on Linux, PyTorch's CUDA build: about 5.6 GB and a few minutes;
# it runs on the CPU). `cargo test` runs this through tests/companion.rs. Two runs at once
# (scripts/test.sh installs while Rust builds) install one after the other: a lock beside
# the environment.
#
#   scripts/python-tests.sh [PYTEST ARGS...]
#   scripts/python-tests.sh --setup     only installs what the tests need
set -euo pipefail
cd "$(dirname "$0")/.."
transformers=5.24.0
venv=${AMPROBE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/torch-venv}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! "$venv/bin/python" -c "import torch, pytest" 2>/dev/null; then
    echo "amprobe: installing torch and pytest into $venv for the companion's tests (once; later runs reuse it)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check torch pytest >&2
fi
# The modeling code the native engine mirrors is transformers 5.x's; pinned so that a new
# release cannot move an op between modules under the tests.
if ! "$venv/bin/python" -c "import transformers, safetensors, sys; sys.exit(transformers.__version__ != '$transformers')" 2>/dev/null; then
    echo "amprobe: installing transformers $transformers and safetensors into $venv for the companion's tests" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "transformers==$transformers" safetensors >&2
fi
# The training libraries the stack tests (python/tests/test_stacks.py) run scripts under,
# pinned: Accelerate (and so the HF Trainer), Lightning, PEFT, timm, DeepSpeed (its fp16 test
# builds its shared-memory op once, with ninja and the C++ compiler, into torch's extension cache).
stacks="accelerate==1.16.0 lightning==2.6.6 peft==0.21.2 timm==1.0.31 deepspeed==0.19.8"
if ! "$venv/bin/python" -c "
import sys, importlib.metadata as m
want = dict(s.split('==') for s in sys.argv[1:])
sys.exit(any(m.version(k) != v for k, v in want.items()))" $stacks 2>/dev/null; then
    echo "amprobe: installing $stacks into $venv for the companion's stack tests" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check $stacks >&2
fi
exec 9>&-  # (the lock, released)
[ "${1:-}" = --setup ] && exit 0
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests "$@"
