"""The figures of each parameter's record every step (its gradient's Σg², largest |g|,
zeros and the values fp16 flushes unscaled and scaled, non-finite count, and the largest
|p| after the update), computed on the parameter's own device and read back with the
step."""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _stats


class Scratch:
    """Reusable host buffers for the parameters' figures on the CPU, sized by the largest
    gradient seen (so a step allocates no gradient-sized temporaries: the statistics' memory
    is two f32 or f64 buffers of the largest parameter's size)."""

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[torch.dtype, int], torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype, n: int, which: int = 0) -> torch.Tensor:
        """The first `n` elements of buffer `which` of `dtype`, grown when too small."""
        buf = self.buffers.get((dtype, which))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self.buffers[(dtype, which)] = buf
        return buf[:n]

    def abs_of(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(x, out=self._buffer(x.dtype, x.numel()))

    def scaled(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """x·2^k in a reused buffer (two factors: 2^k itself may not be an f32)."""
        out = self._buffer(x.dtype, x.numel())
        half = k // 2
        torch.mul(x, 2.0**half, out=out)
        return out.mul_(2.0 ** (k - half))

    def count_above(self, g: torch.Tensor, bound: float) -> int:
        """How many values of `g` (finite, f32 or f64) have |g| above `bound` (a non-negative
        float the dtype of `g` holds exactly): those `hardshrink` keeps (it writes a zero
        in place of the others). Two passes, one written to a reused buffer; the count is
        of the written values' bits where this torch's kernel writes those zeros as +0
        (`_plain_zeros`, tried once per dtype): an integer count is several times faster
        than a float one, whose speed also falls with the share of zeros."""
        out = self._buffer(g.dtype, g.numel(), 1)
        torch.hardshrink(g, bound, out=out)
        if _plain_zeros(g.dtype):
            return int(torch.count_nonzero(out.view(_INT_OF[g.dtype])))
        return int(torch.count_nonzero(out))

    def count_nonzero(self, g: torch.Tensor) -> int:
        """How many values of `g` (finite, f32 or f64) are not zero: a count of their bits
        when none is -0 (whose bits are the dtype's smallest integer, so the integers'
        minimum says), no pass written; else `count_above(g, 0)`."""
        bits = g.view(_INT_OF[g.dtype])
        if int(torch.amin(bits)) != torch.iinfo(bits.dtype).min:
            return int(torch.count_nonzero(bits))
        return self.count_above(g, 0.0)

    def count_le(self, a: torch.Tensor, bound: float) -> int:
        """How many values of `a` (finite, not negative) are at most `bound` (taken in the
        dtype of `a`, as a comparison takes it): those whose a - bound is not positive.
        Exact (a rounded difference keeps its sign and is zero only when the two are equal)
        and about four times faster here than a comparison's bool pass and its count."""
        d = torch.sub(a, bound, out=self._buffer(a.dtype, a.numel(), 1))
        return a.numel() - int(torch.count_nonzero(d.clamp_min_(0.0)))


_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}
_PLAIN_ZEROS = {}


def _plain_zeros(dtype: torch.dtype) -> bool:
    """Whether `hardshrink` here writes every value it drops as +0 (never -0, whose bits are
    not zero), tried once per dtype on values that reach both its vectorised and its scalar
    loops: small negatives, -0, and both bounds."""
    ok = _PLAIN_ZEROS.get(dtype)
    if ok is None:
        b = 2.0**-25
        x = torch.tensor([-b / 2, -0.0, 0.0, -b, b, b / 4, -1.0, 1.0], dtype=dtype).repeat(1031)
        y = torch.hardshrink(x, b).view(_INT_OF[dtype])
        ok = int(torch.count_nonzero(y)) == 2 * 1031
        _PLAIN_ZEROS[dtype] = ok
    return ok


def param_vector(p: torch.Tensor, scale: Union[float, torch.Tensor]) -> torch.Tensor:
    """The ParamRecord figures of parameter `p` (its gradient unscaled, `scale` the step's
    loss scale, a float or a 0-d tensor) as a float64 vector on its device (read back with
    the step): [has a
    gradient, Σg² over finite values, max finite |g|, zeros, nonzero finite |g| that fp16
    flushes, the same of g·scale (in f32), nonzero finite count, non-finite count, max |p|
    over non-NaN values after the step, NaN count of p after the step]."""
    g = p.grad
    p = _stats.local(p)
    dev = p.device
    f64 = torch.float64
    if g is None:
        # (a frozen parameter: its value's figures only, as `frozen_figures` gives them)
        return torch.tensor(frozen_figures(p), dtype=f64, device=dev)
    g = _stats.local(g).detach()
    # A sparse gradient (an embedding's): its stored values, the rest zeros.
    x = _stats.stored_values(g).reshape(-1)
    implicit_zeros = g.numel() - x.numel()
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    pv = p.detach().reshape(-1)
    n = x.numel()
    zero = torch.zeros((), dtype=f64, device=dev)
    fin = x.isfinite()
    a = torch.where(fin, x.abs(), torch.zeros((), dtype=x.dtype, device=dev))
    nz = fin & (a > 0)
    if isinstance(scale, torch.Tensor):
        # The scaler's scale, not read yet (an f32 value: the product is as with its float).
        scale = scale.detach().to(dev)
    else:
        scale = float(scale)
    scaled = (a * scale).float()
    pa = pv.abs()
    pa = torch.where(pv.isnan(), torch.zeros((), dtype=pa.dtype, device=dev), pa)
    return torch.stack(
        [
            torch.ones((), dtype=f64, device=dev),
            (a.to(f64) ** 2).sum(),
            a.max().to(f64) if n else zero,
            (x == 0).sum(dtype=f64) + implicit_zeros,
            (nz & (a <= _stats.F16_UNDERFLOW)).sum(dtype=f64),
            (nz & (scaled <= _stats.F16_UNDERFLOW)).sum(dtype=f64),
            nz.sum(dtype=f64),
            (~fin).sum(dtype=f64),
            pa.max().to(f64) if pa.numel() else zero,
            pv.isnan().sum(dtype=f64),
        ]
    )


# Gradients up to this many elements are reduced together by multi-tensor norms (their
# cost is the calls); larger ones one by one, by reductions that make no temporary of
# their size (their cost is the passes over memory).
_FOREACH_MAX = 4096


def _extremes(gs: Sequence[torch.Tensor], ps: Sequence[torch.Tensor]) -> List[List[Optional[float]]]:
    """[Σg² in f32, max |g|, nonzero count, min |g| (None: not read), max |p|] of each
    gradient and parameter, read back to the host."""
    inf = float("inf")
    small = [j for j, g in enumerate(gs) if g.numel() <= _FOREACH_MAX]
    out = [None] * len(gs)
    if small:
        sg = [gs[j] for j in small]
        l2, amax, nnz, amin = (torch.stack(torch._foreach_norm(sg, o)).tolist() for o in (2, inf, 0, -inf))
        pmax = torch.stack(torch._foreach_norm([ps[j] for j in small], inf)).tolist()
        for k, j in enumerate(small):
            out[j] = [l2[k], amax[k], nnz[k], amin[k], pmax[k]]
    for j, g in enumerate(gs):
        if out[j] is None:
            lo, hi = torch.aminmax(g)
            plo, phi = torch.aminmax(ps[j])
            figures = torch.stack([torch.linalg.vector_norm(g), torch.maximum(-lo, hi), torch.maximum(-plo, phi)])
            l2, amax, pmax = figures.tolist()
            out[j] = [l2, amax, None, None, pmax]
    return out


def _device_rows(gs: Sequence[torch.Tensor], ps: Sequence[torch.Tensor], need_min: Sequence[bool]) -> torch.Tensor:
    """[Σg² (as its root), max |g|, nonzero count, min |g|, max |p|] of f32/f64 gradients `gs`
    (flat) and their parameters `ps` on one device, as a (5, n) float64 tensor there: no
    synchronisation. The root and the maxima by multi-tensor norms (one kernel for all the
    gradients of a dtype); the counts by `count_nonzero` and the minima by a norm of each
    (multi-tensor norms have no kernel for them, and fall back to one per tensor through a
    float64 copy), only where `need_min` says (elsewhere 0: the flush counts were begun,
    and say what the minimum would)."""
    inf = float("inf")
    f64 = torch.float64
    # In f64: counts exact past 2^24, Σg² neither overflowing nor vanishing.
    l2 = torch.stack(list(torch._foreach_norm(gs, 2, dtype=f64)))
    amax = torch.stack(list(torch._foreach_norm(gs, inf, dtype=f64)))
    pmax = torch.stack(list(torch._foreach_norm(ps, inf, dtype=f64)))
    nnz = torch.stack([torch.count_nonzero(g) for g in gs]).to(f64)
    zero = None
    mins = []
    for g, need in zip(gs, need_min):
        if need:
            mins.append(torch.linalg.vector_norm(g, -inf).to(f64))
        else:
            if zero is None:
                zero = torch.zeros((), dtype=f64, device=g.device)
            mins.append(zero)
    return torch.stack([l2, amax, nnz, torch.stack(mins), pmax])


# A frozen parameter's magnitudes by its id: (a weak reference to it, its version counter,
# max |p|, NaN count). It has no gradient and no update, so they are computed again only
# when something writes it (its version counter moves).
_FROZEN: Dict[int, Tuple[Any, int, float, int]] = {}


def frozen_figures(p: torch.Tensor) -> List[Any]:
    """The figures of a parameter without a gradient (a LoRA model's base weights): no
    gradient's, and its value's largest magnitude (NaNs aside) and NaN count."""
    t = _stats.local(p).detach()
    known = _FROZEN.get(id(p))
    if known is None or known[0]() is not p or known[1] != t._version:
        amax, nans = 0.0, 0
        if t.numel() and t.dtype.is_floating_point:
            nans = int(torch.isnan(t).sum())
            kept = t if nans == 0 else torch.where(torch.isnan(t), 0.0, t)
            amax = float(kept.abs().max())
        elif t.numel():
            amax = float(t.abs().max())
        known = _FROZEN[id(p)] = (weakref.ref(p), t._version, amax, nans)
    v: List[Any] = [0.0] * 10
    v[8], v[9] = known[2], known[3]
    return v


def begin_param_vectors(
    params: Sequence[torch.Tensor],
    scale: Union[float, torch.Tensor],
    counted: Optional[Dict[int, str]] = None,
    guess: Optional[float] = None,
) -> PendingParams:
    """The `param_vector` figures of every parameter, begun where their values are, before
    the step's one read back (`PendingParams.parts`), and finished from what it read
    (`PendingParams.finish`). `scale` is the step's loss scale, a float or the scaler's 0-d
    tensor. `counted`: the last step's `PendingParams.counted` (which parameters needed
    their flush counts, which the general path); what they needed is begun now, before the
    read, so a step like the last needs no second one. `guess`: what the scale (a tensor,
    not read yet) is expected to be (the last step's scale after its update), which lets
    the flush counts begun take its shortcuts; a wrong guess costs those counts a second
    read, never a wrong figure."""
    return PendingParams(params, scale, counted or {}, guess)


class PendingParams:
    """The parameters' figures of one step, begun (see `begin_param_vectors`)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        scale: Union[float, torch.Tensor],
        counted: Dict[int, str],
        guess: Optional[float] = None,
    ) -> None:
        self.given = params
        # The scale the flush counts are begun with: the step's, where it is a float.
        self.count_scale = float(scale) if not isinstance(scale, torch.Tensor) else guess
        self.grads = [None if p.grad is None else _stats.local(p.grad) for p in params]
        self.params = [_stats.local(p) for p in params]
        usable = [
            i
            for i, p in enumerate(self.params)
            if self.grads[i] is not None
            and self.grads[i].dtype in (torch.float32, torch.float64)
            and self.grads[i].layout == torch.strided
            and p.numel()
            and self.grads[i].numel() == p.numel()
            and self.grads[i].device == p.device
        ]
        self.fast = [i for i in usable if _stats.on_host(self.params[i])]
        by_device = {}
        for i in usable:
            if not _stats.on_host(self.params[i]):
                by_device.setdefault(self.params[i].device, []).append(i)
        # What goes into the step's read back.
        self.parts = []
        self.rows = []
        self.counts = {}
        for idx in by_device.values():
            gs = [self.grads[i].detach().reshape(-1) for i in idx]
            ps = [self.params[i].detach().reshape(-1) for i in idx]
            begun = [counted.get(id(params[i])) == "counts" for i in idx]
            self.rows.append((idx, gs, len(self.parts)))
            self.parts.append(_device_rows(gs, ps, [not b for b in begun]))
            # The flush counts of those that needed them last step, begun now (each count
            # a 0-d tensor: the read stacks them all together).
            for j, i in enumerate(idx):
                if begun[j]:
                    self.counts[i] = len(self.parts)
                    self.parts.extend(_device_counts(gs[j], scale if self.count_scale is None else self.count_scale))
        in_rows = {i for idx in by_device.values() for i in idx}
        fast = set(self.fast)
        # The general path: parameters that no shortcut takes, and those that took it last
        # step.
        self.early = {}
        # Parameters without a gradient (frozen: a LoRA model's base weights) have no
        # figures to compute: zeros, on the host.
        self.frozen = {i for i, g in enumerate(self.grads) if g is None}
        for i, p in enumerate(params):
            if i in self.frozen:
                continue
            if (i not in in_rows and i not in fast) or (i in in_rows and counted.get(id(p)) == "general"):
                self.early[i] = len(self.parts)
                self.parts.append(param_vector(p, scale))
        # Ids of the parameters whose rows did not settle their figures this step: "counts"
        # where the flush counts were needed, "general" where the general path was.
        self.counted = {}

    def finish(self, read: Sequence[Any], scale: float, scratch: Optional[Scratch] = None) -> List[List[Any]]:
        """Every parameter's figures as a host list, from `read` (the host values of `parts`,
        as `_stats.gather` gives them) and `scale` (the loss scale, a float); what the read
        did not settle is computed and read now (a second read back). Afterwards `counted`
        holds the ids of the parameters that needed more than their row."""
        scratch = scratch or Scratch()
        out = [None] * len(self.given)
        for i in self.frozen:
            out[i] = frozen_figures(self.given[i])
        for i, slot in self.early.items():
            out[i] = read[slot]
        later = {}
        if 0.0 < scale < float("inf"):
            for idx, gs, slot in self.rows:
                flat = read[slot]
                n = len(idx)
                # Counts begun with a guess of the scale that was wrong are not these.
                right = self.count_scale is None or self.count_scale == scale
                for j, row in enumerate(zip(*(flat[k * n : (k + 1) * n] for k in range(5)))):
                    i = idx[j]
                    c = None
                    if i in self.counts and right:
                        c = (read[self.counts[i]][0], read[self.counts[i] + 1][0])
                    if not _row_finite(row):
                        self.counted[id(self.given[i])] = "general"
                    elif c is not None:
                        # (its minimum was not computed: the counts say whether any value
                        # is small enough to be flushed, and the zeros whether the minimum,
                        # which counts them, would have asked for the counts)
                        if row[2] - c[0] > 0 or row[2] - c[1] > 0 or row[2] < gs[j].numel():
                            self.counted[id(self.given[i])] = "counts"
                    elif not _row_settles(row, scale):
                        self.counted[id(self.given[i])] = "counts"
                    if i in self.early:
                        continue
                    v = _device_figures(gs[j], row, scale, c)
                    if v is None:
                        later[i] = param_vector(self.given[i], scale)
                    else:
                        out[i] = v
            self._host(out, scale, scratch)
        for i, p in enumerate(self.given):
            if out[i] is None and i not in later:
                later[i] = param_vector(p, scale)
        # The flush counts begun above, and the general path's vectors, in one read back.
        counts = [(i, k, t) for i, v in enumerate(out) if v is not None for k, t in enumerate(v) if isinstance(t, torch.Tensor)]
        if counts or later:
            got = _stats.gather([t for _, _, t in counts] + list(later.values()))
            for (i, k, _), c in zip(counts, got):
                out[i][k] = c[0]
            for i, v in zip(later, got[len(counts) :]):
                out[i] = v
        return out

    def _host(self, out: List[Any], scale: float, scratch: Scratch) -> None:
        """The figures of f32/f64 gradients on the CPU (few reductions, no temporaries of
        their size: for small ones multi-tensor norms of them all at once), the flush counts
        only where the smallest |g| may be small enough to be flushed."""
        fast = self.fast
        if not fast:
            return
        gs = [self.grads[i].detach().reshape(-1) for i in fast]
        ps = [self.params[i].detach().reshape(-1) for i in fast]
        bound = _stats.F16_UNDERFLOW * max(1.0, 2.0 / scale)
        for j, (l2, amax, nnz, amin, pmax) in enumerate(_extremes(gs, ps)):
            # NaN or an infinity anywhere shows in the extremes and the norm.
            if l2 - l2 != 0.0 or amax - amax != 0.0 or pmax - pmax != 0.0:
                continue
            n = gs[j].numel()
            if not (amax == 0.0 or 2.0**-60 <= amax <= 2.0**60):
                k = -math.frexp(amax)[1]
                l2 = math.ldexp(float(torch.linalg.vector_norm(scratch.scaled(gs[j], k))), -k)
            small = small_scaled = 0
            # Values at most `bound` are zeros or may flush. A small gradient's smallest |g|
            # tells at once whether it has any; a large one is counted (its zeros only when
            # some values are that small).
            if nnz is None or (nnz and amin <= bound):
                g = gs[j]
                above = scratch.count_above(g, _stats.F16_UNDERFLOW)
                if nnz is None:
                    nnz = n if above == n else scratch.count_nonzero(g)
                nnz = int(nnz)
                small = nnz - above
                if g.dtype == torch.float32 and math.frexp(scale)[0] == 0.5 and scale <= 2.0**100:
                    # |g|·2^k ≤ B exactly when |g| ≤ B·2^-k for f32 values and a normal
                    # B·2^-k (a product that rounds is far from B): no scaled copy, and
                    # none to count from a scale of 1 up when nothing flushes unscaled.
                    if scale == 1.0 or (scale > 1.0 and small == 0):
                        small_scaled = small if scale == 1.0 else 0
                    else:
                        small_scaled = nnz - scratch.count_above(g, _stats.F16_UNDERFLOW / scale)
                else:
                    a = scratch.abs_of(g)
                    scaled = torch.mul(a, scale, out=a).float()
                    small_scaled = scratch.count_le(scaled, _stats.F16_UNDERFLOW) - (n - nnz)
            nonzero = n if nnz is None else int(nnz)
            out[fast[j]] = [1.0, l2**2, amax, float(n - nonzero), float(small), float(small_scaled),
                            float(nonzero), 0.0, pmax, 0.0]


def _row_settles(row: Sequence[float], scale: float) -> bool:
    """Whether a device gradient's row of `_device_rows` gives all its figures: they are
    finite, and its smallest |g| shows that nothing is small enough to be flushed."""
    l2, amax, nnz, amin, pmax = row
    if not _row_finite(row):
        return False
    return not (nnz and amin <= _stats.F16_UNDERFLOW * max(1.0, 2.0 / scale))


def _row_finite(row: Sequence[float]) -> bool:
    """Whether a row's figures are finite and its Σg² trustworthy: a GPU's multi-tensor norm
    sums the squares in f32, where they vanish below |g| = 2^-60 or so and overflow above
    2^60 (the host path rescales such a gradient; the device's takes the general path, in
    f64)."""
    l2, amax, _, _, pmax = row
    if not all(v - v == 0.0 for v in (l2, amax, pmax)):
        return False
    return amax == 0.0 or 2.0**-60 <= amax <= 2.0**60


def _device_counts(g: torch.Tensor, scale: Union[float, torch.Tensor]) -> List[torch.Tensor]:
    """How many values of a device gradient `g` (flat, f32 or f64) fp16 would not flush:
    |g| beyond 2^-25, and |g|·scale (in f32) beyond it, as two 0-d tensors there. `scale`: a
    float (the step's, or a guess of it that `PendingParams.finish` checks), or where none
    is known the scaler's 0-d tensor (an f32 value: the product is as with its float). With
    a float scale of 1 the second count is the first; with a power of two and f32 values,
    a count beyond 2^-25/scale (exactly the same values): two kernels a count. Non-finite
    values are counted too: a gradient that has any takes the general path."""
    b = _stats.F16_UNDERFLOW
    above = torch.nn.functional.softshrink(g, b).count_nonzero()
    if isinstance(scale, torch.Tensor):
        scale = scale.detach().to(g.device)
    elif g.dtype == torch.float32:
        # (f64 values: their product is rounded to f32, which moves some to the bound)
        if scale == 1.0:
            return [above, above]
        if math.frexp(scale)[0] == 0.5 and scale <= 2.0**100:
            return [above, torch.nn.functional.softshrink(g, b / scale).count_nonzero()]
    return [above, ((g.abs() * scale).float() > b).sum()]


def _device_figures(
    g: torch.Tensor, row: Sequence[float], scale: float, counts: Optional[Tuple[float, float]] = None
) -> Optional[List[Any]]:
    """A device gradient's figures from its row of `_device_rows` (read back), and its
    `_device_counts` where they were begun before the read (read back with it); where the
    row shows values small enough to be flushed and no counts were begun, the counts are
    begun now (0-d tensors in slots 4 and 5, read by the caller). None where a figure is
    not finite (the general path takes it)."""
    l2, amax, nnz, amin, pmax = row
    if not _row_finite(row):
        return None
    # (a NaN in p makes its max-abs norm NaN: none here)
    v = [1.0, l2**2, amax, float(g.numel() - nnz), 0.0, 0.0, nnz, 0.0, pmax, 0.0]
    b = _stats.F16_UNDERFLOW
    if counts is not None:
        # Nonzero values at most the bound: all of them, less those beyond it.
        v[4] = nnz - counts[0]
        v[5] = nnz - counts[1]
    elif nnz and amin <= b * max(1.0, 2.0 / scale):
        if g.dtype == torch.float32 and math.frexp(scale)[0] == 0.5 and scale <= 2.0**100:
            above_scaled = torch.nn.functional.softshrink(g, b / scale).count_nonzero()
        else:
            a = g.abs().mul_(scale).float()
            above_scaled = (a > b).sum()
        # Nonzero values at most the bound: all of them, less those beyond it (in f64:
        # exact, where a float minus an integer tensor would round to f32).
        v[4] = nnz - torch.nn.functional.softshrink(g, b).count_nonzero().double()
        v[5] = nnz - above_scaled.double()
    return v


def param_vectors(
    params: Sequence[torch.Tensor], scale: Union[float, torch.Tensor], scratch: Optional[Scratch] = None
) -> List[List[Any]]:
    """`param_vector` of every parameter, as host lists, by the shortcuts of
    `PendingParams` (the figures are the same; Σg² accumulates in f32 by torch's cascade
    summation on the CPU's (relative error far below 1e-6), of g·2^k where squares would
    vanish or overflow)."""
    pending = begin_param_vectors(params, scale)
    return pending.finish(_stats.gather(pending.parts), float(scale), scratch)
