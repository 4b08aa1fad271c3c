#!/usr/bin/env bash
# The PyTorch companion's tests (python/tests, pytest), in a virtual environment with torch
# and pytest kept in a cache outside the clone and reused when present:
# $AMPROBE_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/amprobe/torch-venv. The first run
# installs them from PyPI (on Linux, PyTorch's CUDA build: about 5.6 GB and a few minutes;
# it runs on the CPU). `cargo test` runs this through tests/companion.rs.
#
#   scripts/python-tests.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${AMPROBE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/torch-venv}
if ! "$venv/bin/python" -c "import torch, pytest" 2>/dev/null; then
    echo "amprobe: installing torch and pytest into $venv for the companion's tests (once; later runs reuse it)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check torch pytest >&2
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests "$@"
