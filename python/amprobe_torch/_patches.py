"""Everything the companion replaces, each replacement made through a handle that puts the
original back: `Patches` for one watcher's (its scaler's and optimizers' methods, its module
hooks, the plan's), and the process-wide interceptions every open watcher shares (a tensor's
`backward`, `torch.autograd.backward` and `grad`, torch's gradient clipping, Dynamo's stance),
installed when the first watcher opens and put back when the last one closes."""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._registry import WATCHERS


class Patches:
    """Replaced attributes and held handles, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def replace(self, obj: Any, name: str, value: Any) -> None:
        """Sets `obj.name` to `value`; undone, the attribute is what `obj` itself held (or,
        where it held none, what its class gives) again. Where something else replaced it
        after this (an LR scheduler made later wraps an optimizer's `step`), undoing leaves
        that in place: the replacement inside it then only passes calls through."""
        own = vars(obj)
        had = name in own
        old = own.get(name)
        setattr(obj, name, value)

        def undo() -> None:
            if vars(obj).get(name) is not value:
                return
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def hold(self, handle: Any) -> Any:
        """Keeps a removable handle (a hook's) to remove it when undone; returns it."""
        self._undo.append(handle.remove)
        return handle

    def on_undo(self, f: Callable[[], None]) -> None:
        self._undo.append(f)

    def undo(self) -> None:
        """Undoes everything, newest first; an error in one undo does not stop the rest."""
        undo, self._undo = self._undo, []
        for f in reversed(undo):
            try:
                f()
            except Exception:  # (closing must not fail the script's exit)
                pass


# The process-wide interceptions: installed while a watcher is open.
_GLOBAL = Patches()
_OPEN = [0]


def acquire() -> bool:
    """Installs the process-wide interceptions for one more open watcher; returns whether
    torch.compile'd code now runs eagerly (see `_force_eager`)."""
    if _OPEN[0] == 0:
        _install_backward(_GLOBAL)
        _install_grad(_GLOBAL)
        _install_clips(_GLOBAL)
        eager = _force_eager()
        if eager:
            _GLOBAL.on_undo(_release_eager)
        _EAGER[0] = eager
    _OPEN[0] += 1
    return _EAGER[0]


def release() -> None:
    """One watcher fewer open; the last puts everything back."""
    if _OPEN[0] == 0:
        return
    _OPEN[0] -= 1
    if _OPEN[0] == 0:
        _GLOBAL.undo()


_EAGER = [False]
# Dynamo's stance before the first open watcher set it to run eagerly.
_STANCE_BEFORE: List[Any] = [None]


def _force_eager() -> bool:
    """Runs `torch.compile`d code eagerly while a watcher is open: a dispatch mode sees no
    op inside a compiled graph, and Dynamo compiles nothing under one, so a step checked by
    modules (the mode off the stack) would otherwise run compiled kernels that a kept step
    and a replay do not, and train otherwise than the step it stands for."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return False
    try:
        from torch._dynamo import eval_frame

        _STANCE_BEFORE[0] = getattr(eval_frame, "_stance", None)
        set_stance("force_eager")
    except Exception:  # (never stop the script over it: compiled code stays compiled)
        sys.stderr.write("amprobe_torch: could not make torch.compile run eagerly; compiled code goes unseen\n")
        return False
    return True


def _release_eager() -> None:
    """Puts Dynamo's stance back as it was before the first open watcher."""
    before = _STANCE_BEFORE[0]
    if before is not None and before.stance == "default" and before.backend is not None:
        torch.compiler.set_stance("default", force_backend=before.backend)
    elif before is not None:
        torch.compiler.set_stance(before.stance, skip_guard_eval_unsafe=before.skip_guard_eval_unsafe)
    else:
        torch.compiler.set_stance("default")


# Whether this thread is inside a backward the watchers were told of (a tensor's
# `backward` calls `torch.autograd.backward`, which must not tell them again).
_IN_BACKWARD = threading.local()


def _seeds_needed(roots: List[torch.Tensor], given: Any) -> bool:
    """Whether a backward of `roots` makes its own seeds (ones, for one-value roots, when
    none are given) that a step checked by modules makes here instead, while the mode still
    sees them (as in a step recorded in full): the same values either way."""
    return bool(
        given is None
        and roots
        and all(r.numel() == 1 for r in roots)
        and any(w.st.light and w.active for w in WATCHERS)
    )


def _tell(w: Any, f: Callable[[], Any]) -> Tuple[bool, Any]:
    """Runs `f`, a watcher's part of an interception, as the watcher's own (not seen by its
    mode); an error in it stops that watcher's capture, never the script. Returns (whether
    it ran, what it returned)."""
    w.busy = True
    try:
        return True, f()
    except Exception:
        w.fail()
        return False, None
    finally:
        w.busy = False


def safely(w: Any, f: Callable[..., Any], *a: Any) -> bool:
    """Runs `f(*a)`, a watcher's part of a call of the script's (as the script's own: its
    mode sees what it does); an error in it stops that watcher's capture (`fail`), never
    the script. Returns whether it ran to its end."""
    if w.failed is not None:
        w.stop_mode()
    try:
        f(*a)
        return True
    except Exception:
        w.fail()
        return False


def told_backward(roots: List[torch.Tensor], given: Any, run: Callable[[Optional[list]], Any]) -> Any:
    """Runs `run(seeds)`, a backward from `roots` (the losses) with the gradients `given`
    for them, told to the watchers: each names the roots' nodes and keeps their loss, and
    a step checked by modules pauses its mode for the model's own nodes. `seeds` are the
    roots' seeds made here (`_seeds_needed`), or None."""
    for w in WATCHERS:
        if w.active and not w.busy:
            _tell(w, lambda: w.on_backward(roots))
    # (after the loss is kept: the seeds belong to its micro-batch, as the backward's own do)
    seeds = None
    if _seeds_needed(roots, given):
        seeds = [torch.ones_like(t, memory_format=torch.preserve_format) for t in roots]
    light = []
    for w in WATCHERS:
        if w.st.light and w.active and not w.busy:
            ran, paused = _tell(w, w.before_backward)
            if ran:
                light.append((w, paused))
    _IN_BACKWARD.depth = getattr(_IN_BACKWARD, "depth", 0) + 1
    try:
        return run(seeds)
    finally:
        _IN_BACKWARD.depth -= 1
        for w, paused in reversed(light):
            try:
                w.after_backward(paused)
            except Exception:
                w.fail()


def _install_backward(patches: Patches) -> None:
    """Notes the roots of every backward (the loss) for the watchers, whether the script
    calls a tensor's `backward` or `torch.autograd.backward`."""
    orig = torch.Tensor.backward
    orig_fn = torch.autograd.backward

    @functools.wraps(orig)
    def backward(self, *a, **k):
        def run(seeds):
            if seeds is not None:
                k["gradient"] = seeds[0]
            return orig(self, *a, **k)

        return told_backward([self], a[0] if a else k.get("gradient"), run)

    @functools.wraps(orig_fn)
    def autograd_backward(tensors, grad_tensors=None, *a, **k):
        if getattr(_IN_BACKWARD, "depth", 0):
            return orig_fn(tensors, grad_tensors, *a, **k)
        one = isinstance(tensors, torch.Tensor)
        if not one:
            tensors = list(tensors)  # (any iterable, read once)
        roots = [tensors] if one else [t for t in tensors if isinstance(t, torch.Tensor)]

        def run(seeds):
            grads = grad_tensors if seeds is None else (seeds[0] if one else seeds)
            return orig_fn(tensors, grads, *a, **k)

        given = grad_tensors if grad_tensors is not None else k.get("grad_variables")
        if len(roots) != (1 if one else len(tensors)):
            # Roots that are not tensors (autograd's gradient edges): their seeds are
            # autograd's to make.
            given = tensors
        return told_backward(roots, given, run)

    patches.replace(torch.Tensor, "backward", backward)
    patches.replace(torch.autograd, "backward", autograd_backward)


def _install_grad(patches: Patches) -> None:
    """Tells the watchers when the script calls `torch.autograd.grad` (not a replay's own)."""
    orig = torch.autograd.grad

    @functools.wraps(orig)
    def grad(*a, **k):
        for w in WATCHERS:
            if w.active and not w.busy and not w.st.replaying:
                safely(w, w.on_autograd_grad)
        return orig(*a, **k)

    patches.replace(torch.autograd, "grad", grad)


# torch.nn.utils' gradient clipping, as scripts and trainers call it (through the module).
_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")


def _install_clips(patches: Patches) -> None:
    """Runs torch's gradient clipping in the watchers' optimizer phase, as amprobe's own
    steps clip: it prepares the gradients for the update (without a scaler, nothing else
    marks where the optimizer phase begins). A step checked by modules decides there, as
    where it enters the optimizer's step, whether it failed."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    for mod in (utils, clip_grad):
        for name in _CLIP_FUNCTIONS:
            f = getattr(mod, name, None)
            if f is not None:
                patches.replace(mod, name, _in_optimizer_phase(f, _NORMS.get(name)))


def _arg(a: tuple, k: dict, i: int, name: str) -> Any:
    return a[i] if len(a) > i else k.get(name)


# What each clipping function says of the gradients' total norm: (the norm, the max_norm
# it clips to, or None where it does not clip), from its arguments and its result.
_NORMS: Dict[str, Callable[[tuple, dict, Any], Tuple[Any, Any]]] = {
    "clip_grad_norm_": lambda a, k, out: (out, _arg(a, k, 1, "max_norm")),
    "clip_grad_norm": lambda a, k, out: (out, _arg(a, k, 1, "max_norm")),
    "get_total_norm": lambda a, k, out: (out, None),
    "clip_grads_with_norm_": lambda a, k, out: (_arg(a, k, 2, "total_norm"), _arg(a, k, 1, "max_norm")),
}


def _in_optimizer_phase(f: Callable, norm: Optional[Callable[[tuple, dict, Any], Tuple[Any, Any]]] = None) -> Callable:
    """`f` in the watchers' optimizer phase; `norm`: what it says of the gradients' total
    norm, which each watcher records (`Watcher.on_clip`)."""

    @functools.wraps(f)
    def run(*a, **k):
        entered = []
        for w in WATCHERS:
            if w.active and not w.busy and safely(w, w._enter_optimizer):
                entered.append(w)
        try:
            out = f(*a, **k)
        finally:
            for w in entered:
                w.optimizer_depth -= 1
        if norm is not None and entered:
            try:
                total, max_norm = norm(a, k, out)
            except Exception:
                total = None
            for w in entered:
                try:
                    w.on_clip(total, max_norm)
                except Exception:
                    w.fail()
        return out

    return run
