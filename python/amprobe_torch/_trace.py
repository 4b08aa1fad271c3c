"""Writing amprobe's trace (docs/trace-schema.md, version 1): JSON Lines, one record a line,
flushed as each is written so that a killed run keeps every finished step."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Union

SCHEMA_VERSION = 1


def jfloat(x: Any) -> Optional[Union[float, str]]:
    """A float field: a number when finite, else "NaN", "inf" or "-inf" (JSON has none)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


class TraceWriter:
    """One trace file, written record by record."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "w", encoding="utf-8")

    def write(self, kind: str, record: Dict[str, Any]) -> None:
        line = {"type": kind}
        line.update(record)
        self._f.write(json.dumps(line, allow_nan=False, separators=(",", ":")))
        self._f.write("\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
