"""What a replay of a failing step checked by modules needs: each outermost model call as it
ran (`Call`), its inputs cut from the first run's graph, and the gradients its outputs
received."""

from __future__ import annotations

import contextlib
from typing import Any, List

import torch

from . import _origins, _stats
from ._carried import key
from ._tree import leaves, map_tensors

try:
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover - older torch
    _disable_current_modes = contextlib.nullcontext


def cut_inputs(obj: Any, made: List[torch.Tensor], memo: dict) -> Any:
    """A call's arguments with each tensor that an op made and that needs a gradient
    replaced by a leaf of the same values that needs one too (also put in `made`): the
    replayed call's backward then ends at its inputs, driven by the gradients its own
    outputs received, instead of going back into the first run's graph of what made them
    (another call of the model, already freed by its backward)."""

    def cut(t):
        if t.grad_fn is None or not t.requires_grad:
            return t
        leaf = memo.get(id(t))
        if leaf is None:
            leaf = t.detach().requires_grad_()
            memo[id(t)] = leaf
            made.append(leaf)
        return leaf

    return map_tensors(obj, cut)


def keep_grad(call: "Call", j: int, g: torch.Tensor) -> None:
    """A tensor hook: keeps the gradient output `j` of `call` received (summed over
    backwards through it)."""
    had = call.grads.get(j)
    if had is None:
        call.grads[j] = g
    else:
        # (the capture's own sum: no op of the step's)
        with _disable_current_modes(), torch.no_grad():
            call.grads[j] = had + g


class Call:
    """One outermost call of a module of the model in a step checked by modules: what a
    replay needs to run it again as it ran (its inputs, the random generators' states,
    autocast, grad mode and each module's train/eval mode at the call), where its ops
    began, and the gradient the backward brought to each of its outputs."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, micro: int, start: int) -> None:
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.micro = micro
        self.start = start
        devices = {p.device for p in module.parameters(recurse=True)}
        self.rng = torch.get_rng_state()
        # Only the generators of the devices the model is on (reading another device's
        # would start a context there).
        self.cuda_rng = [
            (d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda" and torch.cuda.is_initialized()
        ]
        self.grad = torch.is_grad_enabled()
        # Every module's own flag: a model in training can hold frozen parts in eval mode.
        self.training = [m.training for m in module.modules()]
        types = {"cpu"} | {d.type for d in devices}
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(types) if t != "meta"
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.grads = {}

    def context(self) -> contextlib.ExitStack:
        """The call's grad mode and autocast, entered for its replay."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for t, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(t, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache))
        return stack

    def restore_rng(self) -> None:
        """The random generators as they were when the call began."""
        torch.set_rng_state(self.rng)
        for d, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, d)


def _failure_flags(w: Any) -> list:
    """What says a step checked by modules failed so far: its modules' output flags, the
    losses' test and, without a scaler, the gradients' (host answers as they are; device
    ones read back together with the ops' checks)."""
    st = w.st
    flags = list(st.out_flags)
    if st.losses:
        flags.append(~torch.stack(st.losses).isfinite().all())
    if w.scaler is None:
        grads = [_stats.stored_values(p.grad) for p in w.names.root.parameters() if p.grad is not None]
        for g in grads:
            if not _stats.on_host(_stats.local(g)):
                continue
            # The optimizer's ops read these next: their checks are these.
            k = key(g)
            e = st.external.get(k)
            if e is None:
                st.check_vecs.append(_stats.check(g))
                e = len(st.check_vecs) - 1
                st.external.put(k, g, e)
            v = st.check_vecs[e]
            flags.append(v[1] + v[2] + v[3] > 0)
        flags.append(_stats.nonfinite_flag([g for g in grads if not _stats.on_host(_stats.local(g))]))
    return flags


def _device_flags(flags: list) -> list:
    """The device flags among `flags`, one a device, each read back as a check is (its
    first count is the flag)."""
    by_device: dict = {}
    for f in flags:
        if isinstance(f, torch.Tensor):
            by_device.setdefault(f.device, []).append(f.reshape(1))
    out = []
    for fs in by_device.values():
        f = torch.cat(fs).any().double()
        out.append(_stats.DeviceCheck((1, f, f, f)))
    return out


