"""What the training libraries around a script say of it, read from their own objects
without changing them: the precision a stack was asked for (Accelerate's and so the HF
Trainer's `mixed_precision`, Lightning's `precision`), and the Accelerate optimizer wrapper
that steps an optimizer through a method it saved before the watcher replaced it. Nothing
here imports a library the script did not import."""

from __future__ import annotations

import gc
import sys
from typing import Any, List, Optional, Tuple


def requested_precision() -> Optional[Tuple[str, str]]:
    """(the 16-bit precision the stack was asked for, which stack), or None where no stack
    asked for one."""
    for read in (_accelerate_precision, _lightning_precision):
        try:
            got = read()
        except Exception:  # (a library version this does not know: nothing asked)
            got = None
        if got is not None:
            return got
    return None


def _accelerate_precision() -> Optional[Tuple[str, str]]:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    shared = state.AcceleratorState._shared_state
    mp = shared.get("_mixed_precision") if hasattr(shared, "get") else None
    if mp in ("fp16", "bf16", "fp8"):
        by = "the HF Trainer's Accelerator" if "transformers.trainer" in sys.modules else "Accelerate"
        return str(mp), f"{by} (mixed_precision={mp!r})"
    return None


def _lightning_precision() -> Optional[Tuple[str, str]]:
    bases = []
    for name in ("lightning.pytorch.plugins.precision", "pytorch_lightning.plugins.precision"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "Precision"):
            bases.append(mod.Precision)
    if not bases:
        return None
    for o in gc.get_objects():
        if issubclass(type(o), tuple(bases)):
            p = str(getattr(o, "precision", ""))
            if p.startswith("16") or p.startswith("bf16"):
                return ("fp16" if p.startswith("16") else "bf16"), f"Lightning (precision={p!r})"
    return None


def adopt_accelerate(w: Any) -> None:
    """An `AcceleratedOptimizer` with a scaler made before the watcher (the HF Trainer's and
    Accelerate's under fp16) steps its optimizer through the `step` it saved when it was
    made, which the watcher's does not wrap: the saved methods are made the watcher's (put
    back at close)."""
    mod = sys.modules.get("accelerate.optimizer")
    if mod is None:
        return
    ours = {id(o): o for o in w.optimizers}
    wrappers: List[Any] = [
        o for o in gc.get_objects() if issubclass(type(o), mod.AcceleratedOptimizer) and id(getattr(o, "optimizer", None)) in ours
    ]
    for acc in wrappers:
        if getattr(acc, "scaler", None) is None or not hasattr(acc, "_optimizer_original_step_method"):
            continue
        step = acc.optimizer.step
        w.patches.replace(acc, "_optimizer_original_step_method", step)
        w.patches.replace(acc, "_optimizer_patched_step_method", mod.patch_optimizer_step(acc, step))
