"""The first-Inf / first-NaN rule and the chain between them, as pure functions over a step's
op records (`_records.OpRecord`) and their statistics vectors (full or check: both begin
numel, NaN count, +inf count, -inf count)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from ._records import OpRecord


def _carries(v: Sequence[float], masked: bool) -> tuple:
    """(holds an Inf, holds a NaN) of a vector; a masked op's -inf is not an Inf."""
    return v[2] + (0 if masked else v[3]) > 0, v[1] > 0


def first_nonfinite(ops: Sequence, vecs: Sequence, check: Mapping) -> tuple:
    """(index of the first Inf, index of the first NaN), each None when there is none: the
    first eligible op whose output holds one that none of its inputs held (its
    predecessors' outputs, and the checks `check[e]` of inputs no op of the step made)."""
    n = len(ops)
    has_inf = [False] * n
    has_nan = [False] * n
    first_inf = first_nan = None
    for i, (op, v) in enumerate(zip(ops, vecs)):
        out_inf, out_nan = _carries(v, op.masked)
        in_inf = any(has_inf[p] for p in op.preds) or any(check[e][2] + check[e][3] > 0 for e in op.ext)
        in_nan = any(has_nan[p] for p in op.preds) or any(check[e][1] > 0 for e in op.ext)
        has_inf[i] = out_inf
        has_nan[i] = out_nan
        if op.eligible:
            if first_inf is None and out_inf and not in_inf:
                first_inf = i
            if first_nan is None and out_nan and not in_nan:
                first_nan = i
    return first_inf, first_nan


def chain(ops: Sequence, a: Optional[int], b: Optional[int]) -> list:
    """Ops on a data path from the first Inf (a) to the first NaN (b), in execution order;
    just the origin when there is one, or when the NaN does not descend from the Inf
    (amprobe's own rule)."""
    if a is None or b is None:
        return [x for x in (a, b) if x is not None]
    if a == b:
        return [a]
    if b < a:
        return [b]
    parent, seen, stack = {}, {b}, [b]
    while stack:
        n = stack.pop()
        if n == a:
            path, cur = [a], a
            while cur in parent:
                cur = parent[cur]
                path.append(cur)
            return path
        for p in ops[n].preds:
            if p >= a and p not in seen:
                seen.add(p)
                parent[p] = n
                stack.append(p)
    return [a, b]


def ref(op: OpRecord, step: int) -> dict:
    """A trace's reference to an op of step `step`."""
    return {
        "step": step,
        "micro": op.micro,
        "phase": op.phase,
        "op_index": op.index,
        "op": op.op,
        "module": op.module,
        "forward_op": None,
    }


def origins(ops: Sequence, vecs: Sequence, check: Mapping, step: int) -> dict:
    """The step record's `origins`: first Inf, first NaN and the chain of ops between them."""
    if not any(v[1] + v[2] + v[3] for v in vecs):
        return {"first_inf": None, "first_nan": None, "chain": []}
    first_inf, first_nan = first_nonfinite(ops, vecs, check)
    return {
        "first_inf": ref(ops[first_inf], step) if first_inf is not None else None,
        "first_nan": ref(ops[first_nan], step) if first_nan is not None else None,
        "chain": [ref(ops[i], step) for i in chain(ops, first_inf, first_nan)],
    }
