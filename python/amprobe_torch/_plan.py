"""The plan: what `amprobe compare -- CMD` and `amprobe fix -- CMD` (or a person) ask the
companion to change in the script's own process, read from the environment when `watch`
is called. The script itself is not edited; with none of these variables set, nothing is
changed.

    AMPROBE_AUTOCAST=fp16|bf16   every autocast region the script enters (context manager,
                                 decorator, torch.autocast, torch.amp.autocast,
                                 torch.cuda.amp.autocast, torch.cpu.amp.autocast) casts to
                                 this dtype; regions the script disables stay disabled. A
                                 script that enters none gets one around its model's
                                 forward. bf16 turns the GradScaler given to `watch` off
                                 (bf16 runs unscaled); fp16 turns a disabled one on with
                                 torch's defaults.
    AMPROBE_AUTOCAST=fp32        every autocast region is disabled, and the GradScaler given
                                 to `watch` is turned off: the script runs in fp32.
    AMPROBE_FP32_MODULES=a.b,c   the forward of every module whose dotted path matches one of
                                 these patterns runs outside autocast, on float32 inputs. A
                                 pattern matches a path that contains its segments in a row
                                 (`wo` matches `encoder.block.3.layer.1.DenseReluDense.wo`,
                                 `blocks.1` matches `blocks.1` and `blocks.1.up`; `*` is any
                                 one segment), as amprobe's own `--keep-fp32`.
    AMPROBE_INIT_SCALE=X         the GradScaler's initial loss scale (it must be enabled).

A value that cannot be applied (an unknown dtype, a pattern no module matches, a scale
without a scaler) is an error raised by `watch` that names the variable.
"""

from __future__ import annotations

import os
import sys
from typing import Any, List, Mapping, Optional, Sequence

import torch

from ._hooks import ModuleHook
from ._patches import Patches
from ._tree import map_tensors

AUTOCAST = "AMPROBE_AUTOCAST"
FP32_MODULES = "AMPROBE_FP32_MODULES"
INIT_SCALE = "AMPROBE_INIT_SCALE"
VARIABLES = (AUTOCAST, FP32_MODULES, INIT_SCALE)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# The dtype every autocast region is forced to ("fp16", "bf16"), "fp32" for none, or None:
# process-wide, as autocast's own state is.
_FORCED = None
_ORIG_ENTER = None


class Plan:
    """What to change: `autocast` ("fp16", "bf16", "fp32" or None), the module patterns to
    keep in fp32, the initial loss scale (or None)."""

    def __init__(
        self, autocast: Optional[str] = None, fp32_modules: Sequence[str] = (), init_scale: Optional[float] = None
    ) -> None:
        self.autocast = autocast
        self.fp32_modules = list(fp32_modules)
        self.init_scale = init_scale

    def __repr__(self) -> str:
        return f"Plan(autocast={self.autocast!r}, fp32_modules={self.fp32_modules!r}, init_scale={self.init_scale!r})"


def from_env(env: Optional[Mapping[str, str]] = None) -> Optional[Plan]:
    """The plan the environment asks for, or None when it asks for nothing. Raises
    ValueError naming the variable whose value is not understood."""
    env = os.environ if env is None else env
    autocast = (env.get(AUTOCAST) or "").strip().lower() or None
    if autocast is not None and autocast not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"{AUTOCAST}={env.get(AUTOCAST)!r}: expected fp16, bf16 or fp32")
    modules = [m.strip() for m in (env.get(FP32_MODULES) or "").split(",") if m.strip()]
    for m in modules:
        if not all(m.split(".")):
            raise ValueError(f"{FP32_MODULES}: `{m}` is not a dotted module path")
    scale = (env.get(INIT_SCALE) or "").strip() or None
    if scale is not None:
        try:
            scale = float(scale)
        except ValueError:
            scale = None
        if scale is None or not (scale > 0.0 and scale != float("inf")):
            raise ValueError(f"{INIT_SCALE}={env.get(INIT_SCALE)!r}: expected a positive finite number")
    if autocast is None and not modules and scale is None:
        return None
    return Plan(autocast, modules, scale)


def matches(pattern: str, path: str) -> bool:
    """amprobe's module pattern rule: `pattern`'s segments appear in a row in `path`'s
    (`*` matches any one segment)."""
    p = [s for s in pattern.split(".") if s]
    s = [x for x in path.split(".") if x]
    if not p or len(p) > len(s):
        return False
    return any(all(a == "*" or a == b for a, b in zip(p, s[i:])) for i in range(len(s) - len(p) + 1))


