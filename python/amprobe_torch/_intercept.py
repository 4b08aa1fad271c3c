"""The interception of the script's optimizers and scaler: their methods replaced on the
instances (through the watcher's `Patches`, undone at close) so that the watcher sees the
optimizer phase, each update, the loss scaling and where a step ends."""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

from ._patches import safely


class _Wrapped:
    """A method of the script's scaler as the watcher wraps it (set on the instance): called,
    it is the wrapper; copied or pickled with the scaler (`copy.deepcopy`, `torch.save` of
    the whole object), it is the copy's own method, and the copy is not watched."""

    __slots__ = ("owner", "name", "func")

    def __init__(self, owner: Any, name: str, func: Callable) -> None:
        self.owner = owner
        self.name = name
        self.func = func

    def __call__(self, *a, **k):
        return self.func(*a, **k)

    def __reduce__(self):
        # The copy's attribute is read before its state is set: its class's method.
        return (getattr, (self.owner, self.name))


def in_optimizer(w: Any, f: Callable) -> Callable:
    """`f` with its ops counted in the optimizer phase (nested calls included: the
    scaler's step unscales)."""

    def run(*a, **k):
        entered = safely(w, w._enter_optimizer)
        try:
            return f(*a, **k)
        finally:
            if entered:
                w.optimizer_depth -= 1

    return run


def outside_optimizer(w: Any, closure: Callable) -> Callable:
    """An optimizer step's closure (SAM's, L-BFGS's, Lightning's `training_step` with its
    backward), whose forward and backward of the model are those phases, not the
    optimizer's. A closure the update calls before any op of its own (torch's optimizers
    evaluate it first: Lightning's automatic optimization runs the whole forward and
    backward so) is the step's forward and backward as if no update had begun: a step
    checked by modules decides where it returns, before the update changes anything."""

    def run(*a, **k):
        depth, unscaled, updating_ = w.optimizer_depth, w.st.unscaled, w.st.in_update
        fresh = w.st.in_update and w.st.op_count == w.st.update_start and not w.st.replayed
        w.optimizer_depth, w.st.unscaled = 0, False
        if fresh:
            w.st.in_update = False
            w.st.decided = False
        try:
            out = closure(*a, **k)
            if fresh and w.st.light and not w.st.decided and w.active and not w.busy:
                w._decide()
            return out
        finally:
            w.optimizer_depth, w.st.unscaled, w.st.in_update = depth, unscaled, updating_

    return run


def updating(w: Any, f: Callable, scaler_step: bool = False) -> Callable:
    """`f`, an optimizer's update (its `step`, or the scaler's step of it: `scaler_step`),
    in the optimizer phase, counted. A step checked by modules replays its model calls as
    they ran, which needs the parameters they read unchanged: its calls are decided in
    segments, each ending where an update begins (`_enter_optimizer`), and a segment the
    scaler skipped an update for, which its checks did not see fail, is replayed as soon
    as the scaler's step returns (nothing has changed its parameters yet). The next
    segment begins with the calls after the update (a GAN's generator part after its
    discriminator's update)."""
    inner = in_optimizer(w, f)

    def run(*a, **k):
        outer = w.active and not w.busy and not w.optimizer_depth
        if outer:
            w.st.updates += 1
            w.st.inner_stepped = False
            w.st.in_update = True
            w.st.update_start = w.st.op_count
            w.st.update_closure = bool(a and callable(a[0])) or callable(k.get("closure"))
        if a and callable(a[0]):
            a = (outside_optimizer(w, a[0]),) + a[1:]
        elif callable(k.get("closure")):
            k["closure"] = outside_optimizer(w, k["closure"])
        done = False
        try:
            r = inner(*a, **k)
            done = True
            return r
        finally:
            if outer:
                # What follows an update is not its phase (the scaler's step unscaled).
                w.st.unscaled = False
                w.st.in_update = False
                # (not where the update raised: the script's error goes on as it is)
                if done and w.st.light and w.active and not w.st.replayed:
                    safely(w, _after_update, w, scaler_step)

    return run


def _after_update(w: Any, scaler_step: bool) -> None:
    """Where an update of a step checked by modules returns (see `updating`)."""
    if scaler_step and not w.st.inner_stepped:
        # The scaler found an infinity and skipped the update.
        if w.st.calls or not w.st.later_segment:
            w._replay()
        else:
            # (two optimizers stepped after one backward: the calls ran before the
            # first, which may have changed them)
            w.st.segment_note = True
    if w.st.light:
        w._new_segment()


