"""Discovery: what trains, found as the script makes it, for a script that has no amprobe
line (run by `amprobe run -- CMD`, which sets AMPROBE_AUTO=1; see `_boot`).

- Every optimizer and GradScaler is noted as it is made: `torch.optim.Optimizer.__init__`
  and `torch.amp.GradScaler.__init__` are wrapped, which every optimizer and scaler runs
  (torch's own, the HF Trainer's and Accelerate's, Lightning's, `ShardedGradScaler`); the
  wrappers through which those libraries step them (`AcceleratedOptimizer`,
  `LightningOptimizer`) hold these, and so are seen through.
- The watcher is attached where the training's first forward begins: the first module
  call, with gradients enabled, of a module that holds a parameter an optimizer trains. By
  then every optimizer and scaler of a training has been made. The modules watched are
  the outermost modules that hold the optimizers' parameters, without the wrappers around
  them (DDP, FSDP, `torch.compile`'s `OptimizedModule`, Lightning's, DeepSpeed's), so that
  the trace uses the names the user's model has. A DeepSpeed engine's torch optimizer
  trains copies of the parameters: the engine's first forward attaches, to what the engine
  holds (`_deepspeed`).
- What it saw goes into the trace's header (`source.discovery`); where it was unsure
  (several models, several enabled scalers) it says so and gives the `watch` line that
  settles it. A process that attached to nothing writes what it saw to
  AMPROBE_DISCOVERY_REPORT at exit, for the CLI's message.

Until it attaches, discovery costs one global forward pre-hook; once attached, the wrapped
constructors and the hook are put back, and the watcher is what `watch` makes."""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import traceback
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _deepspeed, _registry

# Wrappers around a user's model, and the attribute that holds the model.
_WRAPPERS = {
    "DistributedDataParallel": "module",
    "FullyShardedDataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "_LightningModuleWrapperBase": "_forward_module",
    "_FabricModule": "_forward_module",
    "DeepSpeedEngine": "module",
    "DataParallel": "module",
}


