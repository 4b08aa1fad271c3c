"""The state of the step being captured: one object, made new where each step begins, whose
kind says how the step is checked."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch

from . import _stats


class StepKind(enum.Enum):
    """How a step's ops are checked."""

    # A kept step (the first, every AMPROBE_SAMPLE_EVERY): every op's full statistics.
    FULL = "full statistics"
    # Every op checked for Inf and NaN (AMPROBE_CHECK=ops, a sharded model, or the rest of
    # a step checked by modules after a cut or a replay); full statistics from the first
    # non-finite value on.
    OPS = "every op checked"
    # Only the model's outputs, the script's own ops, the loss and the gradients checked; a
    # failing step is replayed op by op (the default).
    MODULES = "checked by modules"


_expired = torch.UntypedStorage._expired


class LiveMap:
    """Tensor key (`_carried.key`) -> what the step knows of that tensor, for as long as its
    values live: an entry whose storage was freed is not found. Memory freed is handed to
    the next tensor made, and one made where the mode does not see it (`torch.tensor`'s
    values, which `lift_fresh` then reads; a paused model's ops) would otherwise have its
    key matched to what the freed one held (AdamW's step counter, `torch.tensor(0.)`, read
    as the loss's gradient seed of 1 freed just before it)."""

    __slots__ = ("_entries", "_gone", "_refs")

    def __init__(self) -> None:
        # key -> (value, weak reference to the storage, or None where it cannot be read)
        self._entries: Dict[tuple, tuple] = {}
        # The values of the entries found freed.
        self._gone: List[Any] = []
        # Every weak reference taken, released with the map: a weak reference keeps a freed
        # storage's bookkeeping (not its memory), so no other storage takes its identity
        # while the map holds it.
        self._refs: List[int] = []

    def put(self, k: tuple, t: Any, value: Any) -> None:
        """`value` for tensor `t`, whose key is `k`."""
        try:
            ref = _stats.local(t).untyped_storage()._weak_ref()
        except (RuntimeError, NotImplementedError, AttributeError):
            ref = None
        else:
            self._refs.append(ref)
        old = self._entries.get(k)
        if old is not None and old[1] is not None and _expired(old[1]):
            self._gone.append(old[0])
        self._entries[k] = (value, ref)

    def get(self, k: tuple, default: Any = None) -> Any:
        e = self._entries.get(k)
        if e is None:
            return default
        if e[1] is not None and _expired(e[1]):
            del self._entries[k]
            self._gone.append(e[0])
            return default
        return e[0]

    def values(self) -> List[Any]:
        """Every value put, but one replaced while its tensor lived (ops of the step were
        recorded reading them, freed since or not)."""
        return self._gone + [e[0] for e in self._entries.values()]

    def __del__(self, _free: Any = torch.UntypedStorage._free_weak_ref) -> None:
        for ref in self._refs:
            _free(ref)
        self._refs = []


