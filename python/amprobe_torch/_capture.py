"""The capture: every ATen op of the user's steps seen through a TorchDispatchMode, named by
the module that ran it (forward: the innermost module whose forward is running; backward:
the module whose forward made the autograd node running it), reduced on its device, read
back once per step and written as an amprobe step record."""

import bisect
import contextlib
import functools
import gc
import os
import sys
import threading
import time
import traceback
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

try:
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover - older torch: the mode sees the step's own figures
    _disable_current_modes = contextlib.nullcontext

from . import _plan, _stats
from ._hooks import ModuleHook
from ._params import Scratch, begin_param_vectors
from ._trace import SCHEMA_VERSION, TraceWriter, jfloat
from ._tree import leaves, map_tensors

TOOL_VERSION = "0.1.0"


def _key(t):
    """Identity of a tensor's values within a step: where they are and how they are laid out
    (the Python objects that reach the dispatcher are not stable). Plain values only (the
    shape as a tuple, not a `torch.Size`), so that the garbage collector stops tracking it."""
    t = _stats.local(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


# Autograd's sequence number counter of this thread (the number the next node gets), where
# this torch has it.
_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None)

# An op with this many tensor inputs or more (a multi-tensor op) has its unchecked inputs
# on a device checked together.
_BATCHED_INPUTS = 8

def _mask_like(x):
    """A scalar that masks: -inf or a dtype's most negative value."""
    return x == float("-inf") or x <= -65504.0


def _meta(m):
    """A record's tensor description of a (dtype, shape) pair."""
    return {"dtype": _stats.DTYPE_NAMES[m[0]], "shape": list(m[1])}


def _own_name(name):
    """A module or parameter name without FSDP's inner wrappers."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")


class _Names:
    """Module names as the model names them: a stack of the modules whose forward is running
    (global module hooks), and for the backward, the module whose forward made each autograd
    node."""

    def __init__(self, model):
        # A DDP or FSDP wrapper's names carry its `module.` prefix and FSDP's inner
        # wrappers their `_fsdp_wrapped_module`; the user's model's names have neither.
        root = _unwrapped(model)
        self.root = root
        self.names = {id(m): _own_name(n) for n, m in root.named_modules()}
        if id(model) not in self.names:
            self.names[id(model)] = ""
        self.params = {}
        for n, p in root.named_parameters():
            self.params[id(p)] = _own_name(n).rpartition(".")[0]
        self.stack = []
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module, args):
        name = self.names.get(id(module))
        self.stack.append(type(module).__name__ if name is None else name)

    def _leave(self, module, args, out):
        if self.stack:
            self.stack.pop()

    def current(self):
        return self.stack[-1] if self.stack else ""

    def of_node(self, node):
        """The module of a parameter's gradient accumulation, or None."""
        var = getattr(node, "variable", None)
        return None if var is None else self.params.get(id(var))

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


class _Mode(TorchDispatchMode):
    """Sees every ATen op; inside `__torch_dispatch__` the mode is off, so the statistics'
    own ops are not seen."""

    def __init__(self, watcher):
        super().__init__()
        self.watcher = watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        w = self.watcher
        kwargs = kwargs or {}
        if w.light and not w.busy:
            # A step checked by modules: the model's own ops, forward and backward, only run
            # (a replay records them if the step fails); the script's ops around the model
            # (its loss, their gradients) and the optimizer's are recorded as always. The
            # mode is normally off the stack for the model's ops (`Watcher._pause`); this is
            # for when another mode above it kept it there.
            if w.tree_depth:
                return func(*args, **kwargs)
            if not w.optimizer_depth and torch._C._current_graph_task_id() != -1:
                node = torch._C._current_autograd_node()
                if node is None or node not in w.loss_nodes:
                    return func(*args, **kwargs)
        seen = None
        if w.active and not w.busy:
            w.busy = True
            try:
                seen = w.read_inputs(func, args, kwargs)
            except Exception:  # never kill the user's training
                w.fail()
            finally:
                w.busy = False
        out = func(*args, **kwargs)
        if seen is not None and w.active and not w.busy:
            w.busy = True
            try:
                w.on_op(func, seen, out, args, kwargs)
            except Exception:
                w.fail()
            finally:
                w.busy = False
        return out


# A step checked by modules holds its model calls' inputs until it ends; past this many
# calls in one step it stops (and, if the step fails, says it could not replay it).
MAX_CALLS = 64

# Module outputs checked together (on a device, by a few multi-tensor kernels).
_OUTPUTS_BATCH = 32


def _sharded(model):
    """Whether the model's parameters are sharded across ranks (FSDP or FSDP2)."""
    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()) or any(
        _stats.local(p) is not p for p in model.parameters()
    )


def _unwrapped(m):
    """A module without a DDP or FSDP wrapper around it (the names the user's model has)."""
    if hasattr(m, "module") and type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        return m.module
    return m


def gather_models(model):
    """(the module whose names the trace uses, the modules the script calls) of what
    `watch` was given: a module is both; several models (a dict of them, or a list or tuple,
    named by position) are held by one ModuleDict, which names each one's modules under
    its key, and are called themselves. Anything else raises TypeError or ValueError."""
    if isinstance(model, torch.nn.Module):
        return model, [model]
    if isinstance(model, dict):
        items = list(model.items())
    elif isinstance(model, (list, tuple)):
        items = [(str(i), m) for i, m in enumerate(model)]
    else:
        raise TypeError(
            f"watch: the model must be a torch.nn.Module, or a dict or list of them, not {type(model).__name__}"
        )
    if not items:
        raise ValueError("watch: no model given (an empty dict or list)")
    for k, m in items:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"watch: model[{k!r}] is a {type(m).__name__}, not a torch.nn.Module")
        if not isinstance(k, str) or not k or "." in k:
            raise ValueError(f"watch: model names must be non-empty strings without dots, not {k!r}")
    return torch.nn.ModuleDict({k: _unwrapped(m) for k, m in items}), [m for _, m in items]


def _storage_address(t):
    """Where the storage holding `t`'s values begins, or None where it cannot be read (a
    wrapper subclass)."""
    try:
        return _stats.local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _state_keys(opt):
    """The keys of the floating tensors of an optimizer's state (none where it keeps no
    `state` dict, an optimizer-like wrapper; none of a tensor whose storage cannot be
    read)."""
    try:
        state = opt.state
    except Exception:
        return set()
    if not isinstance(state, dict):
        return set()
    keys = set()
    for st in state.values():
        for t in leaves(st, torch.Tensor):
            if _stats.floating(t):
                try:
                    keys.add(_key(t))
                except (RuntimeError, NotImplementedError, AttributeError):
                    pass
    return keys


def gather_optimizers(optimizer):
    """The optimizers `watch` was given (one, or a list or tuple of them), each once;
    TypeError for anything without `step` and `param_groups`."""
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not opts:
        raise ValueError("watch: no optimizer given (an empty list)")
    out = []
    for i, o in enumerate(opts):
        if not callable(getattr(o, "step", None)) or not hasattr(o, "param_groups"):
            at = f"optimizer[{i}]" if isinstance(optimizer, (list, tuple)) else "the optimizer"
            raise TypeError(f"watch: {at} is a {type(o).__name__}, not a torch.optim.Optimizer")
        if not any(o is p for p in out):
            out.append(o)
    return out


def open_watcher(called, optimizers, scaler, path):
    """The open watcher that watches exactly `called` with `optimizers` and `scaler`, which
    `watch` returns when a script calls it again (in its epoch loop); None when there is
    none. ValueError when a model given is watched by an open watcher with other models,
    optimizers or another scaler, or when an open watcher writes the trace `path`."""
    for w in _WATCHERS:
        if w.closed:
            continue
        shared = [m for m in called if any(m is c for c in w.called)]
        if shared:

            def same(a, b):
                return len(a) == len(b) and all(x is y for x, y in zip(a, b))

            if same(called, w.called) and same(optimizers, w.optimizers) and scaler is w.scaler_given:
                if not w.rewatched:
                    w.rewatched = True
                    sys.stderr.write(
                        "amprobe_torch: watch() called again with what it already watches: the open watcher goes on\n"
                    )
                return w
            raise ValueError(
                f"watch: the {type(shared[0]).__name__} given is already watched with other models, optimizers "
                f"or scaler (trace {w.path}); close that watcher first (the value watch returned: .close())"
            )
        if os.path.abspath(w.path) == os.path.abspath(path):
            raise ValueError(
                f"watch: an open watcher already writes the trace {path}; give this one another "
                "(watch(..., trace=PATH) or AMPROBE_TRACE)"
            )
    return None


def _order_key(index):
    """An op's place in its step: a live op's index, or a replayed op's key (see
    `Watcher._replay_key`), which goes before the live op of the same index."""
    return index if isinstance(index, tuple) else (index, 1, 0)


def _cut(obj, made, memo):
    """A call's arguments with each tensor that an op made and that needs a gradient
    replaced by a leaf of the same values that needs one too (also put in `made`): the
    replayed call's backward then ends at its inputs, driven by the gradients its own
    outputs received, instead of going back into the first run's graph of what made them
    (another call of the model, already freed by its backward)."""

    def cut(t):
        if t.grad_fn is None or not t.requires_grad:
            return t
        leaf = memo.get(id(t))
        if leaf is None:
            leaf = t.detach().requires_grad_()
            memo[id(t)] = leaf
            made.append(leaf)
        return leaf

    return map_tensors(obj, cut)


