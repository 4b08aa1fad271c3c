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

The dtype is forced wherever autocast's state is: in a region the script entered before the
plan was applied (Lightning enters its autocast before the forward where discovery attaches),
in one a nested region's exit restored, and at every module's forward start (a state set by
torch.set_autocast_enabled / set_autocast_dtype rather than entered).

A value that cannot be applied (an unknown dtype, a pattern no module matches, a scale
without a scaler), or an AMPROBE_AUTOCAST that could not take (a model made 16-bit itself,
FSDP2's MixedPrecisionPolicy casting the parameters under fp32), is a `PlanError` (a
ValueError) raised by `watch` before anything is changed, naming the variable and the cause.
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
_ORIG_EXIT = None


class PlanError(ValueError):
    """A plan that cannot be applied, or would not take: the message names the variable and
    why."""


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
    PlanError naming the variable whose value is not understood."""
    env = os.environ if env is None else env
    autocast = (env.get(AUTOCAST) or "").strip().lower() or None
    if autocast is not None and autocast not in ("fp16", "bf16", "fp32"):
        raise PlanError(f"{AUTOCAST}={env.get(AUTOCAST)!r}: expected fp16, bf16 or fp32")
    modules = [m.strip() for m in (env.get(FP32_MODULES) or "").split(",") if m.strip()]
    for m in modules:
        if not all(m.split(".")):
            raise PlanError(f"{FP32_MODULES}: `{m}` is not a dotted module path")
    scale = (env.get(INIT_SCALE) or "").strip() or None
    if scale is not None:
        try:
            scale = float(scale)
        except ValueError:
            scale = None
        if scale is None or not (scale > 0.0 and scale != float("inf")):
            raise PlanError(f"{INIT_SCALE}={env.get(INIT_SCALE)!r}: expected a positive finite number")
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


def _forced_exit(self: Any, *exc: Any) -> Any:
    """autocast's `__exit__` under the plan: the state it restores (an enclosing region's,
    which may have been entered before the plan) is made the plan's."""
    out = _ORIG_EXIT(self, *exc)
    if not torch.jit.is_scripting():
        _force_state(self.device)
    return out


def _force_state(device_type: str) -> None:
    """Makes autocast's current state on `device_type` the plan's: off under fp32, the
    plan's dtype where it is on."""
    forced = _FORCED
    if forced is None or not torch.is_autocast_enabled(device_type):
        return
    if forced == "fp32":
        torch.set_autocast_enabled(device_type, False)
    elif torch.get_autocast_dtype(device_type) != _DTYPES[forced]:
        torch.set_autocast_dtype(device_type, _DTYPES[forced])
    else:
        return
    # (what the region cast and cached before must not serve it now)
    torch.clear_autocast_cache()


def _force_autocast(kind: str, model: torch.nn.Module, patches: Patches) -> None:
    global _FORCED, _ORIG_ENTER, _ORIG_EXIT
    cls = torch.amp.autocast_mode.autocast
    if _ORIG_ENTER is None:
        # Subclasses (torch.cuda.amp.autocast, torch.cpu.amp.autocast, the unmanaged one
        # torch.export enters) call these; a decorator enters its instance at each call,
        # so instances made before `watch` are forced too.
        _ORIG_ENTER, _ORIG_EXIT = cls.__enter__, cls.__exit__
        patches.replace(cls, "__enter__", _forced_enter)
        patches.replace(cls, "__exit__", _forced_exit)
        patches.on_undo(_unforce)
    _FORCED = kind
    devices = _autocast_devices(_device_type(model))
    # A region already entered (the call under way when discovery attaches) is forced now;
    # one set without torch.autocast where a module's forward starts.
    for d in devices:
        _force_state(d)

    def at_forward(module: torch.nn.Module, args: Any) -> None:
        for d in devices:
            _force_state(d)

    patches.hold(torch.nn.modules.module.register_module_forward_pre_hook(at_forward))


def _autocast_devices(dev: str) -> List[str]:
    """The device types whose autocast state the plan forces: the model's, and the CPU's
    and CUDA's (autocast knows them on every build)."""
    out = []
    for d in dict.fromkeys((dev, "cpu", "cuda")):
        try:
            torch.is_autocast_enabled(d)
        except RuntimeError:  # (a device type autocast does not know)
            continue
        out.append(d)
    return out


def _unforce() -> None:
    global _FORCED, _ORIG_ENTER, _ORIG_EXIT
    _FORCED = _ORIG_ENTER = _ORIG_EXIT = None


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


