"""The watcher: the lifecycle of one capture (`watch` makes it, `close` undoes it) and the
step's course through it: module calls (checked at their outputs, or held for a replay),
backwards, the optimizer phase, where a step is decided and where it ends, read back once
and written as an amprobe step record. The ops themselves are recorded by `_recorder`, named
by `_names`, and replayed by `_replay`."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
import traceback

from typing import Any, List, Optional, Tuple, Union

import torch

from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

try:
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover - older torch: the mode sees the step's own figures
    _disable_current_modes = contextlib.nullcontext

from . import _intercept, _origins, _patches, _replay, _stacks, _stats
from ._attach import sharded as _sharded
from ._carried import CarriedChecks
from ._carried import key as _key
from ._dispatch import CaptureMode
from ._hooks import ModuleHook
from ._names import Names, Spans, own_name
from ._names import SEQUENCE_NR as _SEQUENCE_NR
from ._params import Scratch, begin_param_vectors
from ._patches import Patches
from ._records import OpInfo, VecRef, describe, in_order
from ._registry import WATCHERS
from ._replay import Call, keep_grad
from ._step_record import compiled_regions, header, matmul_dtype, op_records, param_records
from ._step_state import StepKind, StepState
from ._trace import TraceWriter, jfloat
from ._tree import leaves

# A step checked by modules holds its model calls' inputs until it ends; past this many
# calls in one step it stops (and, if the step fails, says it could not replay it).
MAX_CALLS = 64

# Module outputs checked together (on a device, by a few multi-tensor kernels).
_OUTPUTS_BATCH = 32


def _full_value(t: Any) -> Any:
    """A DTensor's value as a plain tensor where each rank holds all of it (replicated);
    None where it is spread over ranks (FSDP2's clipping may return its total norm as
    partial sums): reducing it would be a collective of the companion's own, which hangs
    every rank where one rank's capture has stopped. Anything else as it is."""
    if type(t).__name__ != "DTensor":
        return t
    if all(type(p).__name__ == "Replicate" for p in t.placements):
        return t.to_local()
    return None


