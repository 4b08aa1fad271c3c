"""Module and parameter names as the user's model names them: which module's forward runs
now, which module's forward made a backward node, and, in a step whose forwards run unseen,
which module call a node's autograd sequence number falls in."""

from __future__ import annotations

import bisect
from typing import Any, List, Optional

import torch

from ._attach import unwrapped

# Autograd's sequence number counter of this thread (the number the next node gets), where
# this torch has it.
SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None)


def own_name(name: str) -> str:
    """A module or parameter name without FSDP's inner wrappers."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")


class Names:
    """Module names as the model names them: a stack of the modules whose forward is running
    (global module hooks), and for the backward, the module whose forward made each autograd
    node."""

    def __init__(self, model: torch.nn.Module) -> None:
        # A DDP or FSDP wrapper's names carry its `module.` prefix and FSDP's inner
        # wrappers their `_fsdp_wrapped_module`; the user's model's names have neither.
        root = unwrapped(model)
        self.root = root
        self.names = {id(m): own_name(n) for n, m in root.named_modules()}
        if id(model) not in self.names:
            self.names[id(model)] = ""
        self.params = {}
        for n, p in root.named_parameters():
            self.params[id(p)] = own_name(n).rpartition(".")[0]
        self.stack = []
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module, args):
        name = self.names.get(id(module))
        self.stack.append(type(module).__name__ if name is None else name)

    def _leave(self, module, args, out):
        if self.stack:
            self.stack.pop()

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def of_node(self, node: Any) -> Optional[str]:
        """The module of a parameter's gradient accumulation, or None."""
        var = getattr(node, "variable", None)
        return None if var is None else self.params.get(id(var))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Spans:
    """Where a step checked by modules runs its modules' forwards unseen: each recorded call's
    span of autograd sequence numbers, its module's name and the call it ran inside, so that
    a backward op that comes to be seen (the rest of a step cut by `torch.autograd.grad` or
    an update's closure) is named by the module whose forward made its node, as a seen
    forward names it."""

    def __init__(self) -> None:
        self.start: List[int] = []
        self.end: List[Optional[int]] = []
        self.name: List[str] = []
        # The call each ran inside (-1: none).
        self.parent: List[int] = []
        # The module calls running now: each one's index in the spans, or -1; and the
        # indices of those recorded.
        self.open: List[int] = []
        self.recorded: List[int] = []

    def begin_step(self) -> None:
        self.start, self.end, self.name, self.parent = [], [], [], []
        # (calls running across the step's start are not this step's)
        self.open = [-1] * len(self.open)
        self.recorded = []

    def enter(self, name: Optional[str]) -> None:
        """A module call begins; `name` is its module's where its span is recorded, else None."""
        if name is None:
            self.open.append(-1)
            return
        i = len(self.start)
        self.start.append(SEQUENCE_NR())
        self.end.append(None)
        self.name.append(name)
        self.parent.append(self.recorded[-1] if self.recorded else -1)
        self.recorded.append(i)
        self.open.append(i)

    def leave(self) -> None:
        if self.open:
            i = self.open.pop()
            if i >= 0:
                if self.recorded:
                    self.recorded.pop()
                if i < len(self.end):
                    self.end[i] = SEQUENCE_NR()

    def module_of(self, node: Any) -> Optional[str]:
        """The module whose call made autograd node `node` (the innermost call whose sequence
        numbers hold the node's), or None."""
        if not self.start:
            return None
        try:
            seq = node._sequence_nr()
        except (AttributeError, RuntimeError):
            return None
        i = bisect.bisect_right(self.start, seq) - 1
        # Calls nest: a call that began earlier and holds the node holds the later one.
        while i >= 0:
            end = self.end[i]
            if end is None or seq < end:
                return self.name[i]
            i = self.parent[i]
        return None
