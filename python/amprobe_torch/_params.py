"""The figures of each parameter's record every step (its gradient's Σg², largest |g|,
zeros and the values fp16 flushes unscaled and scaled, non-finite count, and the largest
|p| after the update), computed on the parameter's own device and read back with the
step."""

import math

import torch

from . import _stats


class Scratch:
    """Reusable host buffers for the parameters' figures on the CPU, sized by the largest
    gradient seen (so a step allocates no gradient-sized temporaries: the statistics' memory
    is two f32 or f64 buffers of the largest parameter's size)."""

    def __init__(self):
        self.buffers = {}

    def _buffer(self, dtype, n, which=0):
        """The first `n` elements of buffer `which` of `dtype`, grown when too small."""
        buf = self.buffers.get((dtype, which))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self.buffers[(dtype, which)] = buf
        return buf[:n]

    def abs_of(self, x):
        return torch.abs(x, out=self._buffer(x.dtype, x.numel()))

    def scaled(self, x, k):
        """x·2^k in a reused buffer (two factors: 2^k itself may not be an f32)."""
        out = self._buffer(x.dtype, x.numel())
        half = k // 2
        torch.mul(x, 2.0**half, out=out)
        return out.mul_(2.0 ** (k - half))

    def count_abs_le(self, g, bound):
        """How many values of `g` (finite) have |g| at most `bound` (a non-negative float
        the dtype of `g` holds exactly): those softshrink sends to zero (beyond the bound
        it gives |g| - bound, a rounded difference that is zero only when the two are
        equal). Two passes, one written to a reused buffer."""
        out = self._buffer(g.dtype, g.numel(), 1)
        try:
            torch._C._nn.softshrink(g, bound, out=out)
        except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - older torch
            out.copy_(torch.nn.functional.softshrink(g, bound))
        return g.numel() - int(torch.count_nonzero(out))

    def count_le(self, a, bound):
        """How many values of `a` (finite, not negative) are at most `bound` (taken in the
        dtype of `a`, as a comparison takes it): those whose a - bound is not positive.
        Exact (a rounded difference keeps its sign and is zero only when the two are equal)
        and about four times faster here than a comparison's bool pass and its count."""
        d = torch.sub(a, bound, out=self._buffer(a.dtype, a.numel(), 1))
        return a.numel() - int(torch.count_nonzero(d.clamp_min_(0.0)))


def param_vector(p, scale):
    """The ParamRecord figures of parameter `p` (its gradient unscaled, `scale` the step's
    loss scale) as a float64 vector on its device (read back with the step): [has a
    gradient, Σg² over finite values, max finite |g|, zeros, nonzero finite |g| that fp16
    flushes, the same of g·scale (in f32), nonzero finite count, non-finite count, max |p|
    over non-NaN values after the step, NaN count of p after the step]."""
    g = p.grad
    p = _stats.local(p)
    dev = p.device
    f64 = torch.float64
    if g is None:
        return torch.zeros(10, dtype=f64, device=dev)
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
    scaled = (a * float(scale)).float()
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


def _extremes(gs, ps):
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


def _device_param_vectors(gs, ps, scale):
    """The `param_vector` figures of f32/f64 gradients `gs` (flat) and their parameters
    `ps` on one device, by multi-tensor norms of them all (five kernels' worth of launches,
    not a dozen a parameter) and, where the smallest |g| may flush, two counts a gradient;
    read back twice. None for one whose figures are not all finite: `param_vector` takes
    it."""
    inf = float("inf")
    # In f64: counts exact past 2^24, Σg² neither overflowing nor vanishing.
    rows = torch.stack(
        [torch.stack(list(torch._foreach_norm(x, o, dtype=torch.float64))) for x, o in
         ((gs, 2), (gs, inf), (gs, 0), (gs, -inf), (ps, inf))]
    ).tolist()
    b = _stats.F16_UNDERFLOW
    exact_scaled = math.frexp(scale)[0] == 0.5 and scale <= 2.0**100
    counts, out = [], [None] * len(gs)
    for j, (l2, amax, nnz, amin, pmax) in enumerate(zip(*rows)):
        if not all(v - v == 0.0 for v in (l2, amax, pmax)):
            continue
        # (a NaN in p makes its max-abs norm NaN: none here)
        out[j] = [1.0, l2**2, amax, float(gs[j].numel() - nnz), 0.0, 0.0, nnz, 0.0, pmax, 0.0]
        if nnz and amin <= b * max(1.0, 2.0 / scale):
            g = gs[j]
            if g.dtype == torch.float32 and exact_scaled:
                scaled = torch.nn.functional.softshrink(g, b / scale).count_nonzero()
            else:
                a = g.abs().mul_(scale).float()
                scaled = (a > b).sum()
            counts.append((j, torch.nn.functional.softshrink(g, b).count_nonzero(), scaled))
    if counts:
        read = torch.stack([torch.stack([c, d]) for _, c, d in counts]).tolist()
        for (j, _, _), (above, above_scaled) in zip(counts, read):
            # Nonzero values at most the bound: all of them, less those beyond it.
            out[j][4] = out[j][6] - above
            out[j][5] = out[j][6] - above_scaled
    return out


