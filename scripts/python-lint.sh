#!/usr/bin/env bash
# The companion's lint: pyflakes (pinned) over python/ and scripts/*.py, in a small virtual
# environment kept in a cache outside the clone ($AMPROBE_LINT_VENV, else
# ${XDG_CACHE_HOME:-~/.cache}/amprobe/lint-venv), made the first time. `.ci/run` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
pyflakes=3.2.0
venv=${AMPROBE_LINT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/amprobe/lint-venv}
if ! "$venv/bin/python" -c "import pyflakes, sys; sys.exit(pyflakes.__version__ != '$pyflakes')" 2>/dev/null; then
    echo "amprobe: installing pyflakes $pyflakes into $venv for the companion's lint" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "pyflakes==$pyflakes" >&2
fi
exec "$venv/bin/python" -m pyflakes python scripts/*.py