class Watcher:
    """What `watch` returns: the capture of one model's training, step by step."""

    def __init__(
        self,
        model: torch.nn.Module,
        called: List[torch.nn.Module],
        optimizers: List[Any],
        scaler: Optional[Any],
        path: str,
        sample_every: int,
        check: str = "modules",
        patches: Optional[Patches] = None,
    ) -> None:
        """`model`, `called` and `optimizers` as `gather_models` and `gather_optimizers`
        give them."""
        self._what_is_watched(model, called, optimizers, scaler, path, sample_every)
        self._run_state()
        # Steps that are not kept are checked by modules and replayed when they fail, unless
        # every op must be checked (AMPROBE_CHECK=ops) or the model is sharded (a replay of
        # one rank's forward would wait on collectives the other ranks do not make).
        sharded = any(_sharded(m) for m in called)
        self.light_ok = check == "modules" and not sharded
        self.spans = Spans()
        # Host checks of the tensors the training owns across steps (parameters, optimizer
        # state), by key: (version counter, check) as an op last wrote or read them (see
        # `CarriedChecks.known_check`). Not for a sharded model: a collective writes its parameters'
        # gathered values without moving their version counters.
        self.carried = CarriedChecks(not sharded)
        self._begin_step()
        self.names = Names(model)
        # Every hook and replaced method of this watcher's (the plan's among them), undone
        # at `close`.
        self.patches = patches if patches is not None else Patches()
        self.fn_info = {}
        self.scratch = Scratch()
        # Ids of the parameters whose figures needed more than the shortcut last step (see
        # `begin_param_vectors`), and the scale the next step is expected to have.
        self.counted = {}
        self.scale_guess = None
        self.mode = None
        self.eager = None
        # Whether the dispatch mode is off the stack for good (an internal error: `fail`).
        self.mode_stopped = True
        try:
            self._attach()
        except Exception:
            # (what it did attach is undone; `watch` reports the error)
            self.close()
            raise

    def _what_is_watched(
        self, model: torch.nn.Module, called: List[torch.nn.Module], optimizers: List[Any], scaler: Optional[Any],
        path: str, sample_every: int,
    ) -> None:
        """What is watched, and what the header says of it."""
        self.model = model
        self.called = called
        self.scaler_given = scaler
        self.rewatched = False
        # (a ModuleDict `gather_models` made to hold several models, not a model given)
        self.several = isinstance(model, torch.nn.ModuleDict) and not any(model is c for c in called)
        self.optimizers = optimizers
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.path = path
        self.sample_every = sample_every
        # Autocast's dtype where a module's forward ran under it (read until the header is
        # written), and the device type whose autocast state is read.
        self.autocast_dtype = None
        self.device_type = next((p.device.type for p in model.parameters()), "cpu")
        # What discovery found (`_discover`), for the header; None where `watch` was called.
        self.discovery = None
        # Whether the model was given compiled (`torch.compile`'s `OptimizedModule`).
        self.compiled_given = any(type(m).__name__ == "OptimizedModule" for m in called)

    def _run_state(self) -> None:
        """The capture's own state as the run goes (active, busy, failed, the step, the
        verdict so far)."""
        self.active = True
        self.busy = False
        self.failed = None
        self.step = 0
        self.writer = None
        # The run's verdict so far, by the runner's rule (written in the end record).
        self.saw_forward_origin = False
        self.saw_skip = False
        self.params_finite = True
        self.optimizer_depth = 0
        self.closed = False
        self.started = time.perf_counter()
        self.tree_depth = 0
        self.paused = False
        # Whether the outermost model call running now paused the mode (`_call_enter`).
        self.call_paused = False

    def _attach(self) -> None:
        """Hooks the modules, installs the interceptions and enters the dispatch mode."""
        for m in self.names.root.modules():
            self.patches.hold(m.register_forward_pre_hook(ModuleHook(self.guard(self._call_enter)), with_kwargs=True))
            self.patches.hold(m.register_forward_hook(ModuleHook(self.guard(self._call_leave)), always_call=True))
        self.eager = _patches.acquire()
        self.mode = CaptureMode(self)
        self.mode.__enter__()
        self.mode_stopped = False
        _intercept.install(self)
        _stacks.adopt_accelerate(self)

    # ---- the step's state

    def _begin_step(self) -> None:
        """A new step's state (`StepState`), its kind by whether its records are kept."""
        if self.step == 0 or (self.sample_every > 0 and self.step % self.sample_every == 0):
            kind = StepKind.FULL
        else:
            _stats.release_scratch()
            kind = StepKind.MODULES if self.light_ok else StepKind.OPS
        params = list(self.model.parameters())
        self.st = StepState(kind, param_keys={_key(p) for p in params})
        # (the optimizers' state only where checks can be carried: on the host)
        self.carried.begin_step(self.st.param_keys, params, self.optimizers)
        self.spans.begin_step()

    def _autocast_state(self) -> None:
        """Reads autocast's state where a module's forward starts (inside the dispatcher,
        autocast's own kernels hide it): at every module, as autocast may be entered inside
        the model's forward (Accelerate's, the HF Trainer's) or the script may call only
        submodules (a Lightning `training_step`)."""
        if torch.is_autocast_enabled(self.device_type):
            self.autocast_dtype = torch.get_autocast_dtype(self.device_type)

    def fail(self) -> None:
        """Reports the companion's own error once and stops capturing; training goes on,
        with the dispatch mode off the stack where it is on top (its ops then reach no
        Python), and the trace written so far as it is."""
        if self.failed is None:
            self.failed = traceback.format_exc()
            sys.stderr.write(
                "amprobe_torch: capture stopped after an internal error "
                f"(training continues):\n{self.failed}"
            )
        self.active = False
        self.stop_mode()

    def stop_mode(self) -> None:
        """After an internal error: takes the dispatch mode off the stack where it is on
        top. Inside the mode's own dispatch it is not on the stack; the next hook or
        wrapped call of the watcher's outside it takes it off."""
        if self.failed is None or self.mode_stopped or self.paused or self.mode is None:
            return
        try:
            if _current_dispatch_mode() is self.mode:
                self.mode.__exit__(None, None, None)
                self.mode_stopped = True
        except Exception:
            pass

    def guard(self, f: Any) -> Any:
        """`f`, a hook the watcher puts in the script's way, with an error inside it
        reported (`fail`) instead of raised into the script."""

        def guarded(*a, **k):
            if self.failed is not None:
                self.stop_mode()
            try:
                return f(*a, **k)
            except Exception:
                self.fail()
                return None

        return guarded

    # ---- a step checked by modules

    def _pause(self) -> bool:
        """Takes the capture's dispatch mode off the stack, so that the ops that follow do
        not reach Python at all; not when another mode is above it (its ops then pass
        through `_Mode` unrecorded). Returns whether it did."""
        if self.paused or _current_dispatch_mode() is not self.mode:
            return False
        self.mode.__exit__(None, None, None)
        self.paused = True
        return True

    def _resume(self) -> None:
        """Puts the dispatch mode back after `_pause`."""
        if self.paused:
            self.paused = False
            if self.active:
                self.mode.__enter__()
            else:
                self.mode_stopped = True

    def _node_enter(self, grad_outputs: tuple) -> None:
        # An autograd node of the script's own ops, in a backward the mode is off for: its
        # ops are recorded (the engine restores its thread's modes after each node).
        if self.paused and self.active:
            self.mode.__enter__()

    def _node_leave(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self.paused and self.active and _current_dispatch_mode() is self.mode:
            self.mode.__exit__(None, None, None)

    def before_backward(self) -> bool:
        """A backward starts in a step checked by modules: the script's own nodes are
        hooked to record their ops, and the mode is paused for the rest. Returns whether
        it was paused (then `after_backward` resumes it)."""
        for node in self.st.loss_nodes - self.st.hooked_nodes:
            node.register_prehook(self.guard(self._node_enter))
            node.register_hook(self.guard(self._node_leave))
            self.st.hooked_nodes.add(node)
        return self._pause()

    def after_backward(self, paused: bool) -> None:
        self.st.backward_end[max(0, len(self.st.losses) - 1)] = self.st.op_count
        if paused:
            self._resume()

    def _call_enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.st.replaying:
            return
        if self.writer is None and self.autocast_dtype is None and self.active:
            try:
                self._autocast_state()
            except Exception:  # a hook of the user's forward: never kill the training
                self.fail()
        self._span_enter(module)
        self.tree_depth += 1
        if self.tree_depth == 1:
            self.call_paused = False
            if torch._C._current_graph_task_id() == -1:
                # (not a checkpointed block's recomputation inside a backward)
                self.st.model_calls += 1
            if self.st.light and self.st.in_update and self.active and not self.busy:
                # A call inside an update (an optimizer's closure: SAM's, which runs it on
                # parameters it moved): no replay can run it as it ran; the rest of the
                # step is checked op by op.
                self.st.check_every_op()
                self.st.light_cut = "update"
        if (
            self.tree_depth == 1
            and self.st.light
            and self.active
            and not self.busy
            and torch._C._current_graph_task_id() == -1
        ):
            if len(self.st.calls) >= MAX_CALLS:
                self.st.replay_note = f"more than {MAX_CALLS} calls of the model in one step"
                return
            self.busy = True
            try:
                with _disable_current_modes():
                    self.st.call = Call(module, args, kwargs, len(self.st.losses), self.st.op_count)
                self.st.calls.append(self.st.call)
            except Exception:
                self.fail()
            finally:
                self.busy = False
            # The model's own ops run without the mode (a replay records them). Only this
            # call's pause is undone where it ends: a call in a backward (a checkpointed
            # block's recomputation) pauses nothing, and must not resume what the backward
            # paused (the engine would then drop the mode when the node ends).
            self.call_paused = self._pause()

    def _call_leave(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        if self.st.replaying:
            return
        self.spans.leave()
        if self.tree_depth:
            self.tree_depth -= 1
        c = self.st.call
        if c is None or not self.st.light or not self.active or self.busy:
            if self.tree_depth == 0:
                self._end_call_pause()
            return
        self.busy = True
        try:
            for t in leaves(out, torch.Tensor):
                if _stats.floating(t):
                    self.st.call_outputs[id(t)] = t
            # Checked in batches: a forward's outputs are not all held until it ends.
            if self.tree_depth == 0 or len(self.st.call_outputs) >= _OUTPUTS_BATCH:
                self.st.out_flags.append(_stats.nonfinite_flag(list(self.st.call_outputs.values())))
                self.st.call_outputs = {}
            if self.tree_depth == 0:
                self.st.call = None
                for j, t in enumerate(leaves(out, torch.Tensor)):
                    if t.requires_grad:
                        t.register_hook(self.guard(functools.partial(keep_grad, c, j)))
        except Exception:
            self.fail()
        finally:
            self.busy = False
            if self.tree_depth == 0:
                self._end_call_pause()

    def _span_enter(self, module: torch.nn.Module) -> None:
        """Records the call's span where a step checked by modules runs it unseen (`Spans`)."""
        recorded = (
            _SEQUENCE_NR is not None
            and self.st.light
            and torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1
        )
        self.spans.enter(self.names.names.get(id(module), type(module).__name__) if recorded else None)

    def _end_call_pause(self) -> None:
        """Resumes the mode where an outermost call that paused it ends."""
        if self.call_paused:
            self.call_paused = False
            self._resume()

    def _decide(self) -> None:
        """Whether a step checked by modules failed so far (`_replay.decide`)."""
        _replay.decide(self)

    def _replay(self) -> None:
        """Replays the step's model calls under the capture (`_replay.replay`)."""
        _replay.replay(self)

    def _replay_key(self, phase: str) -> tuple:
        """Where a replayed op goes among the step's ops: a forward op where its call
        began, a backward op where its micro-batch's backward ended (after the script's
        own gradient ops, which ran first), in the order the replay ran them."""
        self.st.replay_seq += 1
        self.st.replayed_ops += 1
        if phase == "backward" or self.st.replay_call is None:
            return (self.st.backward_end.get(self.st.replay_micro, self.st.op_count), 0, self.st.replay_seq)
        return (self.st.replay_call.start, 0, self.st.replay_seq)

    # ---- op by op

    def _vector(self, t: Union[torch.Tensor, List[torch.Tensor]]) -> VecRef:
        """The statistics of a tensor, or of a list of tensors together, full or checked as
        this step records them."""
        if self.st.kept or self.st.failing:
            self.st.full_vecs.append(_stats.full_many(t) if isinstance(t, list) else _stats.full(t))
            return VecRef("full", len(self.st.full_vecs) - 1)
        self.st.check_vecs.append(_stats.check_many(t) if isinstance(t, list) else _stats.check(t))
        return VecRef("check", len(self.st.check_vecs) - 1)

    def _info(self, func: Any) -> OpInfo:
        """The op's `OpInfo`, cached."""
        info = self.fn_info.get(func)
        if info is None:
            info = self.fn_info[func] = describe(func, _stats.ALLOCATING)
        return info

    def _name_loss(self, loss: Any) -> None:
        """Names the loss's own autograd node (no op of the forward consumes the loss, so
        the forward did not name it)."""
        gf = getattr(loss, "grad_fn", None)
        if gf is not None and gf not in self.st.node_module:
            p = self.st.producer.get(_key(loss))
            if p is not None:
                self.st.node_module[gf] = self.st.ops[p].module
                if self.st.light:
                    self.st.loss_nodes.add(gf)

    # ---- step boundaries

    def _enter_optimizer(self) -> None:
        """One level deeper into the optimizer phase; a step checked by modules decides
        where it first enters it whether it failed. (An update given a closure with no call
        of the model before it decides where the closure returns: the gradients there now
        are the last step's, which the closure zeroes.)"""
        if (
            self.st.light
            and not self.st.decided
            and not self.optimizer_depth
            and self.active
            and not self.busy
            and (self.st.calls or not (self.st.later_segment or self.st.update_closure))
        ):
            self._decide()
        self.optimizer_depth += 1

    def on_autograd_grad(self) -> None:
        """The script calls `torch.autograd.grad` (a gradient penalty: the gradients of a
        loss, with their graph, enter the loss that is backpropagated). A replay runs the
        step's calls and one backward from the gradients their outputs received, which
        cannot reproduce several backwards and their double backward. So a step checked by
        modules is decided here, before any backward: the calls so far, if they failed, are
        replayed now (their forwards: no gradient has reached them yet), and the rest of
        the step is checked op by op; the next step is checked by modules again. Where the
        call comes from inside the model's forward or an update (no replay can run the
        calls there), the rest is checked op by op, and so are the steps after it."""
        if self.st.light:
            self.st.light_cut = "grad"
            if self.tree_depth == 0 and not self.optimizer_depth and not self.st.in_update and not self.st.decided:
                self._decide()
                self.st.check_every_op()
            else:
                self.st.check_every_op()
                self.light_ok = False

    def _abandon(self) -> None:
        """The script zeroes the gradients of a step that ran a backward and made no update
        (it skips a bad batch: `if not finite: optimizer.zero_grad(); continue`, or zeroes
        at the top of the next iteration after a `continue`): the step ends there, skipped.
        A step checked by modules decides first, while its gradients are still there. (With
        one optimizer only: where several train together, one's gradients are zeroed while
        another's update is still to come.)"""
        if self.st.light and not self.st.decided:
            self._decide()
        self.st.abandoned = True
        sc = self.scaler
        before = sc._scale.detach().clone() if sc is not None and sc._scale is not None else None
        self._end_step(before, _intercept.found_inf(sc) if sc is not None else None)

    def _new_segment(self) -> None:
        """After an update in a step checked by modules: the calls that follow are decided
        and replayed on their own (see `_updating`)."""
        self.st.decided = False
        self.st.calls = []
        self.st.replay_note = None
        # (a segment with no call of the model has nothing to decide)
        self.st.later_segment = True

    def on_backward(self, roots: List[torch.Tensor]) -> None:
        """A backward from `roots` starts: their nodes are named, and their sum, when each
        is one value, is the micro-batch's loss (the gradient is the sum's), or adds to it
        where the model was not called since the last backward."""
        for root in roots:
            self._name_loss(root)
        self.st.backwards += 1
        if self.active and roots and all(r.numel() == 1 for r in roots):
            total = sum(r.detach().reshape(()).to(torch.float64) for r in roots)
            if self.st.losses and self.st.model_calls and self.st.model_calls == self.st.calls_at_backward:
                # Several losses of one forward, each backpropagated on its own
                # (`retain_graph=True`): one micro-batch, whose loss is their sum (the
                # gradients are). Without calls of the model seen, each backward is one.
                self.st.losses[-1] = self.st.losses[-1] + total
            else:
                self.st.losses.append(total.clone())
        self.st.calls_at_backward = self.st.model_calls

    def _end_step(
        self, scale_before: Optional[torch.Tensor], found: Optional[torch.Tensor], replay: bool = False
    ) -> None:
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
            try:
                self._begin_step()
            except Exception:
                self.fail()
        finally:
            if collecting:
                gc.enable()

    def _read_step(self, scale_before: Optional[torch.Tensor], found: Optional[torch.Tensor]) -> dict:
        """Everything the step gathered on its devices, read back in one transfer per
        device: the scaler's figures, the losses, the parameters' figures (begun here; a
        second read only where they need counts a step like the last did not), the ops'
        statistics."""
        sc = self.scaler
        names = [(own_name(n), p) for n, p in self.names.root.named_parameters()]
        with torch.no_grad():
            # (read now: no copy of the scaler's tensors is needed)
            scale_after = sc._scale if sc is not None else None
            growth_tracker = sc._growth_tracker if sc is not None else None
            params = begin_param_vectors(
                [p for _, p in names], 1.0 if scale_before is None else scale_before, self.counted, self.scale_guess
            )
            scalars = [scale_before, scale_after, found, growth_tracker]
            present = [t for t in scalars if t is not None]
            norms = [n.detach().reshape(()).to(torch.float64) for n, _ in self.st.clips]
            got = _stats.gather(
                present + list(self.st.losses) + norms + params.parts + self.st.full_vecs + self.st.check_vecs
            )
            host = iter(got[: len(present)])
            scale_host, scale_after_host, found_host, growth = (
                d if t is None else float(next(host)[0]) for t, d in zip(scalars, (1.0, 1.0, 0.0, 0.0))
            )
            k = len(present)
            losses = [v[0] for v in got[k : k + len(self.st.losses)]]
            k += len(self.st.losses)
            clips = [(v[0], m) for v, (_, m) in zip(got[k : k + len(norms)], self.st.clips)]
            k += len(norms)
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
            "clips": clips,
            "full": got[k : k + len(self.st.full_vecs)],
            "check": got[k + len(self.st.full_vecs) :],
        }

    def _finish(self, read: dict) -> None:
        """Writes the step's record (and, before the first, the header) from what was read
        back."""
        vecs, origins = self._step_origins(read)
        losses, found_inf = read["losses"], read["found_inf"]
        # A failing step: a value of it went non-finite, or the scaler found one, or the
        # loss is. (A non-finite value that only passes through, such as the last step's
        # loss kept by the script, does not make a step fail.)
        failing = (
            origins["first_inf"] is not None
            or origins["first_nan"] is not None
            or found_inf
            or any(l != l or abs(l) == float("inf") for l in losses)
        )
        if self.writer is None:
            self.writer = TraceWriter(self.path)
            self.writer.write("header", self._header())
        record = self._step_record(read, vecs, origins, failing)
        self._tally(record)
        self.writer.write("step", record)

    def _tally(self, record: dict) -> None:
        """Keeps the run's verdict up to date with a step record (the runner's rule:
        `diagnose::summary::verdict`)."""
        o = record["origins"]
        first = o["first_inf"] or o["first_nan"]
        if first is not None and first.get("phase") == "forward":
            self.saw_forward_origin = True
        if record["skipped"]:
            self.saw_skip = True
        self.params_finite = all(
            p["param_nan_after"] == 0 and isinstance(p["param_max_abs_after"], float)
            and abs(p["param_max_abs_after"]) != float("inf")
            for p in record["params"]
        )

    def verdict(self) -> str:
        """The run's verdict from the steps written so far."""
        if not self.params_finite:
            return "diverged"
        if self.saw_forward_origin:
            return "forward-nonfinite"
        return "overflow-skips" if self.saw_skip else "clean"

    def _step_origins(self, read: dict) -> Tuple[list, dict]:
        """(each op's statistics vector, the step's origins), the ops in their order."""
        # A replay after the read back adds ops: their statistics are read now.
        full = read["full"] + _stats.gather(self.st.full_vecs[len(read["full"]) :])
        check = read["check"] + _stats.gather(self.st.check_vecs[len(read["check"]) :])
        if self.st.replayed and self.st.ops:
            # Replayed ops were appended after the step's own: each goes where its index puts it.
            self.st.ops = in_order(self.st.ops)
        vecs = [full[i] if kind == "full" else check[i] for kind, i in (op.vec for op in self.st.ops)]
        # Ops after the last backward (the script's own bookkeeping) belong to the last
        # micro-batch, not to one that never ran.
        last = max(0, len(read["losses"]) - 1)
        self.st.ops = [op._replace(micro=last) if op.micro > last else op for op in self.st.ops]
        return vecs, _origins.origins(self.st.ops, vecs, check, self.step)

    def _step_record(self, read: dict, vecs: list, origins: dict, failing: bool) -> dict:
        sc = self.scaler
        losses, scale_host = read["losses"], read["scale"]
        loss = scaled = None
        if losses:
            # The objective whose gradient the step applies: its micro-batches' backward
            # roots summed (a script that divides each by the accumulation count means
            # their mean, and the HF Trainer logs it).
            scaled = sum(losses)
            loss = scaled / scale_host if sc is not None else scaled
        grad_norm = clip_coef = None
        if read["clips"]:
            norm, max_norm = read["clips"][-1]
            grad_norm = norm
            if max_norm is not None:
                clip_coef = min(1.0, max_norm / (norm + 1e-6)) if norm == norm else None
        lr = self.optimizers[0].param_groups[0].get("lr", 0.0)
        return {
            "step": self.step,
            "micro_batches": max(1, len(losses)),
            "loss": jfloat(loss),
            "scaled_loss": jfloat(scaled) if sc is not None else None,
            "scale_before": jfloat(scale_host),
            "scale_after": jfloat(read["scale_after"]),
            "found_inf": read["found_inf"],
            "skipped": read["found_inf"] or self.st.abandoned,
            "growth_tracker": read["growth"],
            "grad_norm": jfloat(grad_norm) if grad_norm is not None else None,
            "clip_coef": jfloat(clip_coef) if clip_coef is not None else None,
            "lr": jfloat(float(lr)),
            "weight_casts": 0,
            "origins": origins,
            "params": param_records(read["names"], read["params"]),
            "ops": op_records(self.st.ops, vecs) if self.st.kept or failing else None,
            "op_count": self.st.op_count + self.st.replayed_ops,
            "events": self._events(failing, origins),
            "wall_ms": (time.perf_counter() - self.st.t0) * 1000.0,
            "skip_cause": None,
        }

    def _events(self, failing: bool, origins: dict) -> List[str]:
        """The step record's events: what the capture could not do for this step, and a
        skip the script made."""
        events = []
        if self.st.replay_note is not None and failing:
            events.append(
                f"amprobe_torch: the failing step could not be replayed ({self.st.replay_note}); "
                "only the ops around the model and the optimizer's are recorded; later steps check every op"
            )
        if self.st.light_cut and failing and origins["first_inf"] is None and origins["first_nan"] is None:
            events.append(
                "amprobe_torch: the step's origin is not known: "
                + (
                    "up to its optimizer's update it was checked only at the model's outputs, and its model "
                    "calls inside the update (an optimizer's closure) cannot be replayed as they ran"
                    if self.st.light_cut == "update"
                    else "up to its call of torch.autograd.grad it was checked only at the model's outputs, "
                    "and a replay's one backward cannot stand for its several (a gradient penalty)"
                    + ("; later steps check every op" if not self.light_ok else "")
                )
            )
        if self.st.segment_note and failing and origins["first_inf"] is None and origins["first_nan"] is None:
            events.append(
                "amprobe_torch: the step's origin is not known: the scaler skipped an optimizer's update after "
                "another's, and the model calls it would replay ran before that other update changed parameters"
            )
        if self.st.abandoned:
            events.append(
                "amprobe_torch: the script zeroed this step's gradients without an optimizer update: "
                "the step is recorded as skipped"
            )
        if self.st.replay_backward_note is not None:
            events.append(
                f"amprobe_torch: the failing step's backward could not be replayed ({self.st.replay_backward_note}); "
                "its forward is recorded, its backward only around the model; later steps check every op"
            )
        return events

    def _header(self) -> dict:
        return header(self.model, self.names.root, self.several, self.autocast_dtype, self.scaler,
                      self.optimizers, self.sample_every, ran=matmul_dtype(self.st.ops),
                      discovery=self.discovery, compiled=compiled_regions(self.names.root, self.compiled_given),
                      eager=bool(self.eager))

    def on_clip(self, norm: Any, max_norm: Any) -> None:
        """Gradient clipping by norm ran in this step (torch's, as the script, the HF Trainer,
        Lightning or Accelerate call it): the total norm, and the max_norm it clipped to
        (None: the norm alone was taken, `get_total_norm`; a clipping with it that
        follows keeps that norm)."""
        norm = _full_value(norm)
        if isinstance(norm, torch.Tensor) and norm.numel() == 1:
            try:
                m = float(max_norm) if max_norm is not None else None
            except (TypeError, ValueError):
                m = None
            if m is None and self.st.clips and self.st.clips[-1][0] is norm:
                return
            self.st.clips.append((norm, m))

    def close(self) -> None:
        """Ends the capture: writes the end record, stops observing, and removes every hook
        and puts back every function and method it replaced (the process is then as if
        `watch` had never run; see `_patches.Patches.replace` for one that something else
        replaced after it)."""
        if self.closed:
            return
        self.closed = True
        self.active = False
        try:
            if not self.paused and not self.mode_stopped:
                self.mode.__exit__(None, None, None)
            self.paused = False
            self.mode_stopped = True
        except Exception:
            pass
        try:
            self.names.close()
            self.patches.undo()
            if self.eager is not None:
                self.eager = None
                _patches.release()
        except Exception:
            pass
        if self in WATCHERS:
            WATCHERS.remove(self)
        if self.writer is not None:
            wall = (time.perf_counter() - self.started) * 1000.0
            try:
                self.writer.write("end", {"steps": self.step, "verdict": self.verdict(), "wall_ms": wall})
            except Exception:
                self.fail()
            finally:
                self.writer.close()


_WATCHERS = WATCHERS


