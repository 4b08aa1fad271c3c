"""Statistics of one tensor, computed on its own device into a small float64 vector that
stays there until the step's one read back (no host synchronisation per op).

Two kinds: the full statistics of amprobe's TensorStats (kept steps), and the check
(NaN, +inf and -inf counts only) of every other step."""

from __future__ import annotations

from array import array
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch

from ._trace import jfloat

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed tensors
    DTensor = None


# The tests set it to run the device paths on the CPU: every figure gathered on the
# tensor's device and read back with the step, as on a GPU.
DEVICE_PATH_ON_CPU = False


def on_host(x: torch.Tensor) -> bool:
    """Whether `x` takes the host paths: on the CPU, where reading a value back costs no
    synchronisation (unless the tests ask for the device paths there)."""
    return x.device.type == "cpu" and not DEVICE_PATH_ON_CPU


def local(t: torch.Tensor) -> torch.Tensor:
    """The values this process holds of `t`: its shard when it is a distributed tensor
    (FSDP2's parameters), else `t` itself."""
    return t._local_tensor if DTensor is not None and isinstance(t, DTensor) else t

from ._layout import (
    ALLOCATING,
    BF16_OVERFLOW,
    BF16_UNDERFLOW,
    CHECK_LEN,
    DTYPE_NAMES,
    EXP_HI,
    EXP_LO,
    F16_OVERFLOW,
    F16_UNDERFLOW,
    FIELDS,
    FINITE_PRESERVING,
    FLOATING,
    FULL_LEN,
    N_BINS,
    NORMAL_MIN,
    RANDOM,
    RANGE,
    VALUE_COPIES,
)
from ._host_stats import full_host as _full_host
from ._host_stats import release_scratch

# (the layout and the scratch's release are read through this module)
__all__ = [
    "ALLOCATING", "BF16_OVERFLOW", "BF16_UNDERFLOW", "CHECK_LEN", "DTYPE_NAMES", "EXP_HI", "EXP_LO",
    "F16_OVERFLOW", "F16_UNDERFLOW", "FIELDS", "FINITE_PRESERVING", "FLOATING", "FULL_LEN", "N_BINS",
    "NORMAL_MIN", "RANDOM", "RANGE", "VALUE_COPIES", "DEVICE_PATH_ON_CPU", "DeviceCheck", "batch_check", "check",
    "check_many", "device_check", "device_flag", "floating", "from_check", "from_full", "full", "full_many",
    "gather", "local", "nonfinite_flag", "observed", "on_host", "release_scratch", "stored_values",
]


def observed(t: Any) -> bool:
    """True for the tensors a record describes (amprobe's dtypes)."""
    return isinstance(t, torch.Tensor) and t.dtype in DTYPE_NAMES and t.layout == torch.strided


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor stores: the tensor itself when it is strided; a sparse one's
    stored values (a COO tensor's coalesced, duplicate entries summed), every other element
    of it being zero."""
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    return t.values()


def floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in NORMAL_MIN and t.layout == torch.strided


class DeviceCheck(tuple):
    """A check of a tensor on a device: (numel, NaN count, +inf count, -inf count), the
    three counts 0-d tensors left on the device until the step's one read back."""

    __slots__ = ()


def check(t: torch.Tensor) -> Union[List[float], DeviceCheck]:
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


def device_check(x: torch.Tensor) -> DeviceCheck:
    """`check` as a device computes it: six kernels (three tests, three sums), no
    synchronisation and no transfer; the element count is the host's. (Any tensor's device
    may run it: the tests run it on the CPU.)"""
    return DeviceCheck((x.numel(), x.isnan().sum(), x.isposinf().sum(), x.isneginf().sum()))


def gather(vecs: Sequence[Any]) -> List[Any]:
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


def full(t: torch.Tensor) -> Union[Tuple[float, ...], torch.Tensor]:
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


def full_many(ts: Sequence[torch.Tensor]) -> Union[Tuple[float, ...], torch.Tensor]:
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


def check_many(ts: Sequence[torch.Tensor]) -> Union[List[float], DeviceCheck]:
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
        (nz & (a < NORMAL_MIN[dt])).sum(dtype=f64),
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


def from_check(v: Sequence[float]) -> Dict[str, Any]:
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


def from_full(v: Sequence[float]) -> Dict[str, Any]:
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


def nonfinite_flag(tensors: Iterable[torch.Tensor]) -> Union[bool, torch.Tensor]:
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


def device_flag(tensors: Iterable[torch.Tensor]) -> Union[bool, torch.Tensor]:
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


def batch_check(tensors: Sequence[torch.Tensor]) -> DeviceCheck:
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
