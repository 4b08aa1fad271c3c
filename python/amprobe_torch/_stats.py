"""Statistics of one tensor, computed on its own device into a small float64 vector that
stays there until the step's one read back (no host synchronisation per op).

Two kinds: the full statistics of amprobe's TensorStats (kept steps), and the check
(NaN, +inf and -inf counts only) of every other step."""

import sys
from array import array

import torch

from ._trace import jfloat

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed tensors
    DTensor = None


# The tests set it to run the device paths on the CPU: every figure gathered on the
# tensor's device and read back with the step, as on a GPU.
DEVICE_PATH_ON_CPU = False


def on_host(x):
    """Whether `x` takes the host paths: on the CPU, where reading a value back costs no
    synchronisation (unless the tests ask for the device paths there)."""
    return x.device.type == "cpu" and not DEVICE_PATH_ON_CPU


def local(t):
    """The values this process holds of `t`: its shard when it is a distributed tensor
    (FSDP2's parameters), else `t` itself."""
    return t._local_tensor if DTensor is not None and isinstance(t, DTensor) else t

# Exponent histogram bins: floor(log2 |x|) from EXP_LO to EXP_HI - 1. fp32's subnormals
# reach 2^-149 and its largest values 2^127; f64 values outside are counted in the end bins.
EXP_LO, EXP_HI = -150, 128
N_BINS = EXP_HI - EXP_LO

# Layout of a full vector: these fields, then N_BINS histogram counts.
FIELDS = (
    "numel",
    "nan",
    "pos_inf",
    "neg_inf",
    "zeros",
    "subnormal",
    "max_abs",
    "min_abs_nonzero",
    "sum_sq",
    "f16_over",
    "f16_under",
    "bf16_over",
    "bf16_under",
)
FULL_LEN = len(FIELDS) + N_BINS
CHECK_LEN = 4

# The smallest normal magnitude of each dtype: nonzero values below it are subnormal.
_NORMAL_MIN = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
}
F16_OVERFLOW = 65520.0
F16_UNDERFLOW = 2.0**-25
BF16_OVERFLOW = (2.0 - 2.0**-8) * 2.0**127
BF16_UNDERFLOW = 2.0**-134

DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
}


FLOATING = frozenset(_NORMAL_MIN)

# The largest finite value of each dtype: a conversion to a dtype that reaches as far as
# the source cannot overflow.
RANGE = {
    torch.float16: 65504.0,
    torch.bfloat16: BF16_OVERFLOW,
    torch.float32: 3.4028234663852886e38,
    torch.float64: 1.7976931348623157e308,
}

# Ops that draw random values: data, like the batch (a script that makes its batch with
# them inside the step), never constants of the model.
RANDOM = frozenset(
    """
    rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_
    bernoulli bernoulli_ multinomial exponential_ geometric_ log_normal_ cauchy_ random_
    """.split()
)

# Ops that only allocate: their output holds whatever the memory held.
ALLOCATING = frozenset("empty empty_like empty_strided new_empty new_empty_strided".split())

# Ops whose floating outputs are finite whenever their floating inputs and scalars are
# finite and the output's dtype reaches as far as every input's: they move, select,
# compare, clamp or normalise values, or convert them to a dtype at least as wide; none
# multiplies, adds or divides values of its own. (Not as_strided: it may read storage
# outside its input's view.)
FINITE_PRESERVING = frozenset(
    """
    _to_copy copy_ clone contiguous expand view _unsafe_view reshape t transpose permute
    squeeze unsqueeze slice select split split_with_sizes chunk unbind alias
    detach cat stack index_select gather embedding index where masked_fill fill fill_
    zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full
    relu threshold_backward clamp clamp_min clamp_max maximum minimum max min amax amin
    abs neg sign softmax _softmax _safe_softmax
    """.split()
)


# Ops whose output holds exactly its one input's values, in the same order or not (with the
# output's dtype, equal numel, and the input's dtype the same or bf16 to f32): the output's
# statistics are the input's.
VALUE_COPIES = frozenset(
    """
    _to_copy clone contiguous alias detach view _unsafe_view reshape t transpose permute squeeze
    unsqueeze flatten _reshape_alias
    """.split()
)


def observed(t):
    """True for the tensors a record describes (amprobe's dtypes)."""
    return isinstance(t, torch.Tensor) and t.dtype in DTYPE_NAMES and t.layout == torch.strided


