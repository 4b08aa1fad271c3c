"""The trace records the companion writes (docs/trace-schema.md): the header, and a step
record's op records and parameter records, from what the capture gathered."""

from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Sequence

import torch

from . import _plan, _stacks, _stats
from ._trace import SCHEMA_VERSION, jfloat
from ._version import TOOL_VERSION



def _meta(m):
    """A record's tensor description of a (dtype, shape) pair."""
    return {"dtype": _stats.DTYPE_NAMES[m[0]], "shape": list(m[1])}


# The ops autocast runs in its lower precision on every device, which say what precision a
# forward ran in: matrix products and convolutions.
_MATMULS = frozenset(
    ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution", "_convolution",
     "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
)


def matmul_dtype(ops: Sequence) -> Optional[torch.dtype]:
    """The dtype most of a step's forward matrix products and convolutions ran in (their
    outputs'), or None where it ran none."""
    count: dict = {}
    for op in ops:
        if op.phase == "forward" and op.op in _MATMULS:
            count[op.output[0]] = count.get(op.output[0], 0) + 1
    return max(count, key=count.get) if count else None


def _precision(model: torch.nn.Module, autocast_dtype: Optional[torch.dtype], ran: Optional[torch.dtype]) -> str:
    """The precision mode the model trained in, as its ops ran: a model made 16-bit
    (`model.half()`, `model.bfloat16()`: most parameters' values in it) trains in it
    throughout (amprobe's "half" and "bfloat16-pure"); else autocast's dtype where a module's
    forward ran under it, or the 16-bit dtype its matrix products ran in (autocast entered
    where no module starts, or casts made by hand): "fp16" or "bf16"; else "fp32"."""
    by_dtype: dict = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    most = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
    if most in (torch.float16, torch.bfloat16):
        return "half" if most == torch.float16 else "bfloat16-pure"
    low = autocast_dtype if autocast_dtype in (torch.float16, torch.bfloat16) else ran
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(low, "fp32")


def _scaler(sc: Any) -> Optional[dict]:
    """The header's scaler configuration, or None without an enabled scaler."""
    if sc is None:
        return None
    if hasattr(sc, "describe"):
        # (DeepSpeed's loss scaler, with its kind and hysteresis)
        return sc.describe()
    return {
        "init_scale": sc._init_scale,
        "growth_factor": sc._growth_factor,
        "backoff_factor": sc._backoff_factor,
        "growth_interval": sc._growth_interval,
    }


def compiled_regions(root: torch.nn.Module, given_compiled: bool) -> List[str]:
    """The watched model's parts `torch.compile` compiled, by their names in the model: a
    model given compiled (an `OptimizedModule`: named ""), a module compiled in place
    (`module.compile()`), a module whose `forward` is compiled. (A compiled function that
    is not a module's forward is not seen.)"""
    out = [""] if given_compiled else []
    for name, m in root.named_modules():
        fwd = getattr(type(m), "forward", None)
        if getattr(m, "_compiled_call_impl", None) is not None or hasattr(fwd, "_torchdynamo_orig_callable"):
            if name not in out:
                out.append(name)
    return out


def model_name(m: torch.nn.Module) -> str:
    """The model's class name as the user wrote it: FSDP2's `fully_shard` swaps a module's
    class for a generated `FSDP<Name>` subclass, whose base is the user's."""
    cls = type(m)
    if cls.__name__.startswith("FSDP") and any(b.__name__ == "FSDPModule" for b in cls.__mro__):
        for b in cls.__bases__:
            if b.__name__ != "FSDPModule":
                return b.__name__
    return cls.__name__


def _capture_facts(source: dict, discovery: Optional[dict], compiled: Optional[List[str]], eager: bool) -> None:
    """The header source's facts of the capture: the precision a library asked for, what
    discovery found, what torch.compile compiled (run eagerly while watched:
    `_patches._force_eager`)."""
    asked = _stacks.requested_precision()
    if asked is not None:
        source["requested_precision"] = {"precision": asked[0], "by": asked[1]}
    if discovery is not None:
        source["discovery"] = discovery
    if compiled:
        source["compiled"] = {"regions": compiled, "ran": "eager" if eager else "compiled"}


