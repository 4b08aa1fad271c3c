"""The host's statistics, from the values' bits: a CPU tensor's full statistics (amprobe's
TensorStats) counted over the integer view of its values in a few passes, with scratch
buffers reused from op to op."""

from __future__ import annotations

import sys
from typing import Callable, List, Tuple

import torch

from ._layout import BF16_OVERFLOW, BF16_UNDERFLOW, EXP_HI, EXP_LO, F16_OVERFLOW, F16_UNDERFLOW, FIELDS, N_BINS


# Each dtype's bits: (integer dtype of the same width, mantissa bits, exponent field's
# largest value (Inf and NaN), exponent bias).
_LAYOUT = {
    torch.float16: (torch.int16, 10, 0x1F, 15),
    torch.bfloat16: (torch.int16, 7, 0xFF, 127),
    torch.float32: (torch.int32, 23, 0xFF, 127),
    torch.float64: (torch.int64, 52, 0x7FF, 1023),
}
_SIGN_CLEARED = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}
_BOUNDS = {}


def _bounds(dt):
    """Bit patterns (sign cleared) in dtype `dt` of: +inf, the smallest value at least
    65520, at least BF16_OVERFLOW (None when `dt` holds none below inf), the largest
    nonzero value at most 2^-25, at most 2^-134 (None when `dt` holds none above zero)."""
    b = _BOUNDS.get(dt)
    if b is None:
        ib = _LAYOUT[dt][0]

        def bits(v):
            return int(torch.tensor([v], dtype=torch.float64).to(dt).view(ib)[0]) & _SIGN_CLEARED[ib]

        inf = bits(float("inf"))

        def at_least(v):
            x = bits(v)
            x = x + 1 if torch.tensor([x], dtype=ib).view(dt).double()[0] < v else x
            return x if x < inf else None

        def at_most(v):
            x = bits(v)
            x = x - 1 if torch.tensor([x], dtype=ib).view(dt).double()[0] > v else x
            return x if x > 0 else None

        b = (inf, at_least(F16_OVERFLOW), at_least(BF16_OVERFLOW), at_most(F16_UNDERFLOW), at_most(BF16_UNDERFLOW))
        _BOUNDS[dt] = b
    return b


def _count(mask: torch.Tensor) -> int:
    return int(torch.count_nonzero(mask))


def _full_bits(t: torch.Tensor) -> Tuple[float, ...]:
    """`full` on the CPU for any floating dtype (the f64 path; fp16, bf16 and f32 have
    faster ones below), where a count can decide what to compute next without a device
    synchronisation: the exponent histogram from the exponent field of the values' bits
    (one integer pass and one bincount), and the rarer figures (non-finite values,
    subnormals, values that round to inf or zero in fp16 or bf16) read only when the
    histogram says some are there. The same figures as the general path; Σx² accumulates
    in f32 (torch's cascade summation, relative error far below 1e-6) unless a square could
    overflow or vanish there."""
    dt = t.dtype
    x = t.detach().reshape(-1)
    n = x.numel()
    f64 = torch.float64
    out = [0.0] * len(FIELDS)
    out[0] = float(n)
    if n == 0:
        out[7] = float("inf")
        return tuple(out + torch.zeros(N_BINS, dtype=f64).tolist())
    ib, mant, emax, bias = _LAYOUT[dt]
    bits = x.view(ib)
    field = torch.bitwise_right_shift(bits, mant).bitwise_and_(emax)
    h = torch.bincount(field, minlength=emax + 1).tolist()
    special, low = h[emax], h[0]
    ab = None

    def abs_bits():
        nonlocal ab
        if ab is None:
            ab = bits.bitwise_and(_SIGN_CLEARED[ib])
        return ab

    nan = pos_inf = neg_inf = 0
    if special:
        nan = _count(x.isnan())
        pos_inf = _count(x == float("inf"))
        neg_inf = special - nan - pos_inf
    zeros = subnormal = 0
    if low:
        zeros = n - _count(x)  # count_nonzero counts NaN as nonzero, and NaN is not in field 0
        subnormal = low - zeros
    max_abs, min_abs = _bits_extremes(x, abs_bits, n - special, special, zeros)
    sum_sq = _sum_sq(x, special, max_abs, f64 if dt == f64 else torch.float32)
    rounding = _bits_rounding(dt, h, subnormal, abs_bits)
    hist = _bits_hist(dt, h, subnormal, field, abs_bits)
    out[1:] = [nan, pos_inf, neg_inf, zeros, subnormal, max_abs, min_abs, sum_sq, *rounding]
    return tuple([float(v) for v in out] + hist.tolist())