class Discovery:
    """The state of discovery in this process (one: `_STATE`)."""

    def __init__(self) -> None:
        self.optimizers: List[weakref.ref] = []
        self.scalers: List[weakref.ref] = []
        self.param_ids: Optional[set] = None
        self.hook: Any = None
        self.undo: List[Tuple[Any, str, Any]] = []
        # The optimizers whose `step` discovery replaced, with what it put there
        # (`_first_step`).
        self.undo_steps: List[Tuple[weakref.ref, Any]] = []
        self.attached = False
        self.failed = False
        self.looking = False
        self.watcher: Any = None
        self.note: Optional[str] = None
        # Whether a model found was `torch.compile`'s `OptimizedModule` (taken off).
        self.compiled = False

    # ---- noting what is made

    def note_optimizer(self, opt: Any) -> None:
        self.optimizers.append(weakref.ref(opt))
        self.param_ids = None
        first = types.MethodType(_first_step(self, type(opt).step), opt)
        opt.step = first
        self.undo_steps.append((weakref.ref(opt), first))

    def note_scaler(self, sc: Any) -> None:
        self.scalers.append(weakref.ref(sc))

    def alive_optimizers(self) -> List[Any]:
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def alive_scalers(self) -> List[Any]:
        return [s for s in (r() for r in self.scalers) if s is not None]

    def trained_ids(self) -> set:
        """The ids of the parameters the optimizers train."""
        if self.param_ids is None:
            self.param_ids = {
                id(p) for o in self.alive_optimizers() for g in o.param_groups for p in g["params"]
            }
        return self.param_ids

    # ---- the first forward

    def on_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if self.attached or self.failed or self.looking or not self.optimizers or not torch.is_grad_enabled():
            return
        self.looking = True
        try:
            ids = self.trained_ids()
            if _deepspeed.is_engine(module) or (ids and any(id(p) in ids for p in module.parameters())):
                self.attach(module, args)
        except Exception:
            self.give_up()
        finally:
            self.looking = False

    def on_first_step(self) -> bool:
        """An optimizer's step begins before any forward was seen (Lightning's automatic
        optimization runs the forward and backward inside it, as its closure): attaches
        now. Returns whether it did."""
        if self.attached or self.failed:
            return False
        try:
            if not outermost_models(self.trained_ids()):
                # (a step of no module's parameters: DeepSpeed's fp16 optimizer steps its
                # fp32 copies once as it is made; its engine's forward attaches)
                return False
            self.attach(None, ())
        except Exception:
            self.give_up()
            return False
        return self.watcher is not None

    def attach(self, module: Optional[torch.nn.Module], args: tuple) -> None:
        """Watches what trains, from this call of `module` (or this optimizer step) on."""
        self.attached = True
        self.restore()
        if module is not None and _deepspeed.is_engine(module):
            # (DeepSpeed's torch optimizer trains its own copies of the parameters)
            model, opt, scaler, note = _deepspeed.parts(module)
            self.start([model], [opt], scaler, note, None, args)
            return
        models = outermost_models(self.trained_ids())
        scaler, note = choose_scaler(self.alive_scalers())
        if len(models) > 1:
            note = (note + "; " if note else "") + (
                f"{len(models)} models hold the optimizers' parameters and are watched together "
                f"({', '.join(type(m).__name__ for m in models)}); "
                "`amprobe_torch.watch(model, optimizer, scaler)` in the script names the one to watch"
            )
        self.start(models, self.alive_optimizers(), scaler, note, module, args)

    def start(
        self, models: List[torch.nn.Module], optimizers: List[Any], scaler: Any, note: Optional[str],
        module: Optional[torch.nn.Module], args: tuple,
    ) -> None:
        """Opens the watcher of `models`, unless the script watches its training itself;
        `module` is the call under way that the watcher's hooks did not see begin."""
        if any(_watches_any(w, models) for w in _registry.WATCHERS if not w.closed):
            return
        self.note = note
        from . import watch

        model: Any = models[0] if len(models) == 1 else named_models(models)
        w = watch(model, optimizers, scaler)
        if w is None:
            return
        w.discovery = {
            "models": [type(m).__name__ for m in models],
            "optimizers": [type(o).__name__ for o in optimizers],
            "scalers": [type(s).__name__ + ("" if s.is_enabled() else " (disabled)") for s in self.alive_scalers()],
            "scaler": scaler_name(scaler),
            "note": note,
        }
        self.watcher = w
        w.compiled_given = w.compiled_given or self.compiled
        if module is not None:
            # This call's own hooks were read before the watcher put its on: what they
            # would have seen, given by hand.
            w._call_enter(module, args, {})

    def give_up(self) -> None:
        """An error inside discovery: reported once, and the script runs unwatched."""
        self.failed = True
        sys.stderr.write(
            "amprobe_torch: discovery stopped after an internal error (training continues unwatched):\n"
            + traceback.format_exc()
        )
        try:
            self.restore()
        except Exception:
            pass

    def restore(self) -> None:
        """Puts back the constructors discovery wrapped and removes its hook."""
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
        self.undo = []
        for r, first in self.undo_steps:
            opt = r()
            # (a method that something else set later, an LR scheduler's wrapper, stays: it
            # calls the replacement, which then passes calls through)
            if opt is not None and vars(opt).get("step") is first:
                del opt.step
        self.undo_steps = []
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    # ---- at exit, when nothing was attached

    def seen(self) -> Dict[str, Any]:
        return {
            "optimizers": [type(o).__name__ for o in self.alive_optimizers()],
            "scalers": [type(s).__name__ for s in self.alive_scalers()],
            "attached": self.watcher is not None,
        }

    def report(self) -> None:
        path = os.environ.get("AMPROBE_DISCOVERY_REPORT")
        if not path or self.watcher is not None:
            return
        seen = self.seen()
        if "torch.distributed.run" in sys.modules or "torch.distributed.launch" in sys.modules:
            # (torchrun's launcher trains nothing: its workers say what they saw)
            return
        if not seen["optimizers"] and os.path.exists(path):
            # (a process that saw nothing, such as torchrun's launcher, leaves what a
            # worker saw)
            return
        if not seen["optimizers"]:
            message = (
                "the script imported torch but made no torch.optim optimizer, so nothing trained was found; "
                "a training whose optimizer is not a torch.optim.Optimizer is watched with "
                "`amprobe_torch.watch(model, optimizer, scaler)` in the script"
            )
        elif self.failed:
            message = "discovery stopped after an internal error (its message is in the script's output)"
        else:
            message = (
                f"the script made {', '.join(seen['optimizers'])} but no module holding its parameters ran a "
                "forward with gradients enabled, so no training step was seen; "
                "`amprobe_torch.watch(model, optimizer, scaler)` before the training loop settles it"
            )
        try:
            with open(path, "w") as f:
                json.dump({"message": message, "seen": seen}, f)
        except OSError:
            pass


