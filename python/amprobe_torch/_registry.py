"""The open watchers of this process (a watcher leaves at its `close`), which the
process-wide interceptions (`_patches`) tell of backwards, gradient calls and clipping."""

from __future__ import annotations

from typing import Any, List

WATCHERS: List[Any] = []
