#!/usr/bin/env bash
# The PyTorch companion's tests (python/tests, pytest), in a virtual environment with torch,
# pytest and transformers (the tests train Hugging Face models; the companion itself needs
# only torch) kept in a cache outside the clone and reused when present:
# $AMPROBE_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/amprobe/torch-venv. The first run
# installs them from PyPI (on Linux, PyTorch's CUDA build: about 5.6 GB and a few minutes;
# it runs on the CPU). `cargo test` runs this through tests/companion.rs.
#
#   scripts/python-tests.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
transformers=5.24.0
venv=${AMPROBE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/torch-venv}
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
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests "$@"
