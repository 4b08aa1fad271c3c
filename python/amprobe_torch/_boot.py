"""What a Python process started by `amprobe run|tui|compare|fix|baseline -- CMD` does at
its start, through the `sitecustomize.py` the CLI puts first on the command's PYTHONPATH
(beside the copy of this package it carries):

- it runs the `sitecustomize` the environment had, which the CLI's shadows, so that what
  that one does still happens;
- with AMPROBE_AUTO=1 (the CLI sets it), it waits for the script to import torch and then
  starts discovery (`_discover`), which finds what trains as the script makes it.

torch is not imported here: a process that never imports torch (a launcher, a shell
command) only runs the environment's `sitecustomize`, and this module stays the only trace
of amprobe in it. Under `torchrun` the launcher and every worker start this way; only the
workers train."""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Callable, Optional


def start(site_file: str) -> None:
    """Runs at the start of the process, from the CLI's `sitecustomize.py` at `site_file`."""
    site_dir = os.path.dirname(os.path.abspath(site_file))
    _chain(site_dir)
    from . import _env

    try:
        on = _env.auto() and not _env.disabled()
    except ValueError as e:
        # (the CLI refuses these before the command starts; a command started otherwise
        # runs unwatched, told why)
        sys.stderr.write(f"amprobe_torch: not watching: {e}\n")
        return
    if on:
        if "torch" in sys.modules:  # (imported by the environment's own sitecustomize)
            _start_discovery()
        else:
            sys.meta_path.insert(0, AfterImport("torch", _start_discovery))
            atexit.register(_report_without_torch)


def _report_without_torch() -> None:
    """At the exit of a process that never imported torch: its discovery report says so,
    naming this Python and whether torch is installed for it (the CLI's message where no
    trace was written), unless another process of the command wrote one."""
    path = os.environ.get("AMPROBE_DISCOVERY_REPORT")
    if not path or "torch" in sys.modules:
        return
    try:
        installed = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        installed = False
    message = f"{sys.executable or 'its Python'} (Python {sys.version.split()[0]}) never imported torch"
    if installed:
        message += (": a script that trains imports it; `amprobe_torch.watch(model, optimizer, scaler)` in the "
                    "script, before its training loop, also works")
    else:
        message += ", and cannot: torch is not installed for it (run the script with a Python that has torch)"
    try:
        import json

        with open(path, "x") as f:
            json.dump({"message": message, "seen": {"torch_installed": installed}}, f)
    except Exception:  # (a report that cannot be written only leaves the CLI's general word)
        pass


def _chain(site_dir: str) -> None:
    """Runs the environment's own `sitecustomize`, the first one on sys.path after the CLI's."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != site_dir]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # (as Python's own startup treats a failing sitecustomize)
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n{e!r}\n")


def _start_discovery() -> None:
    try:
        from . import _discover

        _discover.start()
    except Exception as e:  # never stop the script: it runs unwatched
        sys.stderr.write(f"amprobe_torch: discovery could not start ({e!r}); the script runs unwatched\n")


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then` once the module `name` has been imported, whoever imports it; the
    module's spec and loader are then the ones Python's own finders gave it."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then
        self.looking = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.name or self.looking:
            return None
        self.looking = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.looking = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, with `then` called after the module has run."""

    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # (the module's own loader from the start: the module may read it as it runs)
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
