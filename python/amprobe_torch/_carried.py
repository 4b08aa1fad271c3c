"""Checks carried across steps: a host check of a tensor the training owns (a parameter, an
optimizer's state) stands for the next step's read of it until something writes it."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set

import torch

from . import _stats
from ._tree import leaves


def key(t: torch.Tensor) -> tuple:
    """Identity of a tensor's values within a step: where they are and how they are laid out
    (the Python objects that reach the dispatcher are not stable). Plain values only (the
    shape as a tuple, not a `torch.Size`), so that the garbage collector stops tracking it."""
    t = _stats.local(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def storage_address(t: torch.Tensor) -> Optional[int]:
    """Where the storage holding `t`'s values begins, or None where it cannot be read (a
    wrapper subclass)."""
    try:
        return _stats.local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def state_keys(opt: Any) -> set:
    """The keys of the floating tensors of an optimizer's state (none where it keeps no
    `state` dict, an optimizer-like wrapper; none of a tensor whose storage cannot be
    read)."""
    try:
        state = opt.state
    except Exception:
        return set()
    if not isinstance(state, dict):
        return set()
    keys = set()
    for st in state.values():
        for t in leaves(st, torch.Tensor):
            if _stats.floating(t):
                try:
                    keys.add(key(t))
                except (RuntimeError, NotImplementedError, AttributeError):
                    pass
    return keys


class CarriedChecks:
    """By key: (version counter, check) of each owned tensor as an op last wrote or read it
    (see `known_check`). Off for a sharded model: a collective writes its parameters'
    gathered values without moving their version counters."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.checks: Dict[tuple, tuple] = {}
        # Storage address -> the keys of the checks above whose values are there.
        self.storage: Dict[int, Set[tuple]] = {}
        # Key -> the tensor whose check an op of this step wrote (`remember`).
        self.written: Dict[tuple, torch.Tensor] = {}
        self.keys: Set[tuple] = set()

    def begin_step(self, param_keys: Set[tuple], params: List[torch.Tensor], optimizers: Iterable[Any]) -> None:
        """A step begins: the owned tensors are the parameters (and the optimizers' state
        where checks can be carried: on the host); a check an op wrote last step takes the
        version counter its tensor has now."""
        self.keys = param_keys
        if self.enabled and any(_stats.on_host(p) for p in params):
            self.keys = param_keys.union(*(state_keys(opt) for opt in optimizers))
        for k, t in self.written.items():
            known = self.checks.get(k)
            if known is not None and known[0] is None:
                self.checks[k] = (t._version, known[1])
        self.written = {}
        self.checks = {k: v for k, v in self.checks.items() if k in self.keys and v[0] is not None}
        self.storage = {a: ks & self.checks.keys() for a, ks in self.storage.items()}

    def known_check(self, k: tuple, t: torch.Tensor) -> list:
        """The check of an input `t` with key `k` that no op of this step made: where the
        training owns it across steps (a parameter, an optimizer's state) and its version
        counter has not moved since an op last wrote or read it, that check (a parameter's
        values after the last update are those the next step reads); else a new one, kept
        for the next read. Writes that bypass the version counter (`.data`) are seen as the
        script's own ops (`on_op` forgets their tensors' checks); the model's own ops in a
        step checked by modules are not seen, and a model whose forward writes its own
        parameters through `.data` would have the next update's input checked by the
        version before it."""
        owned = self.enabled and k in self.keys and _stats.on_host(t) and not t.is_inference()
        if owned:
            known = self.checks.get(k)
            if known is not None and known[0] == t._version:
                return list(known[1])
        v = _stats.check(t)
        if owned:
            self.remember(k, t, v)
        return v

    def remember(self, k: tuple, t: torch.Tensor, v: list, written: bool = False) -> None:
        """Keeps check `v` of `t` (key `k`) where the training owns it (`known_check`).
        `written`: by the op that wrote it, whose version counter moves only once the
        mode has returned: the counter is read where the next step begins (the writes
        before then are the ops this step records)."""
        if k in self.keys:
            self.checks[k] = (None if written else t._version, v)
            if written:
                self.written[k] = t
            addr = storage_address(t)
            if addr is None:
                self.checks.pop(k, None)
                self.written.pop(k, None)
                return
            self.storage.setdefault(addr, set()).add(k)

    def forget_written(self, tensors: List[torch.Tensor]) -> None:
        """Forgets the carried checks of whatever shares storage with `tensors` (written by
        an op); all of them where a tensor's storage cannot be read (a wrapper subclass)."""
        addrs = [storage_address(t) for t in tensors if _stats.on_host(t)]
        if None in addrs:
            self.checks.clear()
            self.storage.clear()
            return
        for a in addrs:
            for k in self.storage.pop(a, ()):
                self.checks.pop(k, None)
