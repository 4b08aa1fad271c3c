"""The capture's dispatch mode: every ATen op of the user's program, forward and backward,
passed to the op recorder before and after it runs."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._recorder import on_op, read_inputs


class CaptureMode(TorchDispatchMode):
    """Sees every ATen op; inside `__torch_dispatch__` the mode is off, so the statistics'
    own ops are not seen."""

    def __init__(self, watcher: Any) -> None:
        super().__init__()
        self.watcher = watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        w = self.watcher
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            # `record_function`'s markers (every optimizer's `step` opens one): no numbers,
            # and not an op of the update (a closure evaluated first is the step's forward).
            return func(*args, **kwargs)
        if w.st.light and not w.busy:
            # A step checked by modules: the model's own ops, forward and backward, only run
            # (a replay records them if the step fails); the script's ops around the model
            # (its loss, their gradients) and the optimizer's are recorded as always. The
            # mode is normally off the stack for the model's ops (`Watcher._pause`); this is
            # for when another mode above it kept it there.
            if w.tree_depth:
                return func(*args, **kwargs)
            if not w.optimizer_depth and torch._C._current_graph_task_id() != -1:
                node = torch._C._current_autograd_node()
                if node is None or node not in w.st.loss_nodes:
                    return func(*args, **kwargs)
        seen = None
        if w.active and not w.busy:
            w.busy = True
            try:
                seen = read_inputs(w, func, args, kwargs)
            except Exception:  # never kill the user's training
                w.fail()
            finally:
                w.busy = False
        out = func(*args, **kwargs)
        if seen is not None and w.active and not w.busy:
            w.busy = True
            try:
                on_op(w, func, seen, out, args, kwargs)
            except Exception:
                w.fail()
            finally:
                w.busy = False
        return out