def _bits_extremes(
    x: torch.Tensor, abs_bits: Callable[[], torch.Tensor], finite: int, special: int, zeros: int
) -> Tuple[float, float]:
    """max |x| and min nonzero |x| over the `finite` finite values of flat `x` (`special`
    of its values inf or NaN, `zeros` zero), from the magnitudes' bits `abs_bits()`."""
    dt = x.dtype
    ib = _LAYOUT[dt][0]
    inf_bits = _bounds(dt)[0]
    if not finite:
        return 0.0, float("inf")
    # Extremes of the finite values from their bits (ordered as the magnitudes are).
    if special:
        fin_bits = abs_bits().masked_fill(abs_bits() >= inf_bits, 0)
        hi_bits = int(fin_bits.max())
        max_abs = float(torch.tensor([hi_bits], dtype=ib).view(dt).double()[0])
    else:
        lo, hi = torch.aminmax(x)
        max_abs = max(-float(lo), float(hi))
    if finite > zeros:
        # min over nonzero finite magnitudes: zero's bits become the largest by a
        # wrap-around subtraction, non-finite ones are past every finite one.
        m = abs_bits().sub(1).bitwise_and_(_SIGN_CLEARED[ib])
        lo_bits = int(m.min()) + 1
        min_abs = float(torch.tensor([lo_bits], dtype=ib).view(dt).double()[0])
    else:
        min_abs = float("inf")
    return max_abs, min_abs


def _sum_sq(x: torch.Tensor, special: int, max_abs: float, acc: torch.dtype) -> float:
    """Σx² over the finite values of `x` (`special` of them inf or NaN): a norm accumulated
    in `acc` where max |x| keeps every square from overflowing or vanishing there, else
    squares in f64."""
    if max_abs == 0.0 or 2.0**-60 <= max_abs <= 2.0**60:
        y = x if not special else x.masked_fill(~x.isfinite(), 0.0)
        return float(torch.linalg.vector_norm(y, dtype=acc)) ** 2 if max_abs else 0.0
    y = x.double()
    y = y if not special else y.masked_fill(~y.isfinite(), 0.0)
    return float((y * y).sum())


def _bits_rounding(
    dt: torch.dtype, h: List[int], subnormal: int, abs_bits: Callable[[], torch.Tensor]
) -> Tuple[int, int, int, int]:
    """(fp16 overflows, fp16 underflows, bf16 overflows, bf16 underflows) of values of dtype
    `dt` whose exponent fields' counts are `h`, `subnormal` of them subnormal."""
    _, mant, emax, _ = _LAYOUT[dt]
    inf_bits, over16, over_bf, under16, under_bf = _bounds(dt)
    # Values that rounding to fp16 or bf16 sends to inf (finite, at least the bound) or to
    # zero (nonzero, at most the bound): counted only where the histogram has any that
    # high or that low.
    top = max((i for i, c in enumerate(h[:emax]) if c), default=0)
    bottom = min((i for i, c in enumerate(h[1:emax], start=1) if c), default=emax)
    if subnormal:
        bottom = 0

    def count_between(lo_bits, hi_bits):
        a = abs_bits()
        return _count((a >= lo_bits) & (a <= hi_bits))

    f16_over = bf16_over = f16_under = bf16_under = 0
    if over16 is not None and top >= over16 >> mant:
        f16_over = count_between(over16, inf_bits - 1)
    if over_bf is not None and top >= over_bf >> mant:
        bf16_over = count_between(over_bf, inf_bits - 1)
    if under16 is not None and bottom <= under16 >> mant:
        f16_under = count_between(1, under16)
    if under_bf is not None and bottom <= under_bf >> mant:
        bf16_under = count_between(1, under_bf)
    return f16_over, f16_under, bf16_over, bf16_under