def _first_step(state: Discovery, step: Any) -> Any:
    """An optimizer's `step` until discovery attaches (a bound method, as LR schedulers
    need): the call that attaches goes on through the watcher's `step`, later ones (the
    watcher's own among them) go to the class's."""

    def first_step(self, *a, **k):
        if state.on_first_step():
            current = vars(self).get("step")
            if current is not None and getattr(current, "__func__", None) is not first_step:
                return current(*a, **k)
        return step(self, *a, **k)

    return first_step


def _watches_any(w: Any, models: List[torch.nn.Module]) -> bool:
    watched = {id(m) for m in w.names.root.modules()}
    return any(id(m) in watched for m in models)


def outermost_models(trained: set) -> List[torch.nn.Module]:
    """The outermost modules holding a trained parameter (their wrappers taken off), in the
    order they were made."""
    holding = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), torch.nn.Module) and any(id(p) in trained for p in o.parameters())
    ]
    inner = {id(c) for m in holding for c in m.children()}
    out: List[torch.nn.Module] = []
    for m in holding:
        if id(m) in inner:
            continue
        m = unwrap(m)
        if not any(m is o for o in out):
            out.append(m)
    return out


def unwrap(m: torch.nn.Module) -> torch.nn.Module:
    """`m` without the wrappers around it."""
    for _ in range(8):
        attr = _WRAPPERS.get(type(m).__name__)
        inner = getattr(m, attr, None) if attr else None
        if not isinstance(inner, torch.nn.Module):
            return m
        if attr == "_orig_mod":
            _STATE.compiled = True
        m = inner
    return m


def named_models(models: List[torch.nn.Module]) -> Dict[str, torch.nn.Module]:
    """Several models by their class names (numbered where two share one)."""
    out: Dict[str, torch.nn.Module] = {}
    for m in models:
        name = type(m).__name__
        k, i = name, 1
        while k in out:
            i += 1
            k = f"{name}{i}"
        out[k] = m
    return out


def scaler_name(scaler: Any) -> Optional[str]:
    """The class of the scaler watched (DeepSpeed's loss scaler by its own)."""
    if scaler is None:
        return None
    return type(getattr(scaler, "ls", scaler)).__name__


def choose_scaler(scalers: List[Any]) -> Tuple[Optional[Any], Optional[str]]:
    """The enabled GradScaler, and a note where there were several (the last made is taken)."""
    enabled = [s for s in scalers if s.is_enabled()]
    if len(enabled) <= 1:
        return (enabled[0] if enabled else None), None
    return enabled[-1], (
        f"{len(enabled)} enabled GradScalers were made; the last made is taken; "
        "`amprobe_torch.watch(model, optimizer, scaler)` in the script names the one that scales the loss"
    )


_STATE = Discovery()


def _wrap_init(cls: type, note: Any) -> None:
    orig = cls.__dict__["__init__"]

    def __init__(self, *a, **k):
        orig(self, *a, **k)
        try:
            note(self)
        except Exception:
            _STATE.give_up()

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    __init__.__doc__ = orig.__doc__
    __init__.__name__ = orig.__name__
    __init__.__qualname__ = orig.__qualname__
    setattr(cls, "__init__", __init__)
    _STATE.undo.append((cls, "__init__", orig))


def start() -> None:
    """Starts discovery in this process (torch is imported)."""
    _wrap_init(torch.optim.Optimizer, _STATE.note_optimizer)
    _wrap_init(torch.amp.GradScaler, _STATE.note_scaler)
    _STATE.hook = torch.nn.modules.module.register_module_forward_pre_hook(_STATE.on_forward)
    atexit.register(_STATE.report)
