"""Attaching: what `watch` is given (a model or several, an optimizer or several, a scaler),
checked and gathered into what the watcher watches, the open watcher that already watches
it, and where the trace goes."""

from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Tuple

import torch

from . import _stats
from ._registry import WATCHERS


def sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are sharded across ranks (FSDP or FSDP2)."""
    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()) or any(
        _stats.local(p) is not p for p in model.parameters()
    )


def unwrapped(m: torch.nn.Module) -> torch.nn.Module:
    """A module without a DDP, FSDP or `torch.compile` wrapper around it (the names the
    user's model has)."""
    for _ in range(8):
        if hasattr(m, "module") and type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
            m = m.module
        elif type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):
            m = m._orig_mod
        else:
            break
    return m


def gather_models(model: Any) -> Tuple[torch.nn.Module, List[torch.nn.Module]]:
    """(the module whose names the trace uses, the modules the script calls) of what
    `watch` was given: a module is both; several models (a dict of them, or a list or tuple,
    named by position) are held by one ModuleDict, which names each one's modules under
    its key, and are called themselves. Anything else raises TypeError or ValueError."""
    if isinstance(model, torch.nn.Module):
        return unwrapped(model), [model]
    if isinstance(model, dict):
        items = list(model.items())
    elif isinstance(model, (list, tuple)):
        items = [(str(i), m) for i, m in enumerate(model)]
    else:
        raise TypeError(
            f"watch: the model must be a torch.nn.Module, or a dict or list of them, not {type(model).__name__}"
        )
    if not items:
        raise ValueError("watch: no model given (an empty dict or list)")
    for k, m in items:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"watch: model[{k!r}] is a {type(m).__name__}, not a torch.nn.Module")
        if not isinstance(k, str) or not k or "." in k:
            raise ValueError(f"watch: model names must be non-empty strings without dots, not {k!r}")
    return torch.nn.ModuleDict({k: unwrapped(m) for k, m in items}), [m for _, m in items]


def gather_optimizers(optimizer: Any) -> List[Any]:
    """The optimizers `watch` was given (one, or a list or tuple of them), each once;
    TypeError for anything without `step` and `param_groups`."""
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not opts:
        raise ValueError("watch: no optimizer given (an empty list)")
    out = []
    for i, o in enumerate(opts):
        if not callable(getattr(o, "step", None)) or not hasattr(o, "param_groups"):
            at = f"optimizer[{i}]" if isinstance(optimizer, (list, tuple)) else "the optimizer"
            raise TypeError(f"watch: {at} is a {type(o).__name__}, not a torch.optim.Optimizer")
        if not any(o is p for p in out):
            out.append(o)
    return out


def open_watcher(called: List[torch.nn.Module], optimizers: List[Any], scaler: Any, path: str) -> Optional[Any]:
    """The open watcher that watches exactly `called` with `optimizers` and `scaler`, which
    `watch` returns when a script calls it again (in its epoch loop); None when there is
    none. ValueError when a model given is watched by an open watcher with other models,
    optimizers or another scaler, or when an open watcher writes the trace `path`."""
    for w in WATCHERS:
        if w.closed:
            continue
        if w.discovery is not None and _discovered(w, called):
            return w
        shared = [m for m in called if any(m is c for c in w.called)]
        if shared:

            def same(a, b):
                return len(a) == len(b) and all(x is y for x, y in zip(a, b))

            if same(called, w.called) and same(optimizers, w.optimizers) and scaler is w.scaler_given:
                if not w.rewatched:
                    w.rewatched = True
                    sys.stderr.write(
                        "amprobe_torch: watch() called again with what it already watches: the open watcher goes on\n"
                    )
                return w
            raise ValueError(
                f"watch: the {type(shared[0]).__name__} given is already watched with other models, optimizers "
                f"or scaler (trace {w.path}); close that watcher first (the value watch returned: .close())"
            )
        if os.path.abspath(w.path) == os.path.abspath(path):
            raise ValueError(
                f"watch: an open watcher already writes the trace {path}; give this one another "
                "(watch(..., trace=PATH) or AMPROBE_TRACE)"
            )
    return None


def _discovered(w: Any, called: List[torch.nn.Module]) -> bool:
    """Whether the watcher discovery attached (`_discover`) watches a model given to
    `watch`, which then returns it: a script run by `amprobe run` that calls `watch` after
    its training began is watched once, as discovery found it."""
    watched = {id(m) for m in w.names.root.modules()}
    if not any(id(unwrapped(m)) in watched or id(m) in watched for m in called):
        return False
    if not w.rewatched:
        w.rewatched = True
        sys.stderr.write(
            "amprobe_torch: watch() was called on a training amprobe already watches (found as it began): "
            "the watcher it attached goes on\n"
        )
    return True


def trace_path() -> str:
    """$AMPROBE_TRACE, else amprobe-trace.jsonl; `.rank{N}` before the suffix under a
    distributed run of more than one rank."""
    path = os.environ.get("AMPROBE_TRACE") or "amprobe-trace.jsonl"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{torch.distributed.get_rank()}{ext}"
    return path