def _device_type(model: torch.nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")


def _forced_enter(self: Any) -> Any:
    """autocast's `__enter__` under the plan: the region's dtype or its switch is the
    plan's before autocast's own `__enter__` applies them."""
    forced = _FORCED
    if forced is not None and not torch.jit.is_scripting():
        if forced == "fp32":
            self._enabled = False
        elif self._enabled:
            self.fast_dtype = _DTYPES[forced]
    return _ORIG_ENTER(self)


def _force_autocast(kind: str, patches: Patches) -> None:
    global _FORCED, _ORIG_ENTER
    cls = torch.amp.autocast_mode.autocast
    if _ORIG_ENTER is None:
        # Subclasses (torch.cuda.amp.autocast, torch.cpu.amp.autocast, the unmanaged one
        # torch.export enters) call this `__enter__`; a decorator enters its instance at
        # each call, so instances made before `watch` are forced too.
        _ORIG_ENTER = cls.__enter__
        patches.replace(cls, "__enter__", _forced_enter)
        patches.on_undo(_unforce)
    _FORCED = kind


def _unforce() -> None:
    global _FORCED, _ORIG_ENTER
    _FORCED = _ORIG_ENTER = None


def _autocast_around_forward(model: torch.nn.Module, kind: str, patches: Patches) -> None:
    """Runs the model's forward under autocast(`kind`) when the script entered no autocast
    region of its own around it. The hooks go first, so that whatever reads autocast's
    state when the forward starts (the capture's precision) sees this one."""
    dev = _device_type(model)
    dtype = _DTYPES[kind]
    stack = []

    def enter(module, args):
        if torch.is_autocast_enabled(dev):
            stack.append(None)
            return
        ctx = torch.autocast(dev, dtype=dtype)
        ctx.__enter__()
        stack.append(ctx)

    def leave(module, args, out):
        ctx = stack.pop() if stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    patches.hold(model.register_forward_pre_hook(ModuleHook(enter, follows_copies=True), prepend=True))
    patches.hold(model.register_forward_hook(ModuleHook(leave, follows_copies=True), always_call=True))


def _to_fp32(x: Any) -> Any:
    return map_tensors(x, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


def _run_in_fp32(module: torch.nn.Module, device_type: str, patches: Patches) -> None:
    """Runs `module`'s forward outside autocast on float32 inputs, by hooks (a copy of the
    module, which carries them, runs as it does; a replaced `forward` would run the
    original's)."""
    stack = []

    def enter(m, args, kwargs):
        ctx = torch.autocast(device_type, enabled=False)
        ctx.__enter__()
        stack.append(ctx)
        return _to_fp32(args), _to_fp32(kwargs)

    def leave(m, args, out):
        if stack:
            stack.pop().__exit__(None, None, None)

    patches.hold(
        module.register_forward_pre_hook(ModuleHook(enter, follows_copies=True), with_kwargs=True, prepend=True)
    )
    patches.hold(module.register_forward_hook(ModuleHook(leave, follows_copies=True), always_call=True, prepend=True))


def _keep_in_fp32(model: torch.nn.Module, patterns: Sequence[str], patches: Patches) -> List[str]:
    names = [n for n, _ in model.named_modules() if n]
    missing = [p for p in patterns if not any(matches(p, n) for n in names)]
    if missing:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ValueError(
            f"{FP32_MODULES}: no module of {type(model).__name__} matches "
            f"{', '.join(f'`{m}`' for m in missing)} (its modules: {shown})"
        )
    dev = _device_type(model)
    kept = [n for n in names if any(matches(p, n) for p in patterns)]
    for n in kept:
        # A module inside a kept one already runs in fp32.
        if not any(n.startswith(k + ".") for k in kept):
            _run_in_fp32(model.get_submodule(n), dev, patches)
    return kept


def _enable_scaler(scaler: Any, init_scale: Optional[float]) -> None:
    """Turns a disabled GradScaler on with torch's defaults (and `init_scale`)."""
    dev = getattr(scaler, "_device", "cuda")
    fresh = torch.amp.GradScaler(dev, init_scale=init_scale if init_scale is not None else 2.0**16)
    scaler.__dict__.update(fresh.__dict__)


def apply(
    plan: Plan,
    model: torch.nn.Module,
    scaler: Optional[Any],
    called: Optional[Sequence[torch.nn.Module]] = None,
    patches: Optional[Patches] = None,
) -> List[str]:
    """Applies `plan` to the process, `model` and `scaler` (the GradScaler given to
    `watch`, or None); `called` are the modules the script calls when `model` only holds
    them (several models given to `watch`). Its hooks and its replacement of autocast's
    `__enter__` are made through `patches` (a `_patches.Patches`: the watcher's, undone
    when it closes); what it sets on the scaler is the training's state and stays.
    Returns the dotted paths of the modules kept in fp32."""
    if patches is None:
        patches = Patches()
    if plan.autocast is not None:
        _force_autocast(plan.autocast, patches)
        if plan.autocast in _DTYPES:
            for m in called or [model]:
                _autocast_around_forward(m, plan.autocast, patches)
    if scaler is not None:
        if plan.autocast in ("bf16", "fp32") and scaler.is_enabled():
            scaler._enabled = False
        elif plan.autocast == "fp16" and not scaler.is_enabled():
            _enable_scaler(scaler, plan.init_scale)
    elif plan.autocast == "fp16":
        sys.stderr.write(
            f"amprobe_torch: {AUTOCAST}=fp16 and no GradScaler given to watch: the loss is not scaled\n"
        )
    if plan.init_scale is not None:
        if scaler is None or not scaler.is_enabled():
            raise ValueError(
                f"{INIT_SCALE}: needs an enabled GradScaler given to watch(model, optimizer, scaler)"
                + (f" ({AUTOCAST}={plan.autocast} runs without one)" if plan.autocast in ("bf16", "fp32") else "")
            )
        scaler._init_scale = float(plan.init_scale)
        if scaler._scale is not None:
            scaler._scale.fill_(float(plan.init_scale))
    kept = []
    if plan.fp32_modules:
        kept = _keep_in_fp32(model, plan.fp32_modules, patches)
    return kept


def is_transformers(model: Any) -> bool:
    """Whether `model` is a transformers PreTrainedModel (told without importing
    transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(model).__mro__
    )
