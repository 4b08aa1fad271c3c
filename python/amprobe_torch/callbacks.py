"""Callbacks for trainings a library runs (the HF Trainer, Lightning), where the script never
holds the optimizer or the scaler and so has no place for the `watch` line: the callback,
added to the trainer's callbacks, calls `watch` as the training begins, with the model,
optimizer and scaler the trainer hands it, and closes the watcher as the training ends.

    trainer = transformers.Trainer(..., callbacks=[amprobe_torch.TrainerCallback()])
    trainer = lightning.Trainer(..., callbacks=[amprobe_torch.LightningCallback()])

Each class is made the first time it is asked for (`amprobe_torch.TrainerCallback`, or
`from amprobe_torch.callbacks import LightningCallback`), importing its library then and
only then: a Lightning script never imports transformers through amprobe, nor the reverse.
An error in a callback is written once on stderr and the training goes on, unwatched."""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

class _Watching:
    """What both callbacks share: `watch`'s options, the watcher the callback opened, and
    whether an error was already told (each callback tells one, so that a training that
    calls it at every epoch is not flooded)."""

    def __init__(self, owner: str, trace: Optional[str], sample_every: Optional[int], check: Optional[str]) -> None:
        if trace is not None and not isinstance(trace, str):
            trace = str(trace)
        if sample_every is not None and (not isinstance(sample_every, int) or sample_every < 0):
            raise ValueError(f"{owner}: sample_every must be a whole number of steps (0 or more), not {sample_every!r}")
        if check not in (None, "modules", "ops"):
            raise ValueError(f"{owner}: check must be `modules` or `ops`, not {check!r}")
        self.owner = owner
        self.options: Dict[str, Any] = {"trace": trace, "sample_every": sample_every, "check": check}
        self.watcher: Any = None
        self.reported = False

    def start(self, parts: Callable[[], Tuple[Any, Any, Any]]) -> None:
        """Watches the training that `parts` gives as (model, optimizer or optimizers,
        scaler). A watcher that was open before (the script's own `watch`) is used and
        left for its owner to close."""
        from . import _registry, watch

        try:
            model, optimizer, scaler = parts()
            before = [id(w) for w in _registry.WATCHERS]
            w = watch(model, optimizer, scaler, **self.options)
            self.watcher = w if w is not None and id(w) not in before else None
        except Exception as e:
            self.watcher = None
            self.report("could not start watching", e)

    def stop(self) -> None:
        """Closes the watcher this callback opened: the trace gets its end record, and the
        process is as if `watch` had never run."""
        w, self.watcher = self.watcher, None
        if w is None:
            return
        try:
            w.close()
        except Exception as e:
            self.report("could not close the watcher", e)

    def report(self, what: str, e: BaseException) -> None:
        """Tells the error on stderr, the first time only. Errors of what the callback was
        given (ValueError, TypeError: `watch`'s own refusals) are told in one line;
        anything else with its traceback, as it is the companion's own."""
        if self.reported:
            return
        self.reported = True
        line = f"amprobe_torch: {self.owner} {what} (the training goes on unwatched): {type(e).__name__}: {e}\n"
        if not isinstance(e, (ValueError, TypeError)):
            line += "".join(traceback.format_exception(type(e), e, e.__traceback__))
        sys.stderr.write(line)


def inner_optimizer(optimizer: Any) -> Tuple[Any, Optional[Any]]:
    """(the optimizer that does the update inside `optimizer`, the first scaler a wrapper
    on the way holds): Accelerate's `AcceleratedOptimizer` (and so the HF Trainer's) holds
    the torch optimizer as `.optimizer` and its GradScaler as `.scaler`; DeepSpeed's and
    Lightning's wrappers hold theirs as `.optimizer` too. `.optimizer` is followed while it
    holds an optimizer (something with `step` and `param_groups`), and so also through
    `AcceleratedOptimizer`, which is itself a `torch.optim.Optimizer` subclass whose
    `step` only passes the call on."""
    scaler = None
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not _optimizer_like(inner):
            break
        if scaler is None:
            scaler = getattr(optimizer, "scaler", None)
        optimizer = inner
    return optimizer, scaler


