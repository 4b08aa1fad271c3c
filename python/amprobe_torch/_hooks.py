"""Hooks the companion puts on the script's modules, safe to copy and to pickle: a module
copied by `copy.deepcopy` (an EMA model, a teacher) or saved whole by `torch.save` carries
its hooks along, and the watcher behind them is neither copyable nor picklable."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple


class ModuleHook:
    """Calls `f` with what the module passes its hook. A deep copy is a hook that does
    nothing (the copy is not watched) unless `follows_copies` (the plan's hooks: a copy of
    a module runs as the module does); a pickled one, loaded, does nothing."""

    __slots__ = ("f", "follows_copies")

    def __init__(self, f: Optional[Callable[..., Any]] = None, follows_copies: bool = False) -> None:
        self.f = f
        self.follows_copies = follows_copies

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        f = self.f
        return None if f is None else f(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> ModuleHook:
        return self if self.follows_copies else ModuleHook()

    def __reduce__(self) -> Tuple[type, Tuple[()]]:
        return (ModuleHook, ())