def param_vectors(params, scale, scratch=None):
    """`param_vector` of every parameter. Those on the CPU with f32 or f64 gradients take
    a few reductions without temporaries of their size (for small ones, multi-tensor norms
    of them all at once), the flush counts read only where the smallest |g| may be small
    enough to be flushed; those on a device, multi-tensor norms of them all
    (`_device_param_vectors`); one whose figures are not all finite, and every other one,
    goes through `param_vector`. The figures are the same; Σg² accumulates in f32 by
    torch's cascade summation (relative error far below 1e-6), of g·2^k where squares would
    vanish or overflow."""
    scratch = scratch or Scratch()
    out = [None] * len(params)
    # Each process's own shard of a distributed parameter.
    given = params
    grads = [None if p.grad is None else _stats.local(p.grad) for p in params]
    params = [_stats.local(p) for p in params]
    usable = [
        i
        for i, p in enumerate(params)
        if grads[i] is not None
        and grads[i].dtype in (torch.float32, torch.float64)
        and grads[i].layout == torch.strided
        and p.numel()
        and grads[i].numel() == p.numel()
        and grads[i].device == p.device
    ]
    scale = float(scale)
    fast = [i for i in usable if params[i].device.type == "cpu"]
    by_device = {}
    for i in usable:
        if params[i].device.type != "cpu" or _stats.DEVICE_PATH_ON_CPU:
            by_device.setdefault(params[i].device, []).append(i)
    if 0.0 < scale < float("inf"):
        for idx in by_device.values():
            vs = _device_param_vectors([grads[i].detach().reshape(-1) for i in idx],
                                       [params[i].detach().reshape(-1) for i in idx], scale)
            for i, v in zip(idx, vs):
                out[i] = v
        if _stats.DEVICE_PATH_ON_CPU:
            fast = []
    if fast and 0.0 < scale < float("inf"):
        gs = [grads[i].detach().reshape(-1) for i in fast]
        ps = [params[i].detach().reshape(-1) for i in fast]
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
            # tells at once whether it has any; a large one is counted.
            if nnz is None or (nnz and amin <= bound):
                if nnz is None:
                    nnz = torch.count_nonzero(gs[j])
                zeros = n - int(nnz)
                g = gs[j]
                small = scratch.count_abs_le(g, _stats.F16_UNDERFLOW) - zeros
                if g.dtype == torch.float32 and math.frexp(scale)[0] == 0.5 and scale <= 2.0**100:
                    # |g|·2^k ≤ B exactly when |g| ≤ B·2^-k for f32 values and a normal
                    # B·2^-k (a product that rounds is far from B): no scaled copy, and
                    # none to count from a scale of 1 up when nothing flushes unscaled.
                    if scale == 1.0 or (scale > 1.0 and small == 0):
                        small_scaled = small if scale == 1.0 else 0
                    else:
                        small_scaled = scratch.count_abs_le(g, _stats.F16_UNDERFLOW / scale) - zeros
                else:
                    a = scratch.abs_of(g)
                    scaled = torch.mul(a, scale, out=a).float()
                    small_scaled = scratch.count_le(scaled, _stats.F16_UNDERFLOW) - zeros
            nonzero = n if nnz is None else int(nnz)
            out[fast[j]] = [1.0, l2**2, amax, float(n - nonzero), float(small), float(small_scaled),
                            float(nonzero), 0.0, pmax, 0.0]
    for i, p in enumerate(given):
        if out[i] is None:
            out[i] = param_vector(p, scale)
    return out