def stored_values(t):
    """The values a tensor stores: the tensor itself when it is strided; a sparse one's
    stored values (a COO tensor's coalesced, duplicate entries summed), every other element
    of it being zero."""
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    return t.values()


def floating(t):
    return isinstance(t, torch.Tensor) and t.dtype in _NORMAL_MIN and t.layout == torch.strided


class DeviceCheck(tuple):
    """A check of a tensor on a device: (numel, NaN count, +inf count, -inf count), the
    three counts 0-d tensors left on the device until the step's one read back."""

    __slots__ = ()


def check(t):
    """[numel, NaN, +inf, -inf] of a floating tensor: on the CPU, where reading a value back
    costs no synchronisation, a host list; on a device, a `DeviceCheck`.

    On the CPU one reduction decides first: a finite sum (or, for fp16, finite extremes)
    means no NaN and no infinity (any of them makes the sum NaN or infinite, and the
    extremes NaN or infinite), so the three counts are zero without counting; otherwise
    (or when a sum merely overflowed) they are counted."""
    # No reshape: flattening a transposed tensor would copy it.
    x = local(t).detach()
    if on_host(x):
        if x.dtype == torch.float16:
            # An fp16 sum would overflow at 65504, and one in f32 takes this CPU twenty
            # times as long as the extremes do.
            if not x.numel():
                return [0.0, 0.0, 0.0, 0.0]
            lo, hi = torch.aminmax(x)
            s = float(lo) + float(hi)
        else:
            # bf16, f32 and f64 sum in their own dtype (bf16 accumulates in f32 and
            # reaches as far).
            s = float(x.sum())
        if s - s == 0.0:
            return [float(x.numel()), 0.0, 0.0, 0.0]
        return [
            float(x.numel()),
            float(x.isnan().sum()),
            float(x.isposinf().sum()),
            float(x.isneginf().sum()),
        ]
    return device_check(x)


def device_check(x):
    """`check` as a device computes it: six kernels (three tests, three sums), no
    synchronisation and no transfer; the element count is the host's. (Any tensor's device
    may run it: the tests run it on the CPU.)"""
    return DeviceCheck((x.numel(), x.isnan().sum(), x.isposinf().sum(), x.isneginf().sum()))


def gather(vecs):
    """Host lists of statistics vectors (full vectors, checks, parameters' vectors, and any
    tensor, as the list of its values): those on the host as they are (lists, or a host's
    full vectors' tuples), the rest read back in one transfer per device (each device
    synchronises once)."""
    out = list(vecs)
    parts = {}
    for i, v in enumerate(vecs):
        if isinstance(v, DeviceCheck):
            out[i] = [float(v[0]), 0.0, 0.0, 0.0]
            for j, c in enumerate(v[1:], 1):
                parts.setdefault(c.device, []).append((i, j, c))
        elif isinstance(v, torch.Tensor):
            parts.setdefault(v.device, []).append((i, None, v))
    with torch.no_grad():
        for items in parts.values():
            # Gathered by dtype (one stack of the single values and one concatenation of
            # the rest each), then in float64 (the figures are float64 already, the counts
            # integers below 2^53): a few kernels, however many the items.
            by_dtype = {}
            for item in items:
                by_dtype.setdefault((item[2].dtype, item[2].dim() == 0), []).append(item)
            order, pieces = [], []
            for (_, single), group in by_dtype.items():
                ts = [v for _, _, v in group]
                pieces.append((torch.stack(ts) if single else torch.cat([t.reshape(-1) for t in ts])).to(torch.float64))
                order.extend(group)
            flat = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).cpu().tolist()
            k = 0
            for i, j, v in order:
                n = v.numel()
                if j is None:
                    out[i] = flat[k : k + n]
                else:
                    out[i][j] = flat[k]
                k += n
    return out


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


def _count(mask):
    return int(torch.count_nonzero(mask))