def _bits_hist(
    dt: torch.dtype, h: List[int], subnormal: int, field: torch.Tensor, abs_bits: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The exponent histogram (N_BINS float64 counts) of values of dtype `dt` whose exponent
    fields are `field`, counted in `h`, `subnormal` of them subnormal."""
    f64 = torch.float64
    _, mant, emax, bias = _LAYOUT[dt]
    hist = torch.zeros(N_BINS, dtype=f64)
    # The histogram: normal values' binades from their exponent field; subnormals' from
    # their leading mantissa bit.
    exps = torch.arange(emax + 1) - bias
    counts = torch.tensor(h, dtype=f64)
    idx = exps.clamp(EXP_LO, EXP_HI - 1) - EXP_LO
    hist.index_add_(0, idx[1:emax], counts[1:emax])
    if subnormal:
        sub = abs_bits()[(field == 0) & (abs_bits() != 0)]
        _, e = torch.frexp(sub.to(f64))
        sub_exp = (e.to(torch.int64) - 1) + (1 - bias - mant)
        sub_idx = sub_exp.clamp(EXP_LO, EXP_HI - 1) - EXP_LO
        hist.index_add_(0, sub_idx, torch.ones(sub_idx.numel(), dtype=f64))
    return hist


# Scratch buffers of the CPU paths, reused from op to op (a fresh tensor of tens of MB
# costs its page faults on every op): per dtype (and use), the size of the largest tensor
# seen; 6 bytes an element of it in all, and 8 MB more (`_full_f32`'s keys below
# _WIDE_KEYS_BELOW values).
_SCRATCH = {}


def _scratch(dtype, n, which=0):
    buf = _SCRATCH.get((dtype, which))
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        _SCRATCH[(dtype, which)] = buf
    return buf[:n]


def release_scratch() -> None:
    """Frees the scratch buffers (before a step that keeps no records)."""
    _SCRATCH.clear()


_PATTERNS = {}


def _patterns(dt):
    """Per 16-bit magnitude pattern (sign bit clear) of `dt` (fp16 or bf16): its value as
    a float64 (inf and NaN patterns included), its square (0 for inf and NaN), and its
    exponent histogram bin (N_BINS for zero, inf and NaN)."""
    p = _PATTERNS.get(dt)
    if p is None:
        v = torch.arange(32768, dtype=torch.int32).to(torch.int16).view(dt).double()
        fin = v.isfinite() & (v != 0)
        sq = torch.where(v.isfinite(), v * v, torch.zeros((), dtype=torch.float64))
        _, e = torch.frexp(torch.where(fin, v, torch.ones((), dtype=torch.float64)))
        bins = torch.where(fin, (e.to(torch.int64) - 1).clamp(EXP_LO, EXP_HI - 1) - EXP_LO, N_BINS)
        p = (v.tolist(), sq, bins)
        _PATTERNS[dt] = p
    return p


def _field_hist(fields, bias, h, dt, mant):
    """The exponent histogram (a list of N_BINS counts) of the values of a 16-bit pattern
    histogram `h` (fp16 or bf16 layout) whose finite exponent fields hold `fields`:
    normal values by field, subnormals by their own pattern."""
    hist = [0] * N_BINS
    for f in range(1, len(fields)):
        c = fields[f]
        if c:
            hist[min(max(f - bias, EXP_LO), EXP_HI - 1) - EXP_LO] += c
    if fields[0] - h[0] > 0:
        _, _, bins = _patterns(dt)
        top = 1 << mant
        sub = torch.bincount(bins[1:top], weights=h[1:top].double(), minlength=N_BINS + 1)
        for i, c in enumerate(sub[:N_BINS].tolist()):
            if c:
                hist[i] += int(c)
    return hist


def _flat(x):
    """`x`'s elements as a 1-D contiguous view in memory order where they fill their span of
    storage without gaps or overlaps (contiguous, transposed or permuted: no figure here
    depends on the order, and a pass in memory order reads each cache line once), else `x`
    as it is (a strided slice, a broadcast: read through its strides, never copied)."""
    if x.is_contiguous():
        return x.view(-1)
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != span:
            return x
        span *= size
    return x.as_strided((x.numel(),), (1,))


def full_host(t: torch.Tensor) -> Tuple[float, ...]:
    """`full` on the CPU, where a count can decide what to compute next without a device
    synchronisation. fp16 and bf16: one pass clears the sign bits and one bincount counts
    each of the 32768 magnitudes, which is every figure (Σx² exactly, in f64); only ±inf's
    sign takes a pass, when there are any. f32: the same bincount of each value's top 16
    bits gives the exponent histogram and says which rarer figures need a pass of their own
    (non-finite values, subnormals, values near fp16's or bf16's limits); the extremes come
    from the bits and Σx² from a norm in f32 (torch's cascade summation, relative error far
    below 1e-6) unless a square could overflow or vanish there. f64: `_full_bits`."""
    dt = t.dtype
    x = t.detach()
    if x.numel() == 0 or sys.byteorder != "little" or dt == torch.float64 or x.dim() == 0:
        return _full_bits(x)
    if dt == torch.float32:
        return _full_f32(_flat(x))
    return _full_16(_flat(x))


def _full_16(x: torch.Tensor) -> Tuple[float, ...]:
    dt = x.dtype
    n = x.numel()
    _, mant, emax, bias = _LAYOUT[dt]
    inf_bits, over16, over_bf, under16, under_bf = _bounds(dt)
    ab = _scratch(torch.int16, n)
    torch.bitwise_and(x.view(torch.int16), 0x7FFF, out=ab.view(x.shape))
    h = torch.bincount(ab, minlength=32768)
    fields = h[:inf_bits].view(emax, 1 << mant).sum(1).tolist()
    finite = sum(fields)
    special = n - finite
    zeros = int(h[0])
    nan = pos_inf = neg_inf = 0
    if special:
        infs = int(h[inf_bits])
        nan = special - infs
        if infs:
            pos_inf = _count(x == float("inf"))
            neg_inf = infs - pos_inf
    vals, sq, _ = _patterns(dt)
    max_abs, min_abs = 0.0, float("inf")
    if finite > zeros:
        hi_f = max(f for f, c in enumerate(fields) if c)
        lo_f = min(f for f, c in enumerate(fields) if c and (f or c > zeros))
        s = hi_f << mant
        hi_p = s + int(h[s : s + (1 << mant)].nonzero()[-1])
        s = max(lo_f << mant, 1)
        lo_p = s + int(h[s : (lo_f + 1) << mant].nonzero()[0])
        max_abs, min_abs = vals[hi_p], vals[lo_p]
    sum_sq = float(torch.dot(h[:inf_bits].double(), sq[:inf_bits]))
    f16_over = int(h[over16:inf_bits].sum()) if over16 is not None and max_abs >= vals[over16] else 0
    bf16_over = int(h[over_bf:inf_bits].sum()) if over_bf is not None and max_abs >= vals[over_bf] else 0
    f16_under = int(h[1 : under16 + 1].sum()) if under16 is not None and min_abs <= vals[under16] else 0
    bf16_under = int(h[1 : under_bf + 1].sum()) if under_bf is not None and min_abs <= vals[under_bf] else 0
    hist = _field_hist(fields, bias, h, dt, mant)
    out = [float(n), nan, pos_inf, neg_inf, zeros, fields[0] - zeros, max_abs, min_abs, sum_sq, f16_over, f16_under,
           bf16_over, bf16_under]
    return tuple([float(v) for v in out] + [float(c) for c in hist])


_WIDE_KEYS_BELOW = 1 << 21


def _full_f32(x: torch.Tensor) -> Tuple[float, ...]:
    n = x.numel()
    inf_bits = _bounds(torch.float32)[0]
    ab, top, keys = _f32_keys(x)
    h = torch.bincount(keys, minlength=32768)
    tb = inf_bits >> 16
    fields = h[:tb].view(255, 128).sum(1).tolist()
    finite = sum(fields)
    special = n - finite
    nan = pos_inf = neg_inf = 0
    if special:
        nan = _count(x.isnan())
        pos_inf = _count(x == float("inf"))
        neg_inf = special - nan - pos_inf
    h0 = int(h[0])
    # (count_nonzero of the integers: of the floats it is many times slower)
    zeros = n - int(torch.count_nonzero(ab)) if h0 else 0
    tiny = h0 - zeros  # subnormals below 2^-133: all their bits are in the low half
    rounding = _f32_rounding(h, fields, ab, top, zeros, tiny)
    hist = _field_hist(fields, 127, h, torch.bfloat16, 7)
    max_abs, min_abs = _f32_extremes(x, ab, hist, finite > zeros, special, zeros, tiny)
    sum_sq = _sum_sq(x, special, max_abs, torch.float32)
    out = [float(n), nan, pos_inf, neg_inf, zeros, fields[0] - zeros, max_abs, min_abs, sum_sq, *rounding]
    return tuple([float(v) for v in out] + [float(c) for c in hist])


def _f32_keys(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The magnitudes' bits of f32 `x` (a scratch buffer), the top bits' scratch buffer,
    and the keys to count (each value's top 16 bits, sign cleared)."""
    n = x.numel()
    # The magnitudes' bits, and their top 16 bits, which are bf16's layout (the same
    # exponent field, 7 of the 23 mantissa bits), counted: below a few million values as
    # the 32-bit magnitudes shifted (a contiguous pass, 3 to 5 times faster here than
    # taking the upper halves out, which is a strided one), above as the upper halves of
    # the values with the sign cleared, where bincount's own time over 32-bit keys grows
    # past what the shift saves.
    # (A tensor whose elements leave gaps in their storage is read through its strides and
    # its upper halves copied out of the magnitudes' bits.)
    ab = _scratch(torch.int32, n)
    torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=ab.view(x.shape))
    top = _scratch(torch.int16, n)
    if n < _WIDE_KEYS_BELOW:
        keys = torch.bitwise_right_shift(ab, 16, out=_scratch(torch.int32, n, 1))
    elif x.is_contiguous():
        keys = torch.bitwise_and(x.view(torch.int16)[1::2], 0x7FFF, out=top)
    else:
        keys = top.copy_(ab.view(torch.int16)[1::2])
    return ab, top, keys