def header(
    model: torch.nn.Module,
    root: torch.nn.Module,
    several: bool,
    autocast_dtype: Optional[torch.dtype],
    scaler: Any,
    optimizers: Sequence[Any],
    sample_every: int,
    ran: Optional[torch.dtype] = None,
    discovery: Optional[dict] = None,
    compiled: Optional[List[str]] = None,
    eager: bool = False,
) -> dict:
    """The trace's header: the model (`root`: the one whose names the trace uses; `several`:
    it holds several models), the precision it trained in (`ran`: the dtype the first
    step's matrix products ran in), the scaler, the optimizers, and what discovery found
    where it found them."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    precision = _precision(model, autocast_dtype, ran)
    if autocast_dtype is None and precision in ("fp16", "bf16"):
        autocast_dtype = ran
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    header = {
        "schema_version": SCHEMA_VERSION,
        "tool": "amprobe",
        "tool_version": TOOL_VERSION,
        "model": " + ".join(model_name(m) for m in root.values())
        if several
        else model_name(root),
        "precision": precision,
        "autocast_dtype": _stats.DTYPE_NAMES.get(autocast_dtype) if autocast_dtype else None,
        "policy_device": dev.type,
        "policy": None,
        "scaler": _scaler(scaler),
        "optimizer": {"kind": " + ".join(type(o).__name__ for o in optimizers)},
        "backend": dev.type,
        # (torch's default generator's: what `torch.manual_seed` set, else drawn at start)
        "seed": torch.initial_seed(),
        "command_line": list(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
        "config": {},
        "source": {
            "kind": "pytorch",
            "torch": torch.__version__,
            "rank": rank,
            "world_size": world,
            "sample_every": sample_every,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "transformers": _plan.is_transformers(root),
        },
    }
    _capture_facts(header["source"], discovery, compiled, eager)
    if device_name is not None:
        header["device"] = device_name
    return header


def op_records(ops: Sequence, vecs: Sequence) -> List[dict]:
    """A step's op records from its ops and their read-back statistics vectors."""
    records = []
    # (ops that share a vector, a view and its input, share its statistics' record)
    converted = {}
    for op, v in zip(ops, vecs):
        st = converted.get(op.vec)
        if st is None:
            st = _stats.from_full(v) if op.vec.kind == "full" else _stats.from_check(v)
            converted[op.vec] = st
        masked = st["neg_inf"] if op.masked else 0
        records.append(
            {
                "micro": op.micro,
                "index": op.index,
                "phase": op.phase,
                "op": op.op,
                "module": op.module,
                "inputs": [_meta(m) for m in op.inputs],
                "output": _meta(op.output),
                "stats": st,
                "rounding": {"overflow": 0, "underflow": 0},
                "forward_op": None,
                "wrt": None,
                "masked_neg_inf": masked,
            }
        )
    return records


def param_records(names: Sequence, pv: Sequence) -> List[dict]:
    """A step's parameter records from (name, parameter) pairs and their figures."""
    params = []
    for (name, p), v in zip(names, pv):
        has_grad = v[0] > 0
        finite_nonzero = v[6]
        # A distributed parameter's figures are of this rank's shard.
        n = _stats.local(p).numel()
        params.append(
            {
                "name": name,
                "dtype": _stats.DTYPE_NAMES.get(p.dtype, "float32"),
                "grad_dtype": _stats.DTYPE_NAMES.get(p.grad.dtype) if has_grad and p.grad is not None else None,
                "numel": n,
                "grad_l2": jfloat(v[1] ** 0.5),
                "max_abs_grad": jfloat(v[2]),
                "zero_frac": v[3] / n if n else 0.0,
                "f16_underflow_frac_unscaled": v[4] / finite_nonzero if finite_nonzero else 0.0,
                "f16_underflow_frac_scaled": v[5] / finite_nonzero if finite_nonzero else 0.0,
                "nonfinite": int(v[7]),
                "param_max_abs_after": jfloat(v[8]),
                "param_nan_after": int(v[9]),
            }
        )
    return params