def _made_16_bit(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The 16-bit dtype most of the model's parameters (by count of values) are in, or None:
    a model made 16-bit itself, which autocast's dtype does not change."""
    by_dtype: dict = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    most = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return most if most in (torch.float16, torch.bfloat16) else None


def _deepspeed_precision(model: torch.nn.Module) -> Optional[str]:
    """The precision of the DeepSpeed engine that holds `model` (`fp16`, `bf16`), or None
    where none does or its config sets none."""
    from ._deepspeed import HELD  # (torch-only: DeepSpeed itself is never imported)

    return HELD.get(model)


def _fsdp_param_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype FSDP2's MixedPrecisionPolicy casts the model's parameters to at each
    all-gather (outside autocast), or None where no `fully_shard` policy casts them."""
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        try:
            dtype = get()._mp_policy.param_dtype
        except Exception:  # (an FSDP2 version without these internals: nothing known)
            continue
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
    return None


def _autocast_refusal(plan: Plan, model: torch.nn.Module) -> Optional[str]:
    """Why `plan.autocast` could not take on `model`, or None."""
    from ._step_record import model_name  # (it imports this module)

    name = model_name(model)
    low = _made_16_bit(model)
    held = _deepspeed_precision(model)
    if low is not None and held is not None:
        return (
            f"{AUTOCAST}={plan.autocast}: DeepSpeed's `{held}` config made {name}'s parameters {low} itself "
            "(the engine casts the module; no autocast region runs), which the plan does not change: "
            f"set the precision in the DeepSpeed config (\"{held}\": {{\"enabled\": false}}) to run it otherwise"
        )
    if low is not None:
        return (
            f"{AUTOCAST}={plan.autocast}: most of {name}'s parameters are {low} (the model itself was made "
            "16-bit: model.half(), .bfloat16(), from_pretrained(torch_dtype=...)), which autocast's dtype "
            "does not change; the plan sets autocast only"
        )
    low = _fsdp_param_dtype(model) if plan.autocast == "fp32" else None
    if low is not None:
        return (
            f"{AUTOCAST}=fp32: FSDP2's MixedPrecisionPolicy(param_dtype={low}) casts {name}'s parameters to "
            f"{low} at each all-gather, outside autocast, which the plan does not change (the plan sets "
            "autocast only; fully_shard without that policy trains in fp32)"
        )
    return None


def _refusal(plan: Plan, model: torch.nn.Module, scaler: Optional[Any]) -> Optional[str]:
    """Why `plan` cannot be applied to `model` and `scaler`, or would not take; None when
    it can."""
    if plan.autocast is not None:
        why = _autocast_refusal(plan, model)
        if why is not None:
            return why
    if plan.init_scale is not None:
        # (the scaler as the plan leaves it: bf16 and fp32 turn it off, fp16 on)
        scaled = scaler is not None and (plan.autocast == "fp16" or (plan.autocast is None and scaler.is_enabled()))
        if not scaled:
            return (
                f"{INIT_SCALE}: needs an enabled GradScaler given to watch(model, optimizer, scaler)"
                + (f" ({AUTOCAST}={plan.autocast} runs without one)" if plan.autocast in ("bf16", "fp32") else "")
            )
    names = [n for n, _ in model.named_modules() if n]
    missing = [p for p in plan.fp32_modules if not any(matches(p, n) for n in names)]
    if missing:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        return (
            f"{FP32_MODULES}: no module of {type(model).__name__} matches "
            f"{', '.join(f'`{m}`' for m in missing)} (its modules: {shown})"
        )
    return None


def _apply_to_scaler(plan: Plan, scaler: Optional[Any]) -> None:
    if scaler is not None:
        if plan.autocast in ("bf16", "fp32") and scaler.is_enabled():
            scaler._enabled = False
        elif plan.autocast == "fp16" and not scaler.is_enabled():
            _enable_scaler(scaler, plan.init_scale)
    elif plan.autocast == "fp16":
        sys.stderr.write(
            f"amprobe_torch: {AUTOCAST}=fp16 and no GradScaler given to watch: the loss is not scaled\n"
        )
    if plan.init_scale is not None and hasattr(scaler, "set_init_scale"):
        scaler.set_init_scale(plan.init_scale)  # (DeepSpeed's loss scaler)
    elif plan.init_scale is not None:
        scaler._init_scale = float(plan.init_scale)
        if scaler._scale is not None:
            scaler._scale.fill_(float(plan.init_scale))


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
    `__enter__` and `__exit__` are made through `patches` (a `_patches.Patches`: the
    watcher's, undone when it closes); what it sets on the scaler is the training's state
    and stays. A plan that cannot be applied raises PlanError before anything is changed.
    Returns the dotted paths of the modules kept in fp32."""
    why = _refusal(plan, model, scaler)
    if why is not None:
        raise PlanError(why)
    if patches is None:
        patches = Patches()
    if plan.autocast is not None:
        _force_autocast(plan.autocast, model, patches)
        if plan.autocast in _DTYPES:
            for m in called or [model]:
                _autocast_around_forward(m, plan.autocast, patches)
    _apply_to_scaler(plan, scaler)
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