def _full_bits(t):
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
    hist = torch.zeros(N_BINS, dtype=f64)
    if n == 0:
        out[7] = float("inf")
        return tuple(out + hist.tolist())
    ib, mant, emax, bias = _LAYOUT[dt]
    inf_bits, over16, over_bf, under16, under_bf = _bounds(dt)
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
    finite = n - special
    # Extremes of the finite values from their bits (ordered as the magnitudes are).
    if finite:
        if special:
            fin_bits = abs_bits().masked_fill(abs_bits() >= inf_bits, 0)
            hi_bits = int(fin_bits.max())
        else:
            lo, hi = torch.aminmax(x)
            hi_bits = None
            max_abs = max(-float(lo), float(hi))
        if hi_bits is not None:
            max_abs = float(torch.tensor([hi_bits], dtype=ib).view(dt).double()[0])
        if finite > zeros:
            # min over nonzero finite magnitudes: zero's bits become the largest by a
            # wrap-around subtraction, non-finite ones are past every finite one.
            m = abs_bits().sub(1).bitwise_and_(_SIGN_CLEARED[ib])
            lo_bits = int(m.min()) + 1
            min_abs = float(torch.tensor([lo_bits], dtype=ib).view(dt).double()[0])
        else:
            min_abs = float("inf")
    else:
        max_abs, min_abs = 0.0, float("inf")
    if max_abs == 0.0 or 2.0**-60 <= max_abs <= 2.0**60:
        y = x if not special else x.masked_fill(~x.isfinite(), 0.0)
        acc = f64 if dt == f64 else torch.float32
        sum_sq = float(torch.linalg.vector_norm(y, dtype=acc)) ** 2 if max_abs else 0.0
    else:
        y = x.double()
        y = y if not special else y.masked_fill(~y.isfinite(), 0.0)
        sum_sq = float((y * y).sum())
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
    out[1:] = [nan, pos_inf, neg_inf, zeros, subnormal, max_abs, min_abs, sum_sq, f16_over, f16_under, bf16_over,
               bf16_under]
    return tuple([float(v) for v in out] + hist.tolist())


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


def release_scratch():
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


def _full_host(t):
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


def _full_16(x):
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


def _full_f32(x):
    n = x.numel()
    inf_bits, over16, over_bf, under16, under_bf = _bounds(torch.float32)
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
    hist = _field_hist(fields, 127, h, torch.bfloat16, 7)
    # The extremes from the magnitude bits (ordered as the magnitudes are); the buffer is
    # overwritten from here on.
    max_abs, min_abs = 0.0, float("inf")
    if finite > zeros:
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
    if max_abs == 0.0 or 2.0**-60 <= max_abs <= 2.0**60:
        y = x if not special else x.masked_fill(~x.isfinite(), 0.0)
        sum_sq = float(torch.linalg.vector_norm(y, dtype=torch.float32)) ** 2 if max_abs else 0.0
    else:
        y = x.double()
        y = y if not special else y.masked_fill(~y.isfinite(), 0.0)
        sum_sq = float((y * y).sum())
    out = [float(n), nan, pos_inf, neg_inf, zeros, fields[0] - zeros, max_abs, min_abs, sum_sq, f16_over, f16_under,
           bf16_over, bf16_under]
    return tuple([float(v) for v in out] + [float(c) for c in hist])


def full(t):
    """The full statistics of a floating tensor (FIELDS, then the exponent histogram): on
    the CPU a tuple of floats, on a device a float64 vector left there until the step's read
    back; values are read from the tensor's own bits (fp16 and bf16 widen exactly to f32)."""
    t = local(t)
    if on_host(t) and t.numel():
        # fp16, bf16 and f32 take the host paths at every size (a tensor of 10 values: 115
        # to 130 µs against the general path's 150); f64 and 0-d tensors (the loss, the
        # scale) only from a few thousand values, below which the general path's calls
        # cost less than the bit path's.
        if (t.dtype != torch.float64 and t.dim() > 0) or t.numel() >= 4096:
            return _full_host(t)
    return _full_device(t)


def full_many(ts):
    """`full` of a list of tensors taken together (a multi-tensor op's outputs): counts and
    Σx² summed, the largest max |x| and the smallest min |x|; a tuple when every one is,
    else on the first tensor's device, no synchronisation."""
    vs = [full(t) for t in ts]
    if all(type(v) is tuple for v in vs):
        out = [sum(col) for col in zip(*vs)]
        out[6] = max(v[6] for v in vs)
        out[7] = min(v[7] for v in vs)
        return tuple(out)
    dev = local(ts[0]).device
    vs = [torch.tensor(v, dtype=torch.float64, device=dev) if type(v) is tuple else v for v in vs]
    m = torch.stack([v.to(dev) for v in vs])
    out = m.sum(0)
    out[6] = m[:, 6].max()
    out[7] = m[:, 7].min()
    return out


