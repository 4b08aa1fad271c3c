"""DeepSpeed: its engine holds the model, its optimizer wraps the torch one, and under
fp16 its loss scaler scales the loss, checks the gradients and skips the update inside the
engine's `backward` and `step`, where no GradScaler method is called.

- The torch optimizer inside trains copies DeepSpeed made (fp32 master weights, flat
  partitions under ZeRO), not the model's parameters: discovery finds the training through
  the engine itself (`is_engine`, `parts`) at its first forward.
- The watcher is given DeepSpeed's optimizer (its `step` is where an update is applied or
  skipped and where a step ends) and, under fp16, `LossScaler`: DeepSpeed's loss scaler
  read as the watcher reads a GradScaler (the scale as a 0-d tensor, the steps since the
  last overflow as its growth tracker). `LossScaler.install` puts the watcher where
  DeepSpeed scales the loss (`scale_loss` of its loss scaler: not a model op, as a
  GradScaler's `scale` is not) and where its optimizer steps (the update, whose skip is
  DeepSpeed's `overflow`).

This is DeepSpeed's loss scaler as its ZeRO optimizers (stages 1 to 3) apply it. Its fp16
optimizers without ZeRO keep their scale elsewhere (`loss_scale_config`) and, in DeepSpeed
0.19, have `engine.backward` apply none: they are watched without a scaler (the summary
says so through the discovery note)."""

from __future__ import annotations

import types
import weakref
from typing import Any, Optional, Tuple

import torch

from ._intercept import _Wrapped, scaling, updating
from ._patches import safely

# The modules a DeepSpeed engine holds, with the engine's precision (`fp16`, `bf16` or None):
# its config, not autocast, sets the dtype of their parameters.
HELD: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[str]]" = weakref.WeakKeyDictionary()


def is_engine(m: Any) -> bool:
    """Whether `m` is a DeepSpeed engine (or a subclass: the pipeline engine), told
    without importing DeepSpeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.") for c in type(m).__mro__)


def parts(engine: Any) -> Tuple[torch.nn.Module, Any, Optional["LossScaler"], Optional[str]]:
    """(the model, the optimizer that steps it, the loss scaler when DeepSpeed scales the
    loss, a note where what was found is not watched as it trains)."""
    opt = engine.optimizer
    if opt is None or not hasattr(opt, "param_groups"):
        raise ValueError("the DeepSpeed engine has no optimizer")
    note = None
    scaler = None
    fp16 = bool(engine.fp16_enabled())
    bf16 = bool(getattr(engine, "bfloat16_enabled", lambda: False)())
    HELD[engine.module] = "fp16" if fp16 else "bf16" if bf16 else None
    ls = getattr(opt, "loss_scaler", None)
    if fp16 and ls is not None and hasattr(ls, "cur_scale") and hasattr(ls, "scale_loss"):
        scaler = LossScaler(opt, ls)
    elif fp16:
        note = (
            f"DeepSpeed's {type(opt).__name__} (fp16 without ZeRO) keeps its loss scale where the companion "
            "does not read it: its skipped steps are not told apart; ZeRO stage 1 or 2 is watched with its scaler"
        )
    return engine.module, opt, scaler, note


class LossScaler:
    """DeepSpeed's loss scaler (`DynamicLossScaler` or the static `LossScaler`) of the
    optimizer `opt`, as the watcher reads a GradScaler."""

    def __init__(self, opt: Any, ls: Any) -> None:
        self.optimizer = opt
        self.ls = ls
        self._init_scale = float(ls.cur_scale)
        dynamic = bool(getattr(ls, "dynamic", False))
        factor = float(getattr(ls, "scale_factor", 1.0)) if dynamic else 1.0
        self._growth_factor = factor
        self._backoff_factor = 1.0 / factor
        self._growth_interval = int(getattr(ls, "scale_window", 0)) if dynamic else 0
        self.hysteresis = int(getattr(ls, "delayed_shift", 1)) if dynamic else None
        # (found-inf flags are DeepSpeed's `overflow`, given where its step returns)
        self._per_optimizer_states: dict = {}

    def is_enabled(self) -> bool:
        return True

    def set_init_scale(self, scale: float) -> None:
        """Starts the loss scale at `scale` (the plan's AMPROBE_INIT_SCALE), as the config's
        `initial_scale_power` would."""
        self.ls.cur_scale = float(scale)
        self._init_scale = float(scale)

    @property
    def _scale(self) -> torch.Tensor:
        return torch.tensor(float(self.ls.cur_scale), dtype=torch.float32)

    @property
    def _growth_tracker(self) -> torch.Tensor:
        ls = self.ls
        since = getattr(ls, "cur_iter", 0) - getattr(ls, "last_overflow_iter", -1) - 1
        return torch.tensor(max(0, int(since)), dtype=torch.int32)

    def describe(self) -> dict:
        return {
            "kind": type(self.ls).__name__,
            "init_scale": self._init_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "hysteresis": self.hysteresis,
        }

    def install(self, w: Any) -> None:
        """The loss scaling (not recorded, its node named as the scaling's) and the
        optimizer's step (an update, in the optimizer phase, and where the step ends)."""
        self._install_scaling(w)
        self._install_step(w)

    def _install_scaling(self, w: Any) -> None:
        scale_loss = scaling(w, self.ls.scale_loss)
        w.patches.replace(self.ls, "scale_loss", _Wrapped(self.ls, "scale_loss", scale_loss))

    def _install_step(self, w: Any) -> None:
        opt = self.optimizer
        orig = opt.step

        def applied(*a, **k):
            r = orig(*a, **k)
            # (DeepSpeed skips the update inside its step: `overflow` tells)
            w.st.inner_stepped = not bool(getattr(opt, "overflow", False))
            return r

        update = updating(w, applied, scaler_step=True)

        def step(_opt, *a, **k):
            if not w.active or w.busy or w.optimizer_depth:
                return orig(*a, **k)
            before = self._scale
            r = update(*a, **k)
            found = torch.tensor(1.0 if getattr(opt, "overflow", False) else 0.0, dtype=torch.float64)
            replay = w.st.light and not w.st.replayed and (bool(w.st.calls) or not w.st.later_segment)
            safely(w, w._end_step, before, found, replay)
            return r

        w.patches.replace(opt, "step", types.MethodType(step, opt))
