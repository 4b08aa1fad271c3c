"""amprobe's PyTorch companion: two lines in a training script capture its real AMP steps,
op by op, as an amprobe trace that `amprobe report`, `tui`, `compare` and `--fail-on` read.

    import amprobe_torch
    amprobe_torch.watch(model, optimizer, scaler)   # scaler optional; before the loop

Environment:
    AMPROBE_TRACE         the trace's path (default amprobe-trace.jsonl; `.rank{N}` is put
                          before the suffix in a distributed run of more than one rank)
    AMPROBE_DISABLE=1     `watch` does nothing
    AMPROBE_SAMPLE_EVERY  keep full op records every N steps besides the first (default 0:
                          the first step only; steps with a non-finite value keep theirs)
    AMPROBE_CHECK         how steps whose records are not kept are checked: `modules`
                          (default: every module's output, the script's own ops, the loss
                          and the gradients; a failing step is replayed op by op) or `ops`
                          (every op, as a kept step sees them, at a higher cost)

The plan (`amprobe compare -- CMD` and `amprobe fix -- CMD` set it; see _plan.py): with none
of these set, watching changes nothing.
    AMPROBE_AUTOCAST      fp16 or bf16: every autocast region casts to it; fp32: autocast off
    AMPROBE_FP32_MODULES  comma-separated module patterns whose forward runs outside autocast
    AMPROBE_INIT_SCALE    the GradScaler's initial loss scale
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import traceback
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ._version import TOOL_VERSION

if TYPE_CHECKING:  # (torch is imported where watching begins: see _boot)
    from . import _capture

# (not the callbacks: `from amprobe_torch import *` must not import transformers and
# Lightning; `amprobe_torch.TrainerCallback` and `.LightningCallback` are there to ask for)
__all__ = ["watch", "watching"]
__version__ = TOOL_VERSION


def watch(
    model: Any,
    optimizer: Any,
    scaler: Optional[Any] = None,
    *,
    trace: Optional[str] = None,
    sample_every: Optional[int] = None,
    check: Optional[str] = None,
) -> Optional[_capture.Watcher]:
    """Captures the training of `model` by `optimizer` (and `scaler`, a GradScaler, when the
    script uses one) from now on. Several models trained together (a GAN's generator and
    discriminator) are given as a dict of them, named by its keys in the trace (or a list,
    named by position); several optimizers as a list. Steps end at `scaler.update()` when
    the scaler is enabled (a skipped step never reaches `optimizer.step()`), else when
    every optimizer given has stepped. Called again with what it already watches (in an
    epoch loop), it returns the open watcher; a model already watched with other optimizers
    or another scaler, or a trace path an open watcher writes, raises ValueError. Returns
    the watcher (its `close()` ends the trace and undoes every hook and replaced function;
    it is also called at exit), or None when
    AMPROBE_DISABLE=1. A plan in the environment (AMPROBE_AUTOCAST, AMPROBE_FP32_MODULES,
    AMPROBE_INIT_SCALE) is applied first; a value it cannot apply raises ValueError."""
    from . import _env

    if _env.disabled():
        return None
    from . import _attach, _capture, _plan, _registry
    from ._patches import Patches

    if sample_every is None:
        sample_every = _env.sample_every()
    elif isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 0:
        raise ValueError(f"watch: sample_every= takes a whole number of steps, 0 or more, not {sample_every!r}")
    if check is None:
        check = _env.check()
    elif check not in ("modules", "ops"):
        raise ValueError(f"watch: check= takes `modules` or `ops`, not {check!r}")
    root, called = _attach.gather_models(model)
    optimizers = _attach.gather_optimizers(optimizer)
    path = trace or _attach.trace_path()
    # (before the plan: a second watch of the same training must not apply it twice)
    already = _attach.open_watcher(called, optimizers, scaler, path)
    if already is not None:
        return already
    plan = _plan.from_env()
    patches = Patches()
    if plan is not None:
        _plan.apply(plan, root, scaler, called, patches)
    try:
        w = _capture.Watcher(root, called, optimizers, scaler, path, sample_every, check, patches)
    except Exception:  # the companion's own error: the training goes on, unwatched
        patches.undo()
        sys.stderr.write(
            "amprobe_torch: watch could not start after an internal error (training continues unwatched):\n"
            + traceback.format_exc()
        )
        return None
    _registry.WATCHERS.append(w)
    atexit.register(w.close)
    return w


@contextlib.contextmanager
def watching(
    model: Any,
    optimizer: Any,
    scaler: Optional[Any] = None,
    **options: Any,
) -> Iterator[Optional[_capture.Watcher]]:
    """`watch` for the block it encloses: the watcher (or None when AMPROBE_DISABLE=1) is
    closed where the block ends, however it ends, and the process is then as if `watch`
    had never run. Where `watch` finds the same training watched already (an open watcher
    it returns), that watcher stays open.

        with amprobe_torch.watching(model, optimizer, scaler):
            train()
    """
    from . import _registry

    before = [id(x) for x in _registry.WATCHERS]
    w = watch(model, optimizer, scaler, **options)
    try:
        yield w
    finally:
        # (a watcher that was open before the block is the script's to close)
        if w is not None and id(w) not in before:
            w.close()


def __getattr__(name: str) -> Any:
    """`TrainerCallback` (the HF Trainer's) and `LightningCallback`, from `callbacks` the
    first time one is asked for: importing amprobe_torch imports neither transformers nor
    Lightning (nor torch), as it runs at the start of every Python that amprobe runs."""
    if name in ("TrainerCallback", "LightningCallback"):
        from . import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