def _keep_grad(call, j, g):
    """A tensor hook: keeps the gradient output `j` of `call` received (summed over
    backwards through it)."""
    had = call.grads.get(j)
    if had is None:
        call.grads[j] = g
    else:
        # (the capture's own sum: no op of the step's)
        with _disable_current_modes(), torch.no_grad():
            call.grads[j] = had + g


class _Wrapped:
    """A method of the script's scaler as the watcher wraps it (set on the instance): called,
    it is the wrapper; copied or pickled with the scaler (`copy.deepcopy`, `torch.save` of
    the whole object), it is the copy's own method, and the copy is not watched."""

    __slots__ = ("owner", "name", "func")

    def __init__(self, owner, name, func):
        self.owner = owner
        self.name = name
        self.func = func

    def __call__(self, *a, **k):
        return self.func(*a, **k)

    def __reduce__(self):
        # The copy's attribute is read before its state is set: its class's method.
        return (getattr, (self.owner, self.name))


class _Call:
    """One outermost call of a module of the model in a step checked by modules: what a
    replay needs to run it again as it ran (its inputs, the random generators' states,
    autocast, grad mode and each module's train/eval mode at the call), where its ops
    began, and the gradient the backward brought to each of its outputs."""

    def __init__(self, module, args, kwargs, micro, start):
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.micro = micro
        self.start = start
        devices = {p.device for p in module.parameters(recurse=True)}
        self.rng = torch.get_rng_state()
        # Only the generators of the devices the model is on (reading another device's
        # would start a context there).
        self.cuda_rng = [
            (d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda" and torch.cuda.is_initialized()
        ]
        self.grad = torch.is_grad_enabled()
        # Every module's own flag: a model in training can hold frozen parts in eval mode.
        self.training = [m.training for m in module.modules()]
        types = {"cpu"} | {d.type for d in devices}
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(types) if t != "meta"
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.grads = {}

    def context(self):
        """The call's grad mode and autocast, entered for its replay."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for t, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(t, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache))
        return stack

    def restore_rng(self):
        """The random generators as they were when the call began."""
        torch.set_rng_state(self.rng)
        for d, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, d)


class Watcher:
    """What `watch` returns: the capture of one model's training, step by step."""

    def __init__(self, model, called, optimizers, scaler, path, sample_every, check="modules"):
        """`model`, `called` and `optimizers` as `gather_models` and `gather_optimizers`
        give them."""
        self.model = model
        self.called = called
        self.scaler_given = scaler
        self.rewatched = False
        self.several = model is not called[0]
        self.optimizers = optimizers
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.path = path
        self.sample_every = sample_every
        self.active = True
        self.busy = False
        self.failed = None
        self.step = 0
        self.writer = None
        self.autocast_dtype = None
        self.optimizer_depth = 0
        self.closed = False
        self.started = time.perf_counter()
        self.tree_depth = 0
        self.light = False
        self.paused = False
        # Whether the outermost model call running now paused the mode (`_call_enter`).
        self.call_paused = False
        # Steps that are not kept are checked by modules and replayed when they fail, unless
        # every op must be checked (AMPROBE_CHECK=ops) or the model is sharded (a replay of
        # one rank's forward would wait on collectives the other ranks do not make).
        sharded = any(_sharded(m) for m in called)
        self.light_ok = check == "modules" and not sharded
        # The module calls running now: each one's index in the step's spans, or -1; and
        # the indices of those recorded.
        self.span_open = []
        self.span_recorded = []
        # Host checks of the tensors the training owns across steps (parameters, optimizer
        # state), by key: (version counter, check) as an op last wrote or read them (see
        # `_known_check`). Not for a sharded model: a collective writes its parameters'
        # gathered values without moving their version counters.
        self.carry_checks = not sharded
        self.owned_checks = {}
        # Storage address -> the keys of the checks above whose values are there.
        self.owned_storage = {}
        # Key -> the tensor whose check an op of this step wrote (`_remember`).
        self.owned_written = {}
        self._begin_step()
        self.names = _Names(model)
        self.call_hooks = []
        for m in self.names.root.modules():
            self.call_hooks.append(m.register_forward_pre_hook(ModuleHook(self._call_enter), with_kwargs=True))
            self.call_hooks.append(m.register_forward_hook(ModuleHook(self._call_leave), always_call=True))
        self.fn_info = {}
        self.scratch = Scratch()
        # Ids of the parameters whose figures needed more than the shortcut last step (see
        # `begin_param_vectors`), and the scale the next step is expected to have.
        self.counted = {}
        self.scale_guess = None
        # Autocast's state is read where the model's forward starts: inside the dispatcher,
        # autocast's own kernels hide it.
        for m in called:
            self.call_hooks.append(m.register_forward_pre_hook(ModuleHook(self._autocast_state)))
        self.eager = _force_eager()
        self.mode = _Mode(self)
        self.mode.__enter__()
        self._wrap()

    # ---- the step's state

    def _begin_step(self):
        self.kept = self.step == 0 or (self.sample_every > 0 and self.step % self.sample_every == 0)
        if not self.kept:
            _stats.release_scratch()
        # Set (on the CPU, where a check is read at once) when an op of this step makes a
        # non-finite value that can be an origin: the ops from there on get full statistics.
        self.failing = False
        # Set when the script unscales the gradients itself (`scaler.unscale_`): what it
        # does with them before the scaler's step (clipping) is the optimizer phase's.
        self.unscaled = False
        # Optimizer updates made in this step, and which optimizers have stepped (without
        # a scaler the step ends when each has).
        self.updates = 0
        self.stepped = set()
        # Backwards run in this step, and whether the script discarded their gradients
        # without an update (`_abandon`).
        self.backwards = 0
        self.abandoned = False
        # Why a step checked by modules is checked op by op from some point on: "update"
        # where it calls the model inside an update (an optimizer's closure: see
        # `_call_enter`), "grad" where the script differentiates by `torch.autograd.grad`
        # (`on_autograd_grad`).
        self.light_cut = None
        # Whether an optimizer's update is running (see `_updating`).
        self.in_update = False
        # Whether the optimizer's own step ran inside the scaler's step being run (the
        # scaler skips it where it found an infinity: see `_updating`).
        self.inner_stepped = False
        # Whether the step's calls are past its first update (see `_new_segment`), and
        # whether the scaler skipped an update whose calls were decided before an earlier
        # one (no replay can run them as they ran).
        self.later_segment = False
        self.segment_note = False
        self.ops = []
        self.full_vecs = []
        self.check_vecs = []
        self.producer = {}
        self.external = {}
        self.integers = {}
        self.derived = set()
        self.param_dep = set()
        self.maskish = set()
        params = list(self.model.parameters())
        self.param_keys = {_key(p) for p in params}
        # (the optimizers' state only where checks can be carried: on the host)
        self.owned_keys = self.param_keys
        if self.carry_checks and any(_stats.on_host(p) for p in params):
            self.owned_keys = self.param_keys.union(*(_state_keys(opt) for opt in self.optimizers))
        for k, t in self.owned_written.items():
            known = self.owned_checks.get(k)
            if known is not None and known[0] is None:
                self.owned_checks[k] = (t._version, known[1])
        self.owned_written = {}
        self.owned_checks = {k: v for k, v in self.owned_checks.items() if k in self.owned_keys and v[0] is not None}
        self.owned_storage = {a: ks & self.owned_checks.keys() for a, ks in self.owned_storage.items()}
        self.op_count = 0
        self.losses = []
        # The model's outermost calls in this step, and their count at the last backward:
        # a backward with no call since the last one is another loss of its micro-batch.
        self.model_calls = 0
        self.calls_at_backward = None
        self.scaling_nodes = []
        # Autograd node -> the module whose forward made it (backward ops are named by it).
        self.node_module = {}
        # A step checked by modules (see `_Mode`): the model's outermost calls, to replay;
        # a flag per call saying whether a module's output held a NaN or an infinity; the
        # autograd nodes of the script's own ops around the model (recorded in backward);
        # (micro-batch, op index) of each backward op that only ran.
        self.light = self.light_ok and not self.kept
        self.calls = []
        self.call = None
        # The unseen forwards' module calls (`_span_enter`): where each began and ended in
        # autograd's sequence numbers, its module's name, the call it ran inside (-1: none).
        self.span_start, self.span_end, self.span_name, self.span_parent = [], [], [], []
        # (calls running across the step's start are not this step's)
        self.span_open = [-1] * len(self.span_open)
        self.span_recorded = []
        self.call_outputs = {}
        self.out_flags = []
        self.loss_nodes = set()
        # Micro-batch -> the op count when its backward ended (its replayed backward
        # ops go there).
        self.backward_end = {}
        self.decided = False
        self.replayed = False
        self.replaying = False
        self.replay_note = None
        # Why a replay's backward could not run (its forward was recorded), or None.
        self.replay_backward_note = None
        self.replayed_ops = 0
        self.replay_call = None
        self.replay_micro = 0
        self.replay_seq = 0
        self.hooked_nodes = set()
        self.t0 = time.perf_counter()

    def _autocast_state(self, module, args):
        if self.autocast_dtype is not None or not self.active:
            return
        try:
            dev = next((p.device.type for p in module.parameters()), "cpu")
            if torch.is_autocast_enabled(dev):
                self.autocast_dtype = torch.get_autocast_dtype(dev)
        except Exception:  # a hook of the user's forward: never kill the training
            self.fail()

    def fail(self):
        """Reports the companion's own error once and stops capturing; training goes on."""
        if self.failed is None:
            self.failed = traceback.format_exc()
            sys.stderr.write(
                "amprobe_torch: capture stopped after an internal error "
                f"(training continues):\n{self.failed}"
            )
        self.active = False

    # ---- a step checked by modules

    def _pause(self):
        """Takes the capture's dispatch mode off the stack, so that the ops that follow do
        not reach Python at all; not when another mode is above it (its ops then pass
        through `_Mode` unrecorded). Returns whether it did."""
        if self.paused or _current_dispatch_mode() is not self.mode:
            return False
        self.mode.__exit__(None, None, None)
        self.paused = True
        return True

    def _resume(self):
        """Puts the dispatch mode back after `_pause`."""
        if self.paused:
            self.paused = False
            self.mode.__enter__()

    def _node_enter(self, grad_outputs):
        # An autograd node of the script's own ops, in a backward the mode is off for: its
        # ops are recorded (the engine restores its thread's modes after each node).
        if self.paused and self.active:
            self.mode.__enter__()

    def _node_leave(self, grad_inputs, grad_outputs):
        if self.paused and self.active and _current_dispatch_mode() is self.mode:
            self.mode.__exit__(None, None, None)

    def before_backward(self):
        """A backward starts in a step checked by modules: the script's own nodes are
        hooked to record their ops, and the mode is paused for the rest. Returns whether
        it was paused (then `after_backward` resumes it)."""
        for node in self.loss_nodes - self.hooked_nodes:
            node.register_prehook(self._node_enter)
            node.register_hook(self._node_leave)
            self.hooked_nodes.add(node)
        return self._pause()

    def after_backward(self, paused):
        self.backward_end[max(0, len(self.losses) - 1)] = self.op_count
        if paused:
            self._resume()

    def _call_enter(self, module, args, kwargs):
        if self.replaying:
            return
        self._span_enter(module)
        self.tree_depth += 1
        if self.tree_depth == 1:
            self.call_paused = False
            if torch._C._current_graph_task_id() == -1:
                # (not a checkpointed block's recomputation inside a backward)
                self.model_calls += 1
            if self.light and self.in_update and self.active and not self.busy:
                # A call inside an update (an optimizer's closure: SAM's, which runs it on
                # parameters it moved): no replay can run it as it ran; the rest of the
                # step is checked op by op.
                self.light = False
                self.light_cut = "update"
        if (
            self.tree_depth == 1
            and self.light
            and self.active
            and not self.busy
            and torch._C._current_graph_task_id() == -1
        ):
            if len(self.calls) >= MAX_CALLS:
                self.replay_note = f"more than {MAX_CALLS} calls of the model in one step"
                return
            self.busy = True
            try:
                with _disable_current_modes():
                    self.call = _Call(module, args, kwargs, len(self.losses), self.op_count)
                self.calls.append(self.call)
            except Exception:
                self.fail()
            finally:
                self.busy = False
            # The model's own ops run without the mode (a replay records them). Only this
            # call's pause is undone where it ends: a call in a backward (a checkpointed
            # block's recomputation) pauses nothing, and must not resume what the backward
            # paused (the engine would then drop the mode when the node ends).
            self.call_paused = self._pause()

    def _call_leave(self, module, args, out):
        if self.replaying:
            return
        self._span_leave()
        if self.tree_depth:
            self.tree_depth -= 1
        c = self.call
        if c is None or not self.light or not self.active or self.busy:
            if self.tree_depth == 0:
                self._end_call_pause()
            return
        self.busy = True
        try:
            for t in leaves(out, torch.Tensor):
                if _stats.floating(t):
                    self.call_outputs[id(t)] = t
            # Checked in batches: a forward's outputs are not all held until it ends.
            if self.tree_depth == 0 or len(self.call_outputs) >= _OUTPUTS_BATCH:
                self.out_flags.append(_stats.nonfinite_flag(list(self.call_outputs.values())))
                self.call_outputs = {}
            if self.tree_depth == 0:
                self.call = None
                for j, t in enumerate(leaves(out, torch.Tensor)):
                    if t.requires_grad:
                        t.register_hook(functools.partial(_keep_grad, c, j))
        except Exception:
            self.fail()
        finally:
            self.busy = False
            if self.tree_depth == 0:
                self._end_call_pause()

    def _span_enter(self, module):
        """Where a step checked by modules runs a module's forward unseen: the autograd
        sequence numbers its call begins at, so that a backward op that comes to be seen (the
        rest of a step cut by `torch.autograd.grad` or an update's closure) is named by the
        module whose forward made its node (`_span_module`), as a seen forward names it."""
        if (
            _SEQUENCE_NR is not None
            and self.light
            and torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1
        ):
            i = len(self.span_start)
            self.span_start.append(_SEQUENCE_NR())
            self.span_end.append(None)
            self.span_name.append(self.names.names.get(id(module), type(module).__name__))
            self.span_parent.append(self.span_recorded[-1] if self.span_recorded else -1)
            self.span_recorded.append(i)
            self.span_open.append(i)
        else:
            self.span_open.append(-1)

    def _span_leave(self):
        if self.span_open:
            i = self.span_open.pop()
            if i >= 0:
                if self.span_recorded:
                    self.span_recorded.pop()
                if i < len(self.span_end):
                    self.span_end[i] = _SEQUENCE_NR()

    def _span_module(self, node):
        """The module whose call made autograd node `node` in this step's unseen forwards
        (the innermost call whose sequence numbers hold the node's), or None."""
        if not self.span_start:
            return None
        try:
            seq = node._sequence_nr()
        except (AttributeError, RuntimeError):
            return None
        i = bisect.bisect_right(self.span_start, seq) - 1
        # Calls nest: a call that began earlier and holds the node holds the later one.
        while i >= 0:
            end = self.span_end[i]
            if end is None or seq < end:
                return self.span_name[i]
            i = self.span_parent[i]
        return None

    def _end_call_pause(self):
        """Resumes the mode where an outermost call that paused it ends."""
        if self.call_paused:
            self.call_paused = False
            self._resume()

    def _decide(self):
        """Where a step checked by modules enters its optimizer phase: whether it failed so
        far (a module's output, an op of the script's own, an input it read or a loss not
        finite; without a scaler, a gradient), read back at once; if so, it is replayed
        now, before the optimizer changes anything."""
        self.decided = True
        self.busy = True
        try:
            with _disable_current_modes():
                # Host answers as they are; device ones (flags, the losses' test, the
                # gradients') read back together with the ops' checks.
                flags = list(self.out_flags)
                if self.losses:
                    flags.append(~torch.stack(self.losses).isfinite().all())
                if self.scaler is None:
                    grads = [
                        _stats.stored_values(p.grad) for p in self.names.root.parameters() if p.grad is not None
                    ]
                    on_cpu = [g for g in grads if _stats.on_host(_stats.local(g))]
                    for g in on_cpu:
                        # The optimizer's ops read these next: their checks are these.
                        k = _key(g)
                        if k not in self.external:
                            self.check_vecs.append(_stats.check(g))
                            self.external[k] = len(self.check_vecs) - 1
                        v = self.check_vecs[self.external[k]]
                        flags.append(v[1] + v[2] + v[3] > 0)
                    flags.append(_stats.nonfinite_flag([g for g in grads if not _stats.on_host(_stats.local(g))]))
                failing = any(f is True for f in flags)
                by_device = {}
                for f in flags:
                    if isinstance(f, torch.Tensor):
                        by_device.setdefault(f.device, []).append(f.reshape(1))
                on_device = []
                for fs in by_device.values():
                    f = torch.cat(fs).any().double()
                    # Read back as a check is (its first count is the flag).
                    on_device.append(_stats.DeviceCheck((1, f, f, f)))
                vecs = [self.full_vecs[i] if k == "full" else self.check_vecs[i] for k, i in (op["vec"] for op in self.ops)]
                ext = list(self.external.values())
                if not failing:
                    read = _stats.gather(vecs + [self.check_vecs[e] for e in ext] + on_device)
                    for _ in on_device:
                        failing = read.pop()[1] > 0 or failing
                    # An op of the script's own that made a NaN or an infinity (not one that
                    # only passed on what an input held: the last step's NaN loss kept by
                    # the script; a model's output that held one is in its modules' flags).
                    origins = self._origins(read[: len(vecs)], dict(zip(ext, read[len(vecs) :])))
                    failing = failing or origins["first_inf"] is not None or origins["first_nan"] is not None
        except Exception:
            self.fail()
            return
        finally:
            self.busy = False
        if failing:
            self._replay()

    def _replay(self):
        """Runs the step's model calls again under the capture, each as it ran (its inputs,
        random state, autocast, grad mode and every module's train/eval mode), and their
        backward from the gradients their outputs received, into gradients of its own (the
        parameters' are not touched); restores the random generators, the model's buffers
        and its modules' modes after. The ops go where the first run's went
        (`_replay_key`)."""
        self.replayed = True
        if self.replay_note is not None or not self.calls:
            self.replay_note = self.replay_note or "no call of the model was seen in this step"
            # The next steps check every op: a failure there is found exactly.
            self.light_ok = False
            return
        root = self.names.root
        self.busy = True
        try:
            with _disable_current_modes():
                rng = torch.get_rng_state()
                cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.calls[0].cuda_rng]
                buffers = [(b, b.detach().clone()) for b in root.buffers()]
                training = [(m, m.training) for m in root.modules()]
        finally:
            self.busy = False
        params = [p for p in root.parameters() if p.requires_grad]
        self._resume()
        self.light = False
        self.failing = True
        self.replaying = True
        try:
            for micro in sorted({c.micro for c in self.calls}):
                self.replay_micro = micro
                outs, grads, made, memo = [], [], [], {}
                for c in self.calls:
                    if c.micro != micro:
                        continue
                    self.busy = True
                    try:
                        with _disable_current_modes():
                            c.restore_rng()
                            args, kwargs = _cut((c.args, c.kwargs), made, memo)
                    finally:
                        self.busy = False
                    self.replay_call = c
                    for m, t in zip(c.module.modules(), c.training):
                        m.training = t
                    with c.context():
                        out = c.module(*args, **kwargs)
                    self.replay_call = None
                    for j, t in enumerate(leaves(out, torch.Tensor)):
                        # No op of the replay reads its outputs: their nodes are named here.
                        self._name_loss(t)
                        g = c.grads.get(j)
                        if g is not None and t.requires_grad:
                            outs.append(t)
                            grads.append(g)
                if outs and params and self.replay_backward_note is None:
                    try:
                        # (the inputs cut from other calls too: their gradients are
                        # ops of the step)
                        torch.autograd.grad(outs, params + made, grads, allow_unused=True)
                    except RuntimeError as e:
                        # A backward that cannot run into gradients of its own (reentrant
                        # activation checkpointing refuses `autograd.grad`): the forward's
                        # records stand; later steps check every op, exactly.
                        self.replay_backward_note = str(e).strip().split("\n")[0]
                        self.light_ok = False
        except Exception:
            self.fail()
        finally:
            self.replaying = False
            self.replay_call = None
            self.busy = True
            try:
                with _disable_current_modes(), torch.no_grad():
                    torch.set_rng_state(rng)
                    for d, state in cuda_rng:
                        torch.cuda.set_rng_state(state, d)
                    for b, saved in buffers:
                        b.copy_(saved)
                    for m, t in training:
                        m.training = t
            finally:
                self.busy = False

    def _replay_key(self, phase):
        """Where a replayed op goes among the step's ops: a forward op where its call
        began, a backward op where its micro-batch's backward ended (after the script's
        own gradient ops, which ran first), in the order the replay ran them."""
        self.replay_seq += 1
        self.replayed_ops += 1
        if phase == "backward" or self.replay_call is None:
            return (self.backward_end.get(self.replay_micro, self.op_count), 0, self.replay_seq)
        return (self.replay_call.start, 0, self.replay_seq)

    # ---- op by op

    def _vector(self, t):
        """The statistics of a tensor, or of a list of tensors together, full or checked as
        this step records them."""
        if self.kept or self.failing:
            self.full_vecs.append(_stats.full_many(t) if isinstance(t, list) else _stats.full(t))
            return ("full", len(self.full_vecs) - 1)
        self.check_vecs.append(_stats.check_many(t) if isinstance(t, list) else _stats.check(t))
        return ("check", len(self.check_vecs) - 1)

    def _info(self, func):
        """(name, whether it writes an argument, what it is: "collective" for an op that
        moves values between ranks, "pending" for one whose output is not written yet (an
        allocation, or a functional collective before its wait), "alias" for a view (its
        output is its input's memory), None for others; where its outputs are: None for what
        it returns, else (position, name) of the argument it writes when it returns nothing
        (the in-place multi-tensor ops: the optimizers' foreach updates, the scaler's
        unscale); whether they are one list of tensors) of an op, cached."""
        info = self.fn_info.get(func)
        if info is None:
            name = func.overloadpacket.__name__
            kind = None
            if func.namespace == "c10d" or (func.namespace == "_c10d_functional" and name == "wait_tensor"):
                kind = "collective"
            elif func.namespace == "_c10d_functional" or name in _stats.ALLOCATING:
                kind = "pending"
            elif getattr(func, "is_view", False):
                kind = "alias"
            schema = func._schema
            written = None
            many = len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)
            if not schema.returns:
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is not None and a.alias_info.is_write:
                        written = (i, a.name)
                        many = isinstance(a.type, torch.ListType)
                        break
            info = (name, schema.is_mutable, kind, written, many)
            self.fn_info[func] = info
        return info

    def read_inputs(self, func, args, kwargs):
        """Before an op runs: its phase and what its inputs are (made by which earlier op;
        derived from the parameters or the batch, or only from constants; masks; known
        finite), with the inputs no op of this step made checked now, as the op reads them
        (an op may write them: a batch norm's running statistics). None for an op not
        recorded (the loss scaling's gradient)."""
        node = None
        if self.optimizer_depth or self.unscaled:
            phase = "optimizer"
        elif torch._C._current_graph_task_id() != -1:
            phase = "backward"
            node = torch._C._current_autograd_node()
        else:
            phase = "forward"
        if self.replaying:
            index = self._replay_key(phase)
        else:
            index = self.op_count
            self.op_count += 1
        if node is not None and self.scaling_nodes and any(node is n for n in self.scaling_nodes):
            return None
        ins = []
        mask_scalar = False
        scalars_finite = True
        for a in (args, kwargs.values()) if kwargs else (args,):
            for x in a:
                if isinstance(x, torch.Tensor):
                    if _stats.observed(x):
                        ins.append(x)
                elif isinstance(x, float):
                    mask_scalar = mask_scalar or _mask_like(x)
                    scalars_finite = scalars_finite and x - x == 0.0
                elif isinstance(x, (list, tuple)):
                    ins.extend(t for t in leaves(x, torch.Tensor) if _stats.observed(t))
                    for f in leaves(x, float):
                        mask_scalar = mask_scalar or _mask_like(f)
                        scalars_finite = scalars_finite and f - f == 0.0
        # What the output will derive from: the parameters or the batch (then its Inf or
        # NaN can be an origin), or only constants the model made (T5's log(0) = -inf in
        # its position buckets is not); and whether it is, or reads, a mask.
        preds, ext, moved = [], [], []
        derived = maskish_in = const_in = param_in = False
        producer, ops, checks = self.producer, self.ops, self.check_vecs
        unchecked = []
        # Whether every floating input is known finite on the host now (the CPU's checks
        # are host lists; a kept step's full vectors and a device's are not read yet).
        known_finite = not (self.kept or self.replaying)
        for t in ins:
            k = _key(t)
            p = producer.get(k)
            if p is not None:
                preds.append(p)
                moved.append((k[0], t, p))
                if known_finite:
                    kind, i = ops[p]["vec"]
                    if kind == "check":
                        v = checks[i]
                        known_finite = type(v) is list and v[1] + v[2] + v[3] == 0
                    else:
                        known_finite = False
                if p in self.derived:
                    derived = True
                else:
                    const_in = True
                maskish_in = maskish_in or p in self.maskish
                param_in = param_in or p in self.param_dep
                if phase == "forward":
                    gf = t.grad_fn
                    if gf is not None:
                        if gf not in self.node_module:
                            self.node_module[gf] = ops[p]["module"]
                        if self.light:
                            # Made by the script's own op around the model (the model's
                            # ops are not seen in this step): its gradient is recorded.
                            self.loss_nodes.add(gf)
                continue
            made = self.integers.get(k)
            if made is not None:
                if made[0]:
                    derived = True
                else:
                    const_in = True
                param_in = param_in or made[1]
                maskish_in = maskish_in or made[2]
                continue
            derived = True
            param_in = param_in or k in self.param_keys
            if k[1] in _stats.FLOATING:
                e = self.external.get(k)
                if e is None and len(ins) >= _BATCHED_INPUTS and not _stats.on_host(t):
                    unchecked.append((k, t))
                    continue
                if e is None:
                    checks.append(self._known_check(k, t))
                    e = self.external[k] = len(checks) - 1
                ext.append(e)
                if known_finite:
                    v = checks[e]
                    known_finite = type(v) is list and v[1] + v[2] + v[3] == 0
        if unchecked:
            # A multi-tensor op's inputs on a device (the optimizer's: every gradient and
            # parameter): checked together, a few kernels instead of six a tensor
            # (`_stats.batch_check`: whether a NaN is there, whether an Inf may be, which
            # is what a check of an input is read for).
            by_device = {}
            for k, t in unchecked:
                by_device.setdefault(t.device, []).append((k, t))
            for group in by_device.values():
                checks.append(_stats.batch_check([t for _, t in group]))
                for k, _ in group:
                    self.external[k] = len(checks) - 1
                ext.append(len(checks) - 1)
            known_finite = False
        return (
            phase,
            node,
            ins,
            preds,
            ext,
            moved,
            derived,
            const_in,
            maskish_in,
            param_in,
            mask_scalar,
            scalars_finite and known_finite,
            index,
        )

    def _known_check(self, k, t):
        """The check of an input `t` with key `k` that no op of this step made: where the
        training owns it across steps (a parameter, an optimizer's state) and its version
        counter has not moved since an op last wrote or read it, that check (a parameter's
        values after the last update are those the next step reads); else a new one, kept
        for the next read. Writes that bypass the version counter (`.data`) are seen as the
        script's own ops (`on_op` forgets their tensors' checks); the model's own ops in a
        step checked by modules are not seen, and a model whose forward writes its own
        parameters through `.data` would have the next update's input checked by the
        version before it."""
        owned = self.carry_checks and k in self.owned_keys and _stats.on_host(t) and not t.is_inference()
        if owned:
            known = self.owned_checks.get(k)
            if known is not None and known[0] == t._version:
                return list(known[1])
        v = _stats.check(t)
        if owned:
            self._remember(k, t, v)
        return v

    def _remember(self, k, t, v, written=False):
        """Keeps check `v` of `t` (key `k`) where the training owns it (`_known_check`).
        `written`: by the op that wrote it, whose version counter moves only once the
        mode has returned: the counter is read where the next step begins (the writes
        before then are the ops this step records)."""
        if k in self.owned_keys:
            self.owned_checks[k] = (None if written else t._version, v)
            if written:
                self.owned_written[k] = t
            addr = _storage_address(t)
            if addr is None:
                self.owned_checks.pop(k, None)
                self.owned_written.pop(k, None)
                return
            self.owned_storage.setdefault(addr, set()).add(k)

    def _forget_written(self, tensors):
        """Forgets the carried checks of whatever shares storage with `tensors` (written by
        an op); all of them where a tensor's storage cannot be read (a wrapper subclass)."""
        addrs = [_storage_address(t) for t in tensors if _stats.on_host(t)]
        if None in addrs:
            self.owned_checks.clear()
            self.owned_storage.clear()
            return
        for a in addrs:
            for k in self.owned_storage.pop(a, ()):
                self.owned_checks.pop(k, None)

    def on_op(self, func, seen, out, args=(), kwargs=None):
        """After an op ran: its record (the statistics of its first floating output, or of
        all its tensors together when they are one list) from what `read_inputs` saw of its
        inputs."""
        (phase, node, ins, preds, ext, moved, derived, const_in, maskish_in, param_in, mask_scalar,
         finite_in, index) = seen
        name, mutable, kind, written, many = self._info(func)
        derived = derived or name in _stats.RANDOM
        # Whether an Inf or NaN in the output can have been made here. A view of floating
        # values makes none: a non-finite value its input's record did not show was in that
        # memory before (FSDP2 reallocates a freed parameter at the address it had and views
        # it before the all-gather fills it). A view that reinterprets integers as floats can.
        can_make = (kind is None or (kind == "alias" and not all(_stats.floating(t) for t in ins))) and (
            phase != "forward" or derived
        )
        if written is not None:
            # It wrote its results into an argument and returned nothing.
            i, arg = written
            out = args[i] if i < len(args) else (kwargs or {}).get(arg)
        outs = (out,) if isinstance(out, torch.Tensor) else leaves(out, torch.Tensor)
        floats = [t for t in outs if _stats.floating(t)]
        many = many and len(floats) > 1
        if not floats:
            # Integer outputs have no record, but a float made from them later must know
            # where they come from.
            for t in outs:
                if _stats.observed(t):
                    self.integers[_key(t)] = (derived, param_in, maskish_in)
            return
        o = floats[0]
        ops, checks = self.ops, self.check_vecs
        if phase == "backward":
            module = self.node_module.get(node) if node is not None else None
            if module is None:
                module = self.names.of_node(node) if node is not None else None
                if module is None and node is not None:
                    module = self._span_module(node)
                if module is None:
                    module = self.names.current()
        else:
            module = self.names.current()
        # An output that only moves an input's values (a view, a transpose, a detach: same
        # storage start, element count and dtype; never an op that writes in place) shares
        # that input's statistics instead of computing them again.
        # So does a copy of one input's values (a clone, a contiguous copy, a cast to a dtype
        # that holds them exactly and calls the same ones subnormal: bf16 to f32).
        same = None
        if not mutable and moved and not many:
            optr = o.data_ptr()
            copies = len(moved) == 1 and name in _stats.VALUE_COPIES
            for ptr, t, p in moved:
                if t.numel() == o.numel() and (
                    (t.dtype == o.dtype and (ptr == optr or copies))
                    or (copies and (t.dtype, o.dtype) == (torch.bfloat16, torch.float32))
                ):
                    same = ops[p]["vec"]
                    break
        if kind == "collective":
            # Its output holds what other ranks sent once the transfer is done: wait for
            # it, and its Inf or NaN is received, never made here.
            stack = [out]
            while stack:
                x = stack.pop()
                if isinstance(x, (list, tuple)):
                    stack.extend(x)
                elif not isinstance(x, torch.Tensor) and hasattr(x, "wait"):
                    x.wait()
        if kind == "pending":
            # Uninitialised memory or values still in flight: nothing to read, no origin.
            checks.append([float(o.numel()), 0.0, 0.0, 0.0])
            vec = ("check", len(checks) - 1)
        elif same is not None:
            vec = same
        elif (
            finite_in
            and name in _stats.FINITE_PRESERVING
            and all(_stats.RANGE[t.dtype] <= _stats.RANGE[o.dtype] for t in ins if t.dtype in _stats.RANGE)
        ):
            # Finite inputs through an op that cannot make a non-finite value: counted as
            # clean without reading the output.
            checks.append([float(o.numel()), 0.0, 0.0, 0.0])
            vec = ("check", len(checks) - 1)
        else:
            vec = self._vector(floats if many else o)
            if vec[0] == "check" and not self.failing and can_make:
                v = checks[vec[1]]
                masked = phase == "forward" and (mask_scalar or maskish_in or const_in)
                if type(v) is list and v[1] + v[2] + (0 if masked else v[3]) > 0:
                    # The step's first Inf or NaN that can be an origin: this op and the
                    # rest of the step are recorded in full.
                    self.failing = True
                    vec = self._vector(floats if many else o)
        if mutable:
            # What it wrote is its output's check from now on, or unknown (a write into part
            # of an owned tensor's storage: a slice of a parameter's `.data`).
            if self.owned_storage:
                self._forget_written(floats)
            if (
                self.carry_checks
                and vec[0] == "check"
                and not many
                and _stats.on_host(o)
                and not o.is_inference()
                and type(checks[vec[1]]) is list
            ):
                self._remember(_key(o), o, checks[vec[1]], written=True)
        idx = len(ops)
        ops.append(
            {
                "phase": phase,
                "op": name,
                "module": module,
                # (tuples of plain values, which the garbage collector stops tracking: a
                # step in full keeps thousands of these until it ends, and tracked ones
                # bring on collections of the whole heap)
                "inputs": tuple([(t.dtype, tuple(t.shape)) for t in ins]),
                # (a list's tensors as one: their element count)
                "output": (o.dtype, (sum(t.numel() for t in floats),) if many else tuple(o.shape)),
                "vec": vec,
                "preds": tuple(preds),
                "ext": tuple(ext),
                "eligible": can_make,
                # -inf written by a mask (a scalar like finfo.min or -inf, a mask built from
                # one, or a constant the model made) is not an overflow.
                "masked": phase == "forward" and (mask_scalar or maskish_in or const_in),
                "index": index,
                # The micro-batch: backwards of the step before this op (a backward op
                # belongs to the backward running, a forward op to the next one).
                "micro": self.replay_micro if self.replaying else max(0, len(self.losses) - (phase != "forward")),
            }
        )
        producer = self.producer
        for t in floats:
            producer[_key(t)] = idx
        if derived:
            self.derived.add(idx)
        if param_in:
            self.param_dep.add(idx)
        if (mask_scalar or maskish_in) and not param_in:
            self.maskish.add(idx)

    def _name_loss(self, loss):
        """Names the loss's own autograd node (no op of the forward consumes the loss, so
        the forward did not name it)."""
        gf = getattr(loss, "grad_fn", None)
        if gf is not None and gf not in self.node_module:
            p = self.producer.get(_key(loss))
            if p is not None:
                self.node_module[gf] = self.ops[p]["module"]
                if self.light:
                    self.loss_nodes.add(gf)

    # ---- step boundaries

    def _in_optimizer(self, f):
        """`f` with its ops counted in the optimizer phase (nested calls included: the
        scaler's step unscales)."""
        w = self

        def run(*a, **k):
            w._enter_optimizer()
            try:
                return f(*a, **k)
            finally:
                w.optimizer_depth -= 1

        return run

    def _enter_optimizer(self):
        """One level deeper into the optimizer phase; a step checked by modules decides
        where it first enters it whether it failed."""
        if (
            self.light
            and not self.decided
            and not self.optimizer_depth
            and self.active
            and not self.busy
            and (self.calls or not self.later_segment)
        ):
            self._decide()
        self.optimizer_depth += 1

    def _outside_optimizer(self, closure):
        """An optimizer step's closure (SAM's, L-BFGS's), whose forward and backward of the
        model are those phases, not the optimizer's."""
        w = self

        def run(*a, **k):
            depth, unscaled = w.optimizer_depth, w.unscaled
            w.optimizer_depth, w.unscaled = 0, False
            try:
                return closure(*a, **k)
            finally:
                w.optimizer_depth, w.unscaled = depth, unscaled

        return run

    def on_autograd_grad(self):
        """The script calls `torch.autograd.grad` (a gradient penalty: the gradients of a
        loss, with their graph, enter the loss that is backpropagated). A replay runs the
        step's calls and one backward from the gradients their outputs received, which
        cannot reproduce several backwards and their double backward. So a step checked by
        modules is decided here, before any backward: the calls so far, if they failed, are
        replayed now (their forwards: no gradient has reached them yet), and the rest of
        the step is checked op by op; the next step is checked by modules again. Where the
        call comes from inside the model's forward or an update (no replay can run the
        calls there), the rest is checked op by op, and so are the steps after it."""
        if self.light:
            self.light_cut = "grad"
            if self.tree_depth == 0 and not self.optimizer_depth and not self.in_update and not self.decided:
                self._decide()
                self.light = False
            else:
                self.light = False
                self.light_ok = False

    def _abandon(self):
        """The script zeroes the gradients of a step that ran a backward and made no update
        (it skips a bad batch: `if not finite: optimizer.zero_grad(); continue`, or zeroes
        at the top of the next iteration after a `continue`): the step ends there, skipped.
        A step checked by modules decides first, while its gradients are still there. (With
        one optimizer only: where several train together, one's gradients are zeroed while
        another's update is still to come.)"""
        if self.light and not self.decided:
            self._decide()
        self.abandoned = True
        sc = self.scaler
        before = sc._scale.detach().clone() if sc is not None and sc._scale is not None else None
        self._end_step(before, self._found_inf() if sc is not None else None)

    def _updating(self, f, scaler_step=False):
        """`f`, an optimizer's update (its `step`, or the scaler's step of it: `scaler_step`),
        in the optimizer phase, counted. A step checked by modules replays its model calls as
        they ran, which needs the parameters they read unchanged: its calls are decided in
        segments, each ending where an update begins (`_enter_optimizer`), and a segment the
        scaler skipped an update for, which its checks did not see fail, is replayed as soon
        as the scaler's step returns (nothing has changed its parameters yet). The next
        segment begins with the calls after the update (a GAN's generator part after its
        discriminator's update)."""
        w = self
        inner = self._in_optimizer(f)

        def run(*a, **k):
            outer = w.active and not w.busy and not w.optimizer_depth
            if outer:
                w.updates += 1
                w.inner_stepped = False
                w.in_update = True
            if a and callable(a[0]):
                a = (w._outside_optimizer(a[0]),) + a[1:]
            elif callable(k.get("closure")):
                k["closure"] = w._outside_optimizer(k["closure"])
            done = False
            try:
                r = inner(*a, **k)
                done = True
                return r
            finally:
                if outer:
                    # What follows an update is not its phase (the scaler's step unscaled).
                    w.unscaled = False
                    w.in_update = False
                    # (not where the update raised: the script's error goes on as it is)
                    if done and w.light and w.active and not w.replayed:
                        if scaler_step and not w.inner_stepped:
                            # The scaler found an infinity and skipped the update.
                            if w.calls or not w.later_segment:
                                w._replay()
                            else:
                                # (two optimizers stepped after one backward: the calls
                                # ran before the first, which may have changed them)
                                w.segment_note = True
                        if w.light:
                            w._new_segment()

        return run

    def _new_segment(self):
        """After an update in a step checked by modules: the calls that follow are decided
        and replayed on their own (see `_updating`)."""
        self.decided = False
        self.calls = []
        self.replay_note = None
        # (a segment with no call of the model has nothing to decide)
        self.later_segment = True

    def _wrap(self):
        w = self
        if self.scaler is not None:
            sc = self.scaler
            orig_update = sc.update

            def update(*a, **k):
                if not w.active:
                    return orig_update(*a, **k)
                w.busy = True
                try:
                    found = w._found_inf()
                    before = sc._scale.detach().clone() if sc._scale is not None else None
                    # Whether a skip the step's checks did not see replays it (read with
                    # the step: the parameters are as the calls since the last update had
                    # them).
                    replay = w.light and not w.replayed and (bool(w.calls) or not w.later_segment)
                finally:
                    w.busy = False
                r = w._in_optimizer(orig_update)(*a, **k)
                w._end_step(before, found, replay)
                return r

            sc.update = _Wrapped(sc, "update", update)
            orig_scale = sc.scale

            def scale(*a, **k):
                # The loss scaling is the scaler's, not a model op (amprobe's own runs
                # record none either): neither it nor its gradient is recorded.
                was, w.busy = w.busy, True
                try:
                    if w.active and a and isinstance(a[0], torch.Tensor):
                        w._name_loss(a[0])
                    out = orig_scale(*a, **k)
                finally:
                    w.busy = was
                if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                    w.scaling_nodes.append(out.grad_fn)
                return out

            sc.scale = _Wrapped(sc, "scale", scale)
            orig_unscale = self._in_optimizer(sc.unscale_)

            def unscale_(*a, **k):
                r = orig_unscale(*a, **k)
                w.unscaled = w.active
                return r

            sc.unscale_ = _Wrapped(sc, "unscale_", unscale_)
            sc.step = _Wrapped(sc, "step", self._updating(sc.step, scaler_step=True))
        # The wrappers are bound methods, as the optimizer's own are: an LR scheduler made
        # after `watch` wraps `step` through its `__func__`.
        for opt in self.optimizers:
            opt.step = types.MethodType(self._stepping(opt), opt)
        if len(self.optimizers) == 1:
            opt = self.optimizers[0]
            orig_zero = opt.zero_grad

            def zero_grad(_opt, *a, **k):
                if w.active and not w.busy and not w.optimizer_depth and w.backwards and not w.updates:
                    w._abandon()
                return orig_zero(*a, **k)

            opt.zero_grad = types.MethodType(zero_grad, opt)
        _install_backward_hook()
        _install_grad_hook()
        _install_clip_hooks()

    def _stepping(self, opt):
        """`opt.step` as the watcher runs it (an update, `_updating`); without a scaler the
        step ends where every optimizer has stepped."""
        w = self
        before = opt.step
        orig = self._updating(before)
        key = id(opt)

        def step(_opt, *a, **k):
            w.inner_stepped = True
            r = orig(*a, **k)
            if w.active and w.scaler is None and not w.optimizer_depth:
                w.stepped.add(key)
                if len(w.stepped) == len(w.optimizers):
                    w._end_step(None, None)
            return r

        # The marks others left on the step it wraps (an LR scheduler made before `watch`
        # checks its own is still there).
        step.__dict__.update(getattr(getattr(before, "__func__", before), "__dict__", {}))
        return step

    def _found_inf(self):
        states = getattr(self.scaler, "_per_optimizer_states", {})
        found = []
        for st in states.values():
            for v in st.get("found_inf_per_device", {}).values():
                found.append(v.detach().reshape(-1).to(torch.float64))
        return torch.cat(found).sum() if found else None

    def on_backward(self, roots):
        """A backward from `roots` starts: their nodes are named, and their sum, when each
        is one value, is the micro-batch's loss (the gradient is the sum's), or adds to it
        where the model was not called since the last backward."""
        for root in roots:
            self._name_loss(root)
        self.backwards += 1
        if self.active and roots and all(r.numel() == 1 for r in roots):
            total = sum(r.detach().reshape(()).to(torch.float64) for r in roots)
            if self.losses and self.model_calls and self.model_calls == self.calls_at_backward:
                # Several losses of one forward, each backpropagated on its own
                # (`retain_graph=True`): one micro-batch, whose loss is their sum (the
                # gradients are). Without calls of the model seen, each backward is one.
                self.losses[-1] = self.losses[-1] + total
            else:
                self.losses.append(total.clone())
        self.calls_at_backward = self.model_calls

    def _end_step(self, scale_before, found, replay=False):
        """The step ends: its figures are read back (once), a skip its checks did not see
        replays it where `replay` says it may, and its record is written."""
        read = None
        self.busy = True
        try:
            # The step's own figures are not ops of the script: no mode sees them.
            with _disable_current_modes():
                read = self._read_step(scale_before, found)
        except Exception:
            self.fail()
        finally:
            self.busy = False
        if read is not None and replay and read["found_inf"] and self.active:
            self._replay()
        # No collection while the record is built, written and dropped with the step's ops:
        # none of it can be garbage before then, and a collection in between would only
        # move it to the older generations, whose growth brings on collections of the
        # whole heap (about 250 ms with torch and transformers loaded); dropped, it leaves
        # the collector's counts as they were.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.busy = True
            try:
                with _disable_current_modes():
                    if read is not None and self.active:
                        self._finish(read)
            except Exception:
                self.fail()
            finally:
                self.busy = False
            self.step += 1
            self._begin_step()
        finally:
            if collecting:
                gc.enable()

    def _read_step(self, scale_before, found):
        """Everything the step gathered on its devices, read back in one transfer per
        device: the scaler's figures, the losses, the parameters' figures (begun here; a
        second read only where they need counts a step like the last did not), the ops'
        statistics."""
        sc = self.scaler
        names = [(_own_name(n), p) for n, p in self.names.root.named_parameters()]
        with torch.no_grad():
            # (read now: no copy of the scaler's tensors is needed)
            scale_after = sc._scale if sc is not None else None
            growth_tracker = sc._growth_tracker if sc is not None else None
            params = begin_param_vectors(
                [p for _, p in names], 1.0 if scale_before is None else scale_before, self.counted, self.scale_guess
            )
            scalars = [scale_before, scale_after, found, growth_tracker]
            present = [t for t in scalars if t is not None]
            got = _stats.gather(present + list(self.losses) + params.parts + self.full_vecs + self.check_vecs)
            host = iter(got[: len(present)])
            scale_host, scale_after_host, found_host, growth = (
                d if t is None else float(next(host)[0]) for t, d in zip(scalars, (1.0, 1.0, 0.0, 0.0))
            )
            k = len(present)
            losses = [v[0] for v in got[k : k + len(self.losses)]]
            k += len(self.losses)
            read_params = got[k : k + len(params.parts)]
            k += len(params.parts)
            pv = params.finish(read_params, scale_host, self.scratch)
            self.counted = params.counted
            # The next step's scale, unless the script sets another.
            self.scale_guess = scale_after_host if sc is not None else None
        return {
            "names": names,
            "params": pv,
            "scale": scale_host,
            "scale_after": scale_after_host,
            "found_inf": found_host > 0,
            "growth": int(growth),
            "losses": losses,
            "full": got[k : k + len(self.full_vecs)],
            "check": got[k + len(self.full_vecs) :],
        }

    def _finish(self, read):
        sc = self.scaler
        # A replay after the read back adds ops: their statistics are read now.
        full = read["full"] + _stats.gather(self.full_vecs[len(read["full"]) :])
        check = read["check"] + _stats.gather(self.check_vecs[len(read["check"]) :])
        names, pv, losses = read["names"], read["params"], read["losses"]
        scale_host, scale_after_host, growth = read["scale"], read["scale_after"], read["growth"]
        found_inf = read["found_inf"]
        if self.replayed and self.ops:
            # Replayed ops were appended after the step's own: each goes where its index puts it.
            order = sorted(range(len(self.ops)), key=lambda i: _order_key(self.ops[i]["index"]))
            pos = [0] * len(order)
            for new, old in enumerate(order):
                pos[old] = new
            self.ops = [self.ops[i] for i in order]
            for i, op in enumerate(self.ops):
                op["preds"] = [pos[p] for p in op["preds"]]
                op["index"] = i
        vecs = [full[i] if kind == "full" else check[i] for kind, i in (op["vec"] for op in self.ops)]
        # Ops after the last backward (the script's own bookkeeping) belong to the last
        # micro-batch, not to one that never ran.
        last = max(0, len(losses) - 1)
        for op in self.ops:
            if op["micro"] > last:
                op["micro"] = last
        origins = self._origins(vecs, check)
        # A failing step: a value of it went non-finite, or the scaler found one, or the
        # loss is. (A non-finite value that only passes through, such as the last step's
        # loss kept by the script, does not make a step fail.)
        failing = (
            origins["first_inf"] is not None
            or origins["first_nan"] is not None
            or found_inf
            or any(l != l or abs(l) == float("inf") for l in losses)
        )
        events = []
        if self.replay_note is not None and failing:
            events.append(
                f"amprobe_torch: the failing step could not be replayed ({self.replay_note}); "
                "only the ops around the model and the optimizer's are recorded; later steps check every op"
            )
        if self.light_cut and failing and origins["first_inf"] is None and origins["first_nan"] is None:
            events.append(
                "amprobe_torch: the step's origin is not known: "
                + (
                    "up to its optimizer's update it was checked only at the model's outputs, and its model "
                    "calls inside the update (an optimizer's closure) cannot be replayed as they ran"
                    if self.light_cut == "update"
                    else "up to its call of torch.autograd.grad it was checked only at the model's outputs, "
                    "and a replay's one backward cannot stand for its several (a gradient penalty)"
                    + ("; later steps check every op" if not self.light_ok else "")
                )
            )
        if self.segment_note and failing and origins["first_inf"] is None and origins["first_nan"] is None:
            events.append(
                "amprobe_torch: the step's origin is not known: the scaler skipped an optimizer's update after "
                "another's, and the model calls it would replay ran before that other update changed parameters"
            )
        if self.abandoned:
            events.append(
                "amprobe_torch: the script zeroed this step's gradients without an optimizer update: "
                "the step is recorded as skipped"
            )
        if self.replay_backward_note is not None:
            events.append(
                f"amprobe_torch: the failing step's backward could not be replayed ({self.replay_backward_note}); "
                "its forward is recorded, its backward only around the model; later steps check every op"
            )
        records = None
        if self.kept or failing:
            records = []
            # (ops that share a vector, a view and its input, share its statistics' record)
            converted = {}
            for op, v in zip(self.ops, vecs):
                st = converted.get(op["vec"])
                if st is None:
                    st = _stats.from_full(v) if op["vec"][0] == "full" else _stats.from_check(v)
                    converted[op["vec"]] = st
                masked = st["neg_inf"] if op["masked"] else 0
                records.append(
                    {
                        "micro": op["micro"],
                        "index": op["index"],
                        "phase": op["phase"],
                        "op": op["op"],
                        "module": op["module"],
                        "inputs": [_meta(m) for m in op["inputs"]],
                        "output": _meta(op["output"]),
                        "stats": st,
                        "rounding": {"overflow": 0, "underflow": 0},
                        "forward_op": None,
                        "wrt": None,
                        "masked_neg_inf": masked,
                    }
                )
        params = []
        for (name, p), v in zip(names, pv):
            has_grad = v[0] > 0
            finite_nonzero = v[6]
            # A distributed parameter's figures are of this rank's shard.
            n = _stats.local(p).numel()
            params.append(
                {
                    "name": name,
                    "dtype": _stats.DTYPE_NAMES.get(p.dtype, "float32"),
                    "grad_dtype": _stats.DTYPE_NAMES.get(p.grad.dtype) if has_grad and p.grad is not None else None,
                    "numel": n,
                    "grad_l2": jfloat(v[1] ** 0.5),
                    "max_abs_grad": jfloat(v[2]),
                    "zero_frac": v[3] / n if n else 0.0,
                    "f16_underflow_frac_unscaled": v[4] / finite_nonzero if finite_nonzero else 0.0,
                    "f16_underflow_frac_scaled": v[5] / finite_nonzero if finite_nonzero else 0.0,
                    "nonfinite": int(v[7]),
                    "param_max_abs_after": jfloat(v[8]),
                    "param_nan_after": int(v[9]),
                }
            )
        loss = None
        scaled = None
        if losses:
            scaled = sum(losses) / len(losses)
            loss = scaled / scale_host if sc is not None else scaled
        if self.writer is None:
            self.writer = TraceWriter(self.path)
            self.writer.write("header", self._header())
        lr = self.optimizers[0].param_groups[0].get("lr", 0.0)
        self.writer.write(
            "step",
            {
                "step": self.step,
                "micro_batches": max(1, len(losses)),
                "loss": jfloat(loss),
                "scaled_loss": jfloat(scaled) if sc is not None else None,
                "scale_before": jfloat(scale_host),
                "scale_after": jfloat(scale_after_host),
                "found_inf": found_inf,
                "skipped": found_inf or self.abandoned,
                "growth_tracker": growth,
                "grad_norm": None,
                "clip_coef": None,
                "lr": jfloat(float(lr)),
                "weight_casts": 0,
                "origins": origins,
                "params": params,
                "ops": records,
                "op_count": self.op_count + self.replayed_ops,
                "events": events,
                "wall_ms": (time.perf_counter() - self.t0) * 1000.0,
                "skip_cause": None,
            },
        )

    def _origins(self, vecs, check):
        """First Inf and first NaN (an op whose output has one that none of its inputs had)
        and the chain of ops that carried them on, from the vectors of this step's ops
        (full or check: both begin numel, NaN, +inf, -inf)."""
        n = len(self.ops)
        has_inf = [False] * n
        has_nan = [False] * n
        first_inf = first_nan = None
        if not any(v[1] + v[2] + v[3] for v in vecs):
            return {"first_inf": None, "first_nan": None, "chain": []}
        for i, (op, v) in enumerate(zip(self.ops, vecs)):
            out_inf = v[2] + (0 if op["masked"] else v[3]) > 0
            out_nan = v[1] > 0
            in_inf = any(has_inf[p] for p in op["preds"]) or any(check[e][2] + check[e][3] > 0 for e in op["ext"])
            in_nan = any(has_nan[p] for p in op["preds"]) or any(check[e][1] > 0 for e in op["ext"])
            has_inf[i] = out_inf
            has_nan[i] = out_nan
            if op["eligible"]:
                if first_inf is None and out_inf and not in_inf:
                    first_inf = i
                if first_nan is None and out_nan and not in_nan:
                    first_nan = i
        chain = [self._ref(i) for i in self._chain(first_inf, first_nan)]
        return {
            "first_inf": self._ref(first_inf) if first_inf is not None else None,
            "first_nan": self._ref(first_nan) if first_nan is not None else None,
            "chain": chain,
        }

    def _chain(self, a, b):
        """Ops on a data path from the first Inf (a) to the first NaN (b), in execution
        order; just the origin when there is one, or when the NaN does not descend from
        the Inf (amprobe's own rule)."""
        if a is None or b is None:
            return [x for x in (a, b) if x is not None]
        if a == b:
            return [a]
        if b < a:
            return [b]
        parent, seen, stack = {}, {b}, [b]
        while stack:
            n = stack.pop()
            if n == a:
                path, cur = [a], a
                while cur in parent:
                    cur = parent[cur]
                    path.append(cur)
                return path
            for p in self.ops[n]["preds"]:
                if p >= a and p not in seen:
                    seen.add(p)
                    parent[p] = n
                    stack.append(p)
        return [a, b]

    def _ref(self, i):
        op = self.ops[i]
        return {
            "step": self.step,
            "micro": op["micro"],
            "phase": op["phase"],
            "op_index": op["index"],
            "op": op["op"],
            "module": op["module"],
            "forward_op": None,
        }

    def _header(self):
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if self.autocast_dtype == torch.float16:
            precision = "fp16"
        elif self.autocast_dtype == torch.bfloat16:
            precision = "bf16"
        else:
            # Without autocast, the dtype most of the parameters' values are in: a model
            # made 16-bit (`model.half()`, `model.bfloat16()`) trains in it throughout,
            # amprobe's "half" and "bfloat16-pure" modes.
            by_dtype = {}
            for p in self.model.parameters():
                by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
            most = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
            precision = {torch.float16: "half", torch.bfloat16: "bfloat16-pure"}.get(most, "fp32")
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
        sc = self.scaler
        header = {
            "schema_version": SCHEMA_VERSION,
            "tool": "amprobe",
            "tool_version": TOOL_VERSION,
            "model": " + ".join(type(m).__name__ for m in self.names.root.values())
            if self.several
            else type(self.names.root).__name__,
            "precision": precision,
            "autocast_dtype": _stats.DTYPE_NAMES.get(self.autocast_dtype) if self.autocast_dtype else None,
            "policy_device": dev.type,
            "policy": None,
            "scaler": None
            if sc is None
            else {
                "init_scale": sc._init_scale,
                "growth_factor": sc._growth_factor,
                "backoff_factor": sc._backoff_factor,
                "growth_interval": sc._growth_interval,
            },
            "optimizer": {"kind": " + ".join(type(o).__name__ for o in self.optimizers)},
            "backend": dev.type,
            "seed": 0,
            "command_line": list(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
            "config": {},
            "source": {
                "kind": "pytorch",
                "torch": torch.__version__,
                "rank": rank,
                "world_size": world,
                "sample_every": self.sample_every,
                "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                "transformers": _plan.is_transformers(self.names.root),
            },
        }
        if device_name is not None:
            header["device"] = device_name
        return header

    def close(self):
        """Ends the capture: writes the end record and stops observing."""
        if self.closed:
            return
        self.closed = True
        self.active = False
        try:
            if not self.paused:
                self.mode.__exit__(None, None, None)
            self.paused = False
        except Exception:
            pass
        try:
            self.names.close()
            for h in self.call_hooks:
                h.remove()
            if self.eager:
                self.eager = False
                _release_eager()
        except Exception:
            pass
        if self.writer is not None:
            wall = (time.perf_counter() - self.started) * 1000.0
            self.writer.write("end", {"steps": self.step, "verdict": "", "wall_ms": wall})
            self.writer.close()


_WATCHERS = []
_BACKWARD = None

# Watchers open, and Dynamo's stance before the first of them set it to run eagerly.
_EAGER = {"open": 0, "before": None}


def _force_eager():
    """Runs `torch.compile`d code eagerly while a watcher is open: a dispatch mode sees no
    op inside a compiled graph, and Dynamo compiles nothing under one, so a step checked by
    modules (the mode off the stack) would otherwise run compiled kernels that a kept step
    and a replay do not, and train otherwise than the step it stands for."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return False
    if _EAGER["open"] == 0:
        try:
            from torch._dynamo import eval_frame

            _EAGER["before"] = getattr(eval_frame, "_stance", None)
            set_stance("force_eager")
        except Exception:  # (never stop the script over it: compiled code stays compiled)
            sys.stderr.write("amprobe_torch: could not make torch.compile run eagerly; compiled code goes unseen\n")
            return False
    _EAGER["open"] += 1
    return True


def _release_eager():
    """Puts Dynamo's stance back where the last open watcher closes."""
    _EAGER["open"] -= 1
    if _EAGER["open"] == 0:
        before = _EAGER["before"]
        if before is not None and before.stance == "default" and before.backend is not None:
            torch.compiler.set_stance("default", force_backend=before.backend)
        elif before is not None:
            torch.compiler.set_stance(before.stance, skip_guard_eval_unsafe=before.skip_guard_eval_unsafe)
        else:
            torch.compiler.set_stance("default")


# Whether this thread is inside a backward the watchers were told of (a tensor's
# `backward` calls `torch.autograd.backward`, which must not tell them again).
_IN_BACKWARD = threading.local()


def _seeds_needed(roots, given):
    """Whether a backward of `roots` makes its own seeds (ones, for one-value roots, when
    none are given) that a step checked by modules makes here instead, while the mode still
    sees them (as in a step recorded in full): the same values either way."""
    return given is None and roots and all(r.numel() == 1 for r in roots) and any(
        w.light and w.active for w in _WATCHERS
    )


def _told_backward(roots, given, run):
    """Runs `run(seeds)`, a backward from `roots` (the losses) with the gradients `given`
    for them, told to the watchers: each names the roots' nodes and keeps their loss, and
    a step checked by modules pauses its mode for the model's own nodes. `seeds` are the
    roots' seeds made here (`_seeds_needed`), or None."""
    light = []
    for w in _WATCHERS:
        if w.active and not w.busy:
            w.busy = True
            try:
                w.on_backward(roots)
            except Exception:
                w.fail()
            finally:
                w.busy = False
    # (after the loss is kept: the seeds belong to its micro-batch, as the backward's own do)
    seeds = None
    if _seeds_needed(roots, given):
        seeds = [torch.ones_like(t, memory_format=torch.preserve_format) for t in roots]
    for w in _WATCHERS:
        if w.light and w.active and not w.busy:
            w.busy = True
            try:
                light.append((w, w.before_backward()))
            except Exception:
                w.fail()
            finally:
                w.busy = False
    _IN_BACKWARD.depth = getattr(_IN_BACKWARD, "depth", 0) + 1
    try:
        return run(seeds)
    finally:
        _IN_BACKWARD.depth -= 1
        for w, paused in reversed(light):
            try:
                w.after_backward(paused)
            except Exception:
                w.fail()


def _install_backward_hook():
    """Notes the roots of every backward (the loss) for the watchers, whether the script
    calls a tensor's `backward` or `torch.autograd.backward`."""
    global _BACKWARD
    if _BACKWARD is not None:
        return
    orig = torch.Tensor.backward
    orig_fn = torch.autograd.backward
    _BACKWARD = orig

    def backward(self, *a, **k):
        def run(seeds):
            if seeds is not None:
                k["gradient"] = seeds[0]
            return orig(self, *a, **k)

        return _told_backward([self], a[0] if a else k.get("gradient"), run)

    @functools.wraps(orig_fn)
    def autograd_backward(tensors, grad_tensors=None, *a, **k):
        if getattr(_IN_BACKWARD, "depth", 0):
            return orig_fn(tensors, grad_tensors, *a, **k)
        one = isinstance(tensors, torch.Tensor)
        if not one:
            tensors = list(tensors)  # (any iterable, read once)
        roots = [tensors] if one else [t for t in tensors if isinstance(t, torch.Tensor)]

        def run(seeds):
            grads = grad_tensors if seeds is None else (seeds[0] if one else seeds)
            return orig_fn(tensors, grads, *a, **k)

        given = grad_tensors if grad_tensors is not None else k.get("grad_variables")
        if len(roots) != (1 if one else len(tensors)):
            # Roots that are not tensors (autograd's gradient edges): their seeds are
            # autograd's to make.
            given = tensors
        return _told_backward(roots, given, run)

    torch.Tensor.backward = backward
    torch.autograd.backward = autograd_backward


_AUTOGRAD_GRAD = None


def _install_grad_hook():
    """Tells the watchers when the script calls `torch.autograd.grad` (not a replay's own)."""
    global _AUTOGRAD_GRAD
    if _AUTOGRAD_GRAD is not None:
        return
    orig = torch.autograd.grad
    _AUTOGRAD_GRAD = orig

    @functools.wraps(orig)
    def grad(*a, **k):
        for w in _WATCHERS:
            if w.active and not w.busy and not w.replaying:
                w.on_autograd_grad()
        return orig(*a, **k)

    torch.autograd.grad = grad


# torch.nn.utils' gradient clipping, as scripts and trainers call it (through the module).
_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
_CLIPS_INSTALLED = False


def _install_clip_hooks():
    """Runs torch's gradient clipping in the watchers' optimizer phase, as amprobe's own
    steps clip: it prepares the gradients for the update (without a scaler, nothing else
    marks where the optimizer phase begins). A step checked by modules decides there, as
    where it enters the optimizer's step, whether it failed."""
    global _CLIPS_INSTALLED
    if _CLIPS_INSTALLED:
        return
    _CLIPS_INSTALLED = True
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    for mod in (utils, clip_grad):
        for name in _CLIP_FUNCTIONS:
            f = getattr(mod, name, None)
            if f is not None and not getattr(f, "_amprobe_phase", False):
                setattr(mod, name, _in_optimizer_phase(f))


def _in_optimizer_phase(f):
    @functools.wraps(f)
    def run(*a, **k):
        entered = []
        for w in _WATCHERS:
            if w.active and not w.busy:
                w._enter_optimizer()
                entered.append(w)
        try:
            return f(*a, **k)
        finally:
            for w in entered:
                w.optimizer_depth -= 1

    run._amprobe_phase = True
    return run


def trace_path():
    """$AMPROBE_TRACE, else amprobe-trace.jsonl; `.rank{N}` before the suffix under a
    distributed run of more than one rank."""
    path = os.environ.get("AMPROBE_TRACE") or "amprobe-trace.jsonl"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{torch.distributed.get_rank()}{ext}"
    return path