def check_many(ts):
    """`check` of a list of tensors taken together. On the CPU the exact counts, summed. On
    a device, a few multi-tensor kernels for them all (a check a tensor would be three
    kernels each, for every parameter in an optimizer's update): the element count, whether
    any holds a NaN, whether any holds an infinity where none holds a NaN (a NaN hides an
    infinity beside it in a max-abs norm), read as counts of 1; an infinity beside a NaN
    in the same list is not seen, the NaN is."""
    xs = [local(t).detach() for t in ts]
    if all(on_host(x) for x in xs):
        out = [0.0, 0.0, 0.0, 0.0]
        for x in xs:
            out = [a + b for a, b in zip(out, check(x))]
        return out
    by_device = {}
    for x in xs:
        by_device.setdefault(x.device, []).append(x)
    n = sum(x.numel() for x in xs)
    nan = inf = None
    dev = xs[0].device
    for group in by_device.values():
        c = batch_check(group)
        g_nan, g_bad = c[1].to(dev), c[2].to(dev)
        nan = g_nan if nan is None else torch.maximum(nan, g_nan)
        inf = g_bad if inf is None else torch.maximum(inf, g_bad)
    inf = inf * (1.0 - nan)
    return DeviceCheck((n, nan, inf, torch.zeros_like(nan)))


def _full_device(t):
    """`full` with no host synchronisation and no transfer: every figure by its own
    reduction, counts summed straight into float64 (exact below 2^53)."""
    dt = t.dtype
    x = t.detach().reshape(-1)
    if dt in (torch.float16, torch.bfloat16):
        x = x.float()
    dev = x.device
    f64 = torch.float64
    inf = float("inf")
    n = x.numel()
    fin = x.isfinite()
    a = x.abs()
    af = torch.where(fin, a, 0.0)
    nz = fin & (a > 0)
    if n:
        max_abs = af.max().to(f64)
        min_abs = torch.where(nz, a, inf).min().to(f64)
    else:
        max_abs = torch.zeros((), dtype=f64, device=dev)
        min_abs = torch.full((), inf, dtype=f64, device=dev)
    ad = af.to(f64)
    counts = [
        torch.full((), float(n), dtype=f64, device=dev),
        x.isnan().sum(dtype=f64),
        x.isposinf().sum(dtype=f64),
        x.isneginf().sum(dtype=f64),
        (x == 0).sum(dtype=f64),
        (nz & (a < _NORMAL_MIN[dt])).sum(dtype=f64),
        max_abs,
        min_abs,
        (ad * ad).sum(),
        (fin & (a >= F16_OVERFLOW)).sum(dtype=f64),
        (nz & (ad <= F16_UNDERFLOW)).sum(dtype=f64),
        (fin & (ad >= BF16_OVERFLOW)).sum(dtype=f64),
        (nz & (ad <= BF16_UNDERFLOW)).sum(dtype=f64),
    ]
    # floor(log2 |x|) = e - 1 where frexp gives |x| = m·2^e, m in [0.5, 1). Zeros and
    # non-finite values go to one more bin, dropped.
    _, e = torch.frexp(torch.where(nz, a, 1.0))
    bins = torch.where(nz, (e - 1).clamp_(EXP_LO, EXP_HI - 1) - EXP_LO, N_BINS)
    return torch.cat([torch.stack(counts), _bin_counts(bins, N_BINS)])


def _bin_counts(bins, n):
    """How many of the integers `bins` (values 0 to n, n not counted) are each of 0 to n - 1,
    as float64 counts on their device, without a synchronisation (bincount's device
    version reads its input's largest value back to size its output): a histogram over
    bins of width one centred on each integer (`torch.histc`), or, where the script has
    turned on `torch.use_deterministic_algorithms` (under which histc refuses to run on a
    GPU), a sort and a search of where each integer begins. Both exact: counts are
    integers, whatever order they are summed in."""
    if torch.are_deterministic_algorithms_enabled():
        ordered = torch.sort(bins.reshape(-1)).values
        starts = torch.searchsorted(ordered, torch.arange(n + 1, dtype=ordered.dtype, device=ordered.device))
        return starts.diff().to(torch.float64)
    return torch.histc(bins.to(torch.float64).add_(0.5), bins=n + 1, min=0, max=n + 1)[:n]