def _f32_rounding(
    h: torch.Tensor, fields: List[int], ab: torch.Tensor, top: torch.Tensor, zeros: int, tiny: int
) -> Tuple[int, int, int, int]:
    """(fp16 overflows, fp16 underflows, bf16 overflows, bf16 underflows) of f32 values whose
    magnitudes' bits are `ab` and top-16-bit counts `h` (exponent fields' counts `fields`;
    `zeros` zeros and `tiny` subnormals below 2^-133 in `h[0]`); `top` is scratch."""
    n = ab.numel()
    inf_bits, over16, over_bf, under16, under_bf = _bounds(torch.float32)
    tb = inf_bits >> 16

    def count_between(lo_bits, hi_bits):
        # (flags in the top bits' buffer, free once counted)
        flags, other = top.view(torch.bool).split(n)
        if lo_bits == hi_bits:
            return _count(torch.eq(ab, lo_bits, out=flags))
        torch.ge(ab, lo_bits, out=flags)
        return _count(flags.logical_and_(torch.le(ab, hi_bits, out=other)))

    def at_least(p):
        """Finite values whose magnitude bits are at least `p`: whole top-16 bins from
        the histogram, the one `p` falls inside by a pass when it holds any."""
        b = p >> 16
        full_from = b + 1 if p & 0xFFFF else b
        c = int(h[full_from:tb].sum())
        if p & 0xFFFF and h[b]:
            c += count_between(p, (b << 16) | 0xFFFF)
        return c

    def at_most(p):
        """Nonzero values whose magnitude bits are at most `p`, the same way."""
        b = p >> 16
        c = int(h[1:b].sum()) + (tiny if b > 0 else 0)
        if (p & 0xFFFF) == 0xFFFF:
            c += int(h[b]) - (zeros if b == 0 else 0)
        elif h[b]:
            # (a threshold at a bin's start, like 2^-25's, is one value of that bin)
            c += count_between(max(b << 16, 1) if p & 0xFFFF else p, p)
        return c

    top_b = max((b for b, c in enumerate(fields) if c), default=-1)
    f16_over = at_least(over16) if over16 is not None and top_b >= over16 >> 23 else 0
    bf16_over = at_least(over_bf) if over_bf is not None and top_b >= over_bf >> 23 else 0
    low_f = min((f for f, c in enumerate(fields) if c and (f or c > zeros)), default=255)
    f16_under = at_most(under16) if under16 is not None and low_f <= under16 >> 23 else 0
    bf16_under = at_most(under_bf) if under_bf is not None and low_f <= under_bf >> 23 else 0
    return f16_over, f16_under, bf16_over, bf16_under


