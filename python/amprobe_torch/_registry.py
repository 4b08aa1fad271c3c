"""The watchers of this process (open and closed), which the process-wide interceptions
(`_patches`) tell of backwards, gradient calls and clipping."""

from __future__ import annotations

from typing import Any, List

WATCHERS: List[Any] = []