def from_check(v):
    """TensorStats of a check vector (host list): counts only."""
    return {
        "numel": int(v[0]),
        "nan": int(v[1]),
        "pos_inf": int(v[2]),
        "neg_inf": int(v[3]),
        "zeros": 0,
        "subnormal": 0,
        "max_abs": 0.0,
        "min_abs_nonzero": None,
        "sum_sq": 0.0,
        "exp_hist": {"lo": 0, "counts": []},
        "to_f16": {"overflow": 0, "underflow": 0},
        "to_bf16": {"overflow": 0, "underflow": 0},
    }


def from_full(v):
    """TensorStats of a full vector (host list)."""
    f = dict(zip(FIELDS, v[: len(FIELDS)]))
    # The occupied bins, found from the counts' bytes (a step has thousands of these
    # vectors, and a loop over every bin of each was a third of their conversion): a zero
    # count is eight zero bytes and a count of at least 1 has a nonzero top byte, so in
    # either byte order the zero bytes around the occupied bins end inside its end counts.
    raw = array("d", v[len(FIELDS) :]).tobytes()
    lo = (len(raw) - len(raw.lstrip(b"\0"))) // 8
    hi = (len(raw.rstrip(b"\0")) + 7) // 8
    if lo < hi:
        exp_hist = {"lo": EXP_LO + lo, "counts": list(map(int, v[len(FIELDS) + lo : len(FIELDS) + hi]))}
    else:
        exp_hist = {"lo": 0, "counts": []}
    min_abs = f["min_abs_nonzero"]
    return {
        "numel": int(f["numel"]),
        "nan": int(f["nan"]),
        "pos_inf": int(f["pos_inf"]),
        "neg_inf": int(f["neg_inf"]),
        "zeros": int(f["zeros"]),
        "subnormal": int(f["subnormal"]),
        "max_abs": jfloat(f["max_abs"]),
        "min_abs_nonzero": None if min_abs == float("inf") else jfloat(min_abs),
        "sum_sq": jfloat(f["sum_sq"]),
        "exp_hist": exp_hist,
        "to_f16": {"overflow": int(f["f16_over"]), "underflow": int(f["f16_under"])},
        "to_bf16": {"overflow": int(f["bf16_over"]), "underflow": int(f["bf16_under"])},
    }


def nonfinite_flag(tensors):
    """Whether any of `tensors` holds a NaN or an infinity: a host bool when all are on the
    CPU (one sum each, exact as in `check`), else a 0-d device tensor read back with the
    step (multi-tensor max-abs norms: a few kernels for them all, no synchronisation)."""
    host, dev = [], []
    for t in tensors:
        x = local(t).detach()
        if x.numel():
            (host if on_host(x) else dev).append(x)
    for x in host:
        v = check(x)
        if v[1] + v[2] + v[3]:
            return True
    return device_flag(dev) if dev else False


def device_flag(tensors):
    """`nonfinite_flag` as a device computes it: a 0-d bool tensor per device, no
    synchronisation (any device may run it: the tests run it on the CPU)."""
    by_device = {}
    for x in tensors:
        if x.numel():
            by_device.setdefault(x.device, []).append(x)
    # A batch check's third figure: whether any value is NaN or infinite.
    flags = [batch_check(xs)[2] > 0 for xs in by_device.values()]
    if len(flags) == 1:
        return flags[0]
    return any(bool(f) for f in flags)


def batch_check(tensors):
    """A check standing for all of `tensors` (on one device) together: their element count,
    then whether any holds a NaN (exactly), whether any holds a NaN or an infinity (NaN
    hides an infinity beside it in a max-abs norm), and 0; a multi-tensor norm and a few
    kernels for them all, no synchronisation. Read as a check of an op's input is read
    (is there a NaN; is there an infinity), it errs only toward an infinity being there."""
    xs = [local(t).detach() for t in tensors]
    live = [x for x in xs if x.numel()]
    n = sum(x.numel() for x in xs)
    if not live:
        zero = torch.zeros((), dtype=torch.float64, device=xs[0].device)
        return DeviceCheck((n, zero, zero, zero))
    # By dtype: a multi-tensor norm takes its one-kernel path only over tensors of one
    # dtype (over a mixed list it falls back to a kernel a tensor). The maxima widen exactly.
    by_dtype = {}
    for x in live:
        by_dtype.setdefault(x.dtype, []).append(x)
    norms = torch.cat([torch.stack(list(torch._foreach_norm(g, float("inf")))).double() for g in by_dtype.values()])
    nan = norms.isnan().any().double()
    return DeviceCheck((n, nan, (~norms.isfinite()).any().double(), torch.zeros_like(nan)))