def install(w: Any) -> None:
    """Replaces the methods of the watcher's scaler (when enabled) and optimizers."""
    stepped_by_scaler = None
    if w.scaler is not None and hasattr(w.scaler, "install"):
        # DeepSpeed's loss scaler: its optimizer's step scales, checks and skips
        w.scaler.install(w)
        stepped_by_scaler = w.scaler.optimizer
    elif w.scaler is not None:
        _install_scaler(w, w.scaler)
    _install_optimizers(w, stepped_by_scaler)


def _install_scaler(w: Any, sc: Any) -> None:
    """The scaler's update (where a step ends), scaling (not an op of the model), unscaling
    and step (an update, in the optimizer phase)."""
    orig_update = sc.update

    def update(*a, **k):
        if not w.active:
            return orig_update(*a, **k)
        w.busy = True
        try:
            found = found_inf(w.scaler)
            before = sc._scale.detach().clone() if sc._scale is not None else None
            # Whether a skip the step's checks did not see replays it (read with
            # the step: the parameters are as the calls since the last update had
            # them).
            replay = w.st.light and not w.st.replayed and (bool(w.st.calls) or not w.st.later_segment)
        except Exception:
            w.fail()
            return orig_update(*a, **k)
        finally:
            w.busy = False
        r = in_optimizer(w, orig_update)(*a, **k)
        safely(w, w._end_step, before, found, replay)
        return r

    w.patches.replace(sc, "update", _Wrapped(sc, "update", update))
    w.patches.replace(sc, "scale", _Wrapped(sc, "scale", scaling(w, sc.scale)))
    orig_unscale = in_optimizer(w, sc.unscale_)

    def unscale_(*a, **k):
        r = orig_unscale(*a, **k)
        w.st.unscaled = w.active
        return r

    w.patches.replace(sc, "unscale_", _Wrapped(sc, "unscale_", unscale_))
    w.patches.replace(sc, "step", _Wrapped(sc, "step", updating(w, sc.step, scaler_step=True)))


def scaling(w: Any, orig: Callable) -> Callable:
    """`orig`, a loss scaler's scaling of the loss (a GradScaler's `scale`, DeepSpeed's
    `scale_loss`), as the watcher runs it. The loss scaling is the scaler's, not a model op
    (amprobe's own runs record none either): neither it nor its gradient is recorded."""

    def scale(*a, **k):
        was, w.busy = w.busy, True
        try:
            if w.active and a and isinstance(a[0], torch.Tensor):
                safely(w, w._name_loss, a[0])
            out = orig(*a, **k)
        finally:
            w.busy = was
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            w.st.scaling_nodes.append(out.grad_fn)
        return out

    return scale


def _install_optimizers(w: Any, stepped_by_scaler: Any = None) -> None:
    """Each optimizer's step (an update; not the one whose step the scaler wrapped); with
    one optimizer, its `zero_grad` (a skipped batch's end: see `Watcher._abandon`)."""
    # The wrappers are bound methods, as the optimizer's own are: an LR scheduler made
    # after `watch` wraps `step` through its `__func__`.
    for opt in w.optimizers:
        if opt is not stepped_by_scaler:
            w.patches.replace(opt, "step", types.MethodType(stepping(w, opt), opt))
    if len(w.optimizers) == 1:
        opt = w.optimizers[0]
        orig_zero = opt.zero_grad

        def zero_grad(_opt, *a, **k):
            if w.active and not w.busy and not w.optimizer_depth and w.st.backwards and not w.st.updates:
                safely(w, w._abandon)
            return orig_zero(*a, **k)

        w.patches.replace(opt, "zero_grad", types.MethodType(zero_grad, opt))


def stepping(w: Any, opt: Any) -> Callable:
    """`opt.step` as the watcher runs it (an update, `_updating`); without a scaler the
    step ends where every optimizer has stepped."""
    before = opt.step
    orig = updating(w, before)
    key = id(opt)

    def step(_opt, *a, **k):
        w.st.inner_stepped = True
        r = orig(*a, **k)
        if w.active and w.scaler is None and not w.optimizer_depth:
            w.st.stepped.add(key)
            if len(w.st.stepped) == len(w.optimizers):
                safely(w, w._end_step, None, None)
        return r

    # The marks others left on the step it wraps (an LR scheduler made before `watch`
    # checks its own is still there).
    step.__dict__.update(getattr(getattr(before, "__func__", before), "__dict__", {}))
    return step


def found_inf(scaler: Any) -> Optional[torch.Tensor]:
    """The scaler's found-inf flags of this step, summed (on their device), or None."""
    states = getattr(scaler, "_per_optimizer_states", {})
    found = []
    for st in states.values():
        for v in st.get("found_inf_per_device", {}).values():
            found.append(v.detach().reshape(-1).to(torch.float64))
    return torch.cat(found).sum() if found else None
