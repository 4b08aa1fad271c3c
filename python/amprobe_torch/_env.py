"""The companion's own environment variables (the plan's are `_plan`'s), read and checked: a
value the variable does not take is refused with a message that names the variable and
what it takes. `amprobe run|tui|compare|fix|baseline -- CMD` checks the same values before
the command starts (src/cli/env_check.rs), so that under the CLI the error is the CLI's.
Torch-free: the CLI's `sitecustomize` reads them before torch is imported."""

from __future__ import annotations

import os
from typing import Mapping, Optional

DISABLE = "AMPROBE_DISABLE"
AUTO = "AMPROBE_AUTO"
SAMPLE_EVERY = "AMPROBE_SAMPLE_EVERY"
CHECK = "AMPROBE_CHECK"

_SWITCHES = {"1": True, "0": False, "": False}
_CHECKS = ("modules", "ops")


def _get(env: Optional[Mapping[str, str]], name: str) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def _switch(env: Optional[Mapping[str, str]], name: str) -> bool:
    v = _get(env, name)
    if v not in _SWITCHES:
        raise ValueError(f"{name}={v!r}: expected 1 (on) or 0 (off)")
    return _SWITCHES[v]


def disabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """AMPROBE_DISABLE=1: `watch` does nothing."""
    return _switch(env, DISABLE)


def auto(env: Optional[Mapping[str, str]] = None) -> bool:
    """AMPROBE_AUTO=1 (the CLI sets it): discovery watches a script with no amprobe line."""
    return _switch(env, AUTO)


def sample_every(env: Optional[Mapping[str, str]] = None) -> int:
    """AMPROBE_SAMPLE_EVERY: full records every N steps besides the first (0, the default:
    the first only)."""
    v = _get(env, SAMPLE_EVERY)
    if not v:
        return 0
    # ASCII digits within 64 bits, as the CLI takes: str.isdigit also takes "²", which int()
    # refuses, and int() refuses more than 4300 digits, both with messages of its own.
    digits = v.lstrip("0") or "0"
    if not (v.isascii() and v.isdigit()) or len(digits) > 20 or int(digits) >= 1 << 64:
        raise ValueError(
            f"{SAMPLE_EVERY}={v!r}: expected a whole number of steps, 0 or more "
            "(full op records every N steps besides the first; 0: the first only)"
        )
    return int(digits)


def check(env: Optional[Mapping[str, str]] = None) -> str:
    """AMPROBE_CHECK: how steps whose records are not kept are checked."""
    v = _get(env, CHECK) or "modules"
    if v not in _CHECKS:
        raise ValueError(f"{CHECK}={v!r}: expected `modules` (the default) or `ops`")
    return v

