"""Writing amprobe's trace (docs/trace-schema.md, version 1): JSON Lines, one record a line,
flushed as each is written so that a killed run keeps every finished step."""

from __future__ import annotations

import json
import math
import os
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
    """One trace file, written record by record, each line in whole writes of its own (no
    buffer: what a killed run wrote is on disk)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb", buffering=0)
        self._end = 0
        # A write failed: nothing more is written (a record after a lost one would not
        # read as the run).
        self.broken = False

    def write(self, kind: str, record: Dict[str, Any]) -> None:
        """Writes one record as one line; where the write fails (a full disk), the file is
        cut back to its last whole line, so that what was written stays readable, the
        error is raised, and later writes are refused."""
        if self.broken:
            raise OSError(f"the trace {self.path} lost a record to a failed write; nothing more is written")
        line = {"type": kind}
        line.update(record)
        data = (json.dumps(line, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                n = self._f.write(view)
                view = view[n:]
        except Exception:
            self.broken = True
            try:
                os.ftruncate(self._f.fileno(), self._end)
                self._f.seek(self._end)
            except OSError:
                pass
            raise
        self._end += len(data)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