@dataclass(eq=False)
class StepState:
    kind: StepKind
    # The keys of the model's parameters' values.
    param_keys: Set[tuple] = field(default_factory=set)
    # Set (on the CPU, where a check is read at once) when an op of this step makes a
    # non-finite value that can be an origin: the ops from there on get full statistics.
    failing: bool = False
    # Set when the script unscales the gradients itself (`scaler.unscale_`): what it does
    # with them before the scaler's step (clipping) is the optimizer phase's.
    unscaled: bool = False
    # Optimizer updates made in this step, and which optimizers have stepped (without a
    # scaler the step ends when each has).
    updates: int = 0
    stepped: Set[int] = field(default_factory=set)
    # Backwards run in this step, and whether the script discarded their gradients without
    # an update (`Watcher._abandon`).
    backwards: int = 0
    abandoned: bool = False
    # The step's op count where its last update began, and whether that update was given a
    # closure (see `_intercept.outside_optimizer`).
    update_start: int = -1
    update_closure: bool = False
    # Why a step checked by modules is checked op by op from some point on: "update" where
    # it calls the model inside an update (an optimizer's closure: see
    # `Watcher._call_enter`), "grad" where the script differentiates by
    # `torch.autograd.grad` (`Watcher.on_autograd_grad`).
    light_cut: Optional[str] = None
    # Whether an optimizer's update is running (see `_intercept.updating`).
    in_update: bool = False
    # Whether the optimizer's own step ran inside the scaler's step being run (the scaler
    # skips it where it found an infinity: see `_intercept.updating`).
    inner_stepped: bool = False
    # Whether the step's calls are past its first update (see `Watcher._new_segment`), and
    # whether the scaler skipped an update whose calls were decided before an earlier one
    # (no replay can run them as they ran).
    later_segment: bool = False
    segment_note: bool = False
    # The op records (`_records.OpRecord`) and their statistics vectors.
    ops: List[Any] = field(default_factory=list)
    full_vecs: List[Any] = field(default_factory=list)
    check_vecs: List[Any] = field(default_factory=list)
    # Tensor key -> the op that made it; -> the check vector of an input no op made;
    # -> (derived, from parameters, maskish) of an integer output; while its values live.
    producer: LiveMap = field(default_factory=LiveMap)
    external: LiveMap = field(default_factory=LiveMap)
    integers: LiveMap = field(default_factory=LiveMap)
    # Ops whose output derives from the parameters or the batch; from the parameters; that
    # is, or reads, a mask.
    derived: Set[int] = field(default_factory=set)
    param_dep: Set[int] = field(default_factory=set)
    maskish: Set[int] = field(default_factory=set)
    op_count: int = 0
    # The ops whose output is memory not written yet (`_recorder.on_op`).
    unwritten: Set[int] = field(default_factory=set)
    # Each micro-batch's loss (a 0-d float64 tensor).
    losses: List[Any] = field(default_factory=list)
    # Each gradient clipping by norm of this step: (the total norm it returned, its
    # max_norm).
    clips: List[Any] = field(default_factory=list)
    # The model's outermost calls in this step, and their count at the last backward: a
    # backward with no call since the last one is another loss of its micro-batch.
    model_calls: int = 0
    calls_at_backward: Optional[int] = None
    scaling_nodes: List[Any] = field(default_factory=list)
    # Autograd node -> the module whose forward made it (backward ops are named by it).
    node_module: Dict[Any, str] = field(default_factory=dict)
    # A step checked by modules: the model's outermost calls, to replay (`_replay.Call`),
    # and the one running; the floating outputs of the calls running, to check; a flag per
    # batch of them saying whether one held a NaN or an infinity; the autograd nodes of the
    # script's own ops around the model (recorded in backward).
    calls: List[Any] = field(default_factory=list)
    call: Any = None
    call_outputs: Dict[int, Any] = field(default_factory=dict)
    out_flags: List[Any] = field(default_factory=list)
    loss_nodes: Set[Any] = field(default_factory=set)
    hooked_nodes: Set[Any] = field(default_factory=set)
    # Micro-batch -> the op count when its backward ended (its replayed backward ops go
    # there).
    backward_end: Dict[int, int] = field(default_factory=dict)
    decided: bool = False
    replayed: bool = False
    replaying: bool = False
    # Why the failing step could not be replayed, or None.
    replay_note: Optional[str] = None
    # Why a replay's backward could not run (its forward was recorded), or None.
    replay_backward_note: Optional[str] = None
    replayed_ops: int = 0
    replay_call: Any = None
    replay_micro: int = 0
    replay_seq: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def kept(self) -> bool:
        """Whether the step's records are kept (full statistics for every op)."""
        return self.kind is StepKind.FULL

    @property
    def light(self) -> bool:
        """Whether the step is checked by modules (until a cut or a replay)."""
        return self.kind is StepKind.MODULES

    def check_every_op(self) -> None:
        """From here on, every op of the step is checked."""
        self.kind = StepKind.OPS