def _failed(w: Any) -> bool:
    """Whether the step failed so far: a module's output, an op of the script's own, an
    input it read or a loss not finite; without a scaler, a gradient."""
    st = w.st
    flags = _failure_flags(w)
    if any(f is True for f in flags):
        return True
    on_device = _device_flags(flags)
    vecs = [st.full_vecs[i] if k == "full" else st.check_vecs[i] for k, i in (op.vec for op in st.ops)]
    ext = list(st.external.values())
    read = _stats.gather(vecs + [st.check_vecs[e] for e in ext] + on_device)
    failing = False
    for _ in on_device:
        failing = read.pop()[1] > 0 or failing
    # An op of the script's own that made a NaN or an infinity (not one that only passed on
    # what an input held: the last step's NaN loss kept by the script; a model's output
    # that held one is in its modules' flags).
    found = _origins.origins(st.ops, read[: len(vecs)], dict(zip(ext, read[len(vecs) :])), w.step)
    return failing or found["first_inf"] is not None or found["first_nan"] is not None


def decide(w: Any) -> None:
    """Where a step checked by modules enters its optimizer phase: whether it failed so far,
    read back at once; if so, it is replayed now, before the optimizer changes anything."""
    w.st.decided = True
    w.busy = True
    try:
        with _disable_current_modes():
            failing = _failed(w)
    except Exception:
        w.fail()
        return
    finally:
        w.busy = False
    if failing:
        w._replay()


class _Saved:
    """What a replay changes and puts back: the random generators, the model's buffers,
    its modules' train/eval modes."""

    def __init__(self, root: torch.nn.Module, cuda_devices: list) -> None:
        self.rng = torch.get_rng_state()
        self.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in cuda_devices]
        self.buffers = [(b, b.detach().clone()) for b in root.buffers()]
        self.training = [(m, m.training) for m in root.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            torch.set_rng_state(self.rng)
            for d, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, d)
            for b, saved in self.buffers:
                b.copy_(saved)
            for m, t in self.training:
                m.training = t


def _as_own(w: Any, f: Any) -> Any:
    """Runs `f` as the watcher's own work (no mode sees it)."""
    w.busy = True
    try:
        with _disable_current_modes():
            return f()
    finally:
        w.busy = False


def _run_calls(w: Any, micro: int, made: list) -> tuple:
    """Runs micro-batch `micro`'s calls again as they ran; returns (their outputs that
    received gradients, those gradients)."""
    outs, grads, memo = [], [], {}
    for c in w.st.calls:
        if c.micro != micro:
            continue

        def inputs(c=c):
            c.restore_rng()
            return cut_inputs((c.args, c.kwargs), made, memo)

        args, kwargs = _as_own(w, inputs)
        w.st.replay_call = c
        for m, t in zip(c.module.modules(), c.training):
            m.training = t
        with c.context():
            out = c.module(*args, **kwargs)
        w.st.replay_call = None
        for j, t in enumerate(leaves(out, torch.Tensor)):
            # No op of the replay reads its outputs: their nodes are named here.
            w._name_loss(t)
            g = c.grads.get(j)
            if g is not None and t.requires_grad:
                outs.append(t)
                grads.append(g)
    return outs, grads


def _replay_micro(w: Any, micro: int, params: list) -> None:
    """Replays one micro-batch's calls and their backward."""
    st = w.st
    st.replay_micro = micro
    made: list = []
    outs, grads = _run_calls(w, micro, made)
    if outs and params and st.replay_backward_note is None:
        try:
            # (the inputs cut from other calls too: their gradients are ops of the step)
            torch.autograd.grad(outs, params + made, grads, allow_unused=True)
        except RuntimeError as e:
            # A backward that cannot run into gradients of its own (reentrant activation
            # checkpointing refuses `autograd.grad`): the forward's records stand; later
            # steps check every op, exactly.
            st.replay_backward_note = str(e).strip().split("\n")[0]
            w.light_ok = False


def replay(w: Any) -> None:
    """Runs the step's model calls again under the capture, each as it ran (its inputs,
    random state, autocast, grad mode and every module's train/eval mode), and their
    backward from the gradients their outputs received, into gradients of its own (the
    parameters' are not touched); restores the random generators, the model's buffers and
    its modules' modes after. The ops go where the first run's went
    (`Watcher._replay_key`)."""
    st = w.st
    st.replayed = True
    if st.replay_note is not None or not st.calls:
        st.replay_note = st.replay_note or "no call of the model was seen in this step"
        # The next steps check every op: a failure there is found exactly.
        w.light_ok = False
        return
    root = w.names.root
    saved = _as_own(w, lambda: _Saved(root, [d for d, _ in st.calls[0].cuda_rng]))
    params = [p for p in root.parameters() if p.requires_grad]
    w._resume()
    st.check_every_op()
    st.failing = True
    st.replaying = True
    try:
        for micro in sorted({c.micro for c in st.calls}):
            _replay_micro(w, micro, params)
    except Exception:
        w.fail()
    finally:
        st.replaying = False
        st.replay_call = None
        _as_own(w, saved.restore)