def _f32_extremes(
    x: torch.Tensor, ab: torch.Tensor, hist: List[int], any_nonzero: bool, special: int, zeros: int, tiny: int
) -> Tuple[float, float]:
    """max |x| and min nonzero |x| over the finite values of f32 `x` from their magnitudes'
    bits `ab` (a scratch buffer, overwritten), and the binades of the `tiny` subnormals
    below 2^-133 added to `hist`."""
    if not any_nonzero:
        return 0.0, float("inf")
    inf_bits = _bounds(torch.float32)[0]
    # The extremes from the magnitude bits (ordered as the magnitudes are); the buffer is
    # overwritten from here on.
    if special:
        ab.masked_fill_(ab >= inf_bits, 0)
    lo_bits, hi_bits = (int(v) for v in torch.aminmax(ab))
    if zeros or special or tiny:
        # Zero's bits become the largest by a wrap-around subtraction, and a subnormal
        # below 2^-133 with bits v becomes v - 1 < 0xFFFF, everything else at least that.
        ab.sub_(1).bitwise_and_(0x7FFFFFFF)
        lo_bits = int(ab.min()) + 1
    max_abs, min_abs = (float(torch.tensor([b], dtype=torch.int32).view(torch.float32)[0]) for b in (hi_bits, lo_bits))
    if tiny:
        # Their binades: times 2^100 they are normal (exactly) and their exponent field
        # says; every value from 2^-133 up lands past them.
        e = torch.mul(x, 2.0**100, out=ab.view(torch.float32).view(x.shape)).view(torch.int32)
        c = torch.bincount(e.view(-1).bitwise_right_shift_(23).bitwise_and_(0xFF), minlength=256).tolist()
        for f in range(1, 127 - 33):
            if c[f]:
                hist[min(max(f - 227, EXP_LO), EXP_HI - 1) - EXP_LO] += c[f]
    return max_abs, min_abs