def _optimizer_like(o: Any) -> bool:
    return callable(getattr(o, "step", None)) and hasattr(o, "param_groups")


def _trainer_parts(model: Any, optimizer: Any) -> Tuple[Any, Any, Any]:
    if model is None:
        raise ValueError("the Trainer gave no model to on_train_begin")
    if optimizer is None:
        raise ValueError("the Trainer gave no optimizer to on_train_begin")
    opt, scaler = inner_optimizer(optimizer)
    return model, opt, scaler


def _lightning_parts(trainer: Any, pl_module: Any) -> Tuple[Any, Any, Any]:
    optimizers: List[Any] = [inner_optimizer(o)[0] for o in trainer.optimizers]
    if not optimizers:
        raise ValueError("the LightningModule's configure_optimizers gave no optimizer")
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    return pl_module, optimizers[0] if len(optimizers) == 1 else optimizers, scaler


def _make_trainer_callback() -> type:
    try:
        from transformers import TrainerCallback as Base
    except ImportError as e:
        raise ImportError("amprobe_torch.TrainerCallback needs transformers (pip install transformers)") from e

    class TrainerCallback(Base):
        """Watches an HF Trainer's training: `Trainer(..., callbacks=[amprobe_torch.TrainerCallback()])`.
        The options (`trace`, `sample_every`, `check`) are `watch`'s; unset, they are read
        from the environment as `watch` reads them."""

        def __init__(self, *, trace: Optional[str] = None, sample_every: Optional[int] = None,
                     check: Optional[str] = None) -> None:
            super().__init__()
            self._amprobe = _Watching("TrainerCallback", trace, sample_every, check)

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           optimizer: Any = None, **kwargs: Any) -> None:
            """Watches the model the Trainer trains with the torch optimizer inside its
            `AcceleratedOptimizer`, and that wrapper's GradScaler (fp16) or none."""
            self._amprobe.start(lambda: _trainer_parts(model, optimizer))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Closes the watcher: the trace ends with the training."""
            self._amprobe.stop()

    TrainerCallback.__module__ = __name__
    return TrainerCallback


def _lightning_base() -> type:
    """Lightning's `Callback` class: that of the package the script already imported
    (a `lightning` Trainer refuses a `pytorch_lightning` callback, and the reverse), else
    `lightning.pytorch`'s, else `pytorch_lightning`'s."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        order = ("pytorch_lightning", "lightning.pytorch")
    else:
        order = ("lightning.pytorch", "pytorch_lightning")
    for name in order:
        try:
            mod = __import__(name, fromlist=["Callback"])
        except ImportError:
            continue
        return mod.Callback
    raise ImportError("amprobe_torch.LightningCallback needs Lightning (pip install lightning)")


def _make_lightning_callback() -> type:
    Base = _lightning_base()

    class LightningCallback(Base):
        """Watches a Lightning training: `L.Trainer(..., callbacks=[amprobe_torch.LightningCallback()])`.
        The options (`trace`, `sample_every`, `check`) are `watch`'s; unset, they are read
        from the environment as `watch` reads them."""

        def __init__(self, *, trace: Optional[str] = None, sample_every: Optional[int] = None,
                     check: Optional[str] = None) -> None:
            super().__init__()
            self._amprobe = _Watching("LightningCallback", trace, sample_every, check)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            """Watches the LightningModule with the trainer's optimizers and its precision
            plugin's GradScaler (`16-mixed`) or none."""
            self._amprobe.start(lambda: _lightning_parts(trainer, pl_module))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            """Closes the watcher: the trace ends with the training."""
            self._amprobe.stop()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            """Closes the watcher of a training that raised, so the trace still ends (with
            the steps written) before Lightning tears down."""
            self._amprobe.stop()

    LightningCallback.__module__ = __name__
    return LightningCallback


_MAKERS: Dict[str, Callable[[], type]] = {
    "TrainerCallback": _make_trainer_callback,
    "LightningCallback": _make_lightning_callback,
}
__all__ = list(_MAKERS)


def __getattr__(name: str) -> type:
    """Makes `TrainerCallback` or `LightningCallback` the first time it is asked for (its
    library imported then), and keeps it."""
    make = _MAKERS.get(name)
    if make is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = make()
    globals()[name] = cls
    return cls
