"""The op recorder: what each ATen op of a step read (made by which earlier op, derived from
the parameters or the batch or only from constants, a mask, known finite) and its record
(`_records.OpRecord`) with the statistics of its output, kept in the watcher's `StepState`."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from . import _stats
from ._carried import key as _key
from ._records import OpInfo, OpRecord, Seen, VecRef
from ._tree import leaves

# An op with this many tensor inputs or more (a multi-tensor op) has its unchecked inputs
# on a device checked together.
BATCHED_INPUTS = 8

# Ops whose output is a value the script wrote (a fill), not one arithmetic made: an Inf
# there is a sentinel (DeepSpeed's optimizer fills an infinite norm before it knows one),
# never where a value first overflowed.
FILLS = frozenset("full full_like new_full fill fill_ scalar_tensor".split())


def _mask_like(x: float) -> bool:
    """A scalar that masks: -inf or a dtype's most negative value."""
    return x == float("-inf") or x <= -65504.0


def tensor_inputs(args: tuple, kwargs: dict) -> Tuple[List[torch.Tensor], bool, bool]:
    """(the observed tensors among an op's arguments, whether a float argument masks,
    whether every float argument is finite)."""
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
    return ins, mask_scalar, scalars_finite


def _clean(v: Any) -> bool:
    """Whether a check, read on the host already, counts no NaN and no infinity."""
    return type(v) is list and v[1] + v[2] + v[3] == 0


class _Inputs:
    """What an op's inputs are, gathered input by input (see `read_inputs`)."""

    __slots__ = ("preds", "ext", "moved", "derived", "const_in", "maskish_in", "param_in", "known_finite",
                 "unchecked")

    def __init__(self, known_finite: bool) -> None:
        self.preds: List[int] = []
        self.ext: List[int] = []
        self.moved: list = []
        self.derived = self.const_in = self.maskish_in = self.param_in = False
        # Whether every floating input is known finite on the host now (the CPU's checks
        # are host lists; a kept step's full vectors and a device's are not read yet).
        self.known_finite = known_finite
        self.unchecked: list = []

    def from_op(self, w: Any, t: torch.Tensor, k: tuple, p: int, phase: str) -> None:
        """Input `t` (key `k`) was made by op `p` of this step."""
        st = w.st
        self.preds.append(p)
        self.moved.append((k[0], t, p))
        if self.known_finite:
            kind, i = st.ops[p].vec
            self.known_finite = kind == "check" and _clean(st.check_vecs[i])
        if p in st.derived:
            self.derived = True
        else:
            self.const_in = True
        self.maskish_in = self.maskish_in or p in st.maskish
        self.param_in = self.param_in or p in st.param_dep
        if phase == "forward":
            gf = t.grad_fn
            if gf is not None:
                if gf not in st.node_module:
                    st.node_module[gf] = st.ops[p].module
                if st.light:
                    # Made by the script's own op around the model (the model's ops are
                    # not seen in this step): its gradient is recorded.
                    st.loss_nodes.add(gf)

    def from_integers(self, made: tuple) -> None:
        """An input made from integers an op of this step output: (derived, from the
        parameters, maskish) as they were."""
        if made[0]:
            self.derived = True
        else:
            self.const_in = True
        self.param_in = self.param_in or made[1]
        self.maskish_in = self.maskish_in or made[2]

    def from_outside(self, w: Any, t: torch.Tensor, k: tuple, count: int) -> None:
        """An input no op of this step made (the batch, a parameter): checked as it is read,
        once a step, or with the op's other device inputs where there are many."""
        st = w.st
        self.derived = True
        self.param_in = self.param_in or k in st.param_keys
        if k[1] not in _stats.FLOATING:
            return
        e = st.external.get(k)
        if e is None and count >= BATCHED_INPUTS and not _stats.on_host(t):
            self.unchecked.append((k, t))
            return
        if e is None:
            st.check_vecs.append(w.carried.known_check(k, t))
            e = len(st.check_vecs) - 1
            st.external.put(k, t, e)
        self.ext.append(e)
        if self.known_finite:
            self.known_finite = _clean(st.check_vecs[e])

    def check_together(self, w: Any) -> None:
        """A multi-tensor op's inputs on a device (the optimizer's: every gradient and
        parameter): checked together, a few kernels instead of six a tensor
        (`_stats.batch_check`: whether a NaN is there, whether an Inf may be, which is what
        a check of an input is read for)."""
        st = w.st
        by_device: dict = {}
        for k, t in self.unchecked:
            by_device.setdefault(t.device, []).append((k, t))
        for group in by_device.values():
            st.check_vecs.append(_stats.batch_check([t for _, t in group]))
            for k, t in group:
                st.external.put(k, t, len(st.check_vecs) - 1)
            self.ext.append(len(st.check_vecs) - 1)
        self.known_finite = False


def _phase(w: Any) -> Tuple[str, Any]:
    """(the phase an op runs in, the autograd node running it in a backward)."""
    if w.optimizer_depth or w.st.unscaled:
        return "optimizer", None
    if torch._C._current_graph_task_id() != -1:
        return "backward", torch._C._current_autograd_node()
    return "forward", None


def read_inputs(w: Any, func: Any, args: tuple, kwargs: dict) -> Optional[Seen]:
    """Before an op runs: its phase and what its inputs are, with the inputs no op of this
    step made checked now, as the op reads them (an op may write them: a batch norm's
    running statistics). None for an op not recorded (the loss scaling's gradient)."""
    st = w.st
    phase, node = _phase(w)
    if st.replaying:
        index = w._replay_key(phase)
    else:
        index = st.op_count
        st.op_count += 1
    if node is not None and st.scaling_nodes and any(node is n for n in st.scaling_nodes):
        return None
    ins, mask_scalar, scalars_finite = tensor_inputs(args, kwargs)
    # What the output will derive from: the parameters or the batch (then its Inf or NaN
    # can be an origin), or only constants the model made (T5's log(0) = -inf in its
    # position buckets is not); and whether it is, or reads, a mask.
    seen = _Inputs(not (st.kept or st.replaying))
    for t in ins:
        k = _key(t)
        p = st.producer.get(k)
        if p is not None:
            seen.from_op(w, t, k, p, phase)
            continue
        made = st.integers.get(k)
        if made is not None:
            seen.from_integers(made)
        else:
            seen.from_outside(w, t, k, len(ins))
    if seen.unchecked:
        seen.check_together(w)
    return Seen(phase, node, ins, seen.preds, seen.ext, seen.moved, seen.derived, seen.const_in, seen.maskish_in,
                seen.param_in, mask_scalar, scalars_finite and seen.known_finite, index)


def _outputs(info: OpInfo, out: Any, args: tuple, kwargs: Optional[dict]) -> Tuple[Any, list]:
    """(the op's result, its tensors): for an op that wrote its results into an argument and
    returned nothing, that argument."""
    if info.written is not None:
        i, arg = info.written
        out = args[i] if i < len(args) else (kwargs or {}).get(arg)
    return out, [out] if isinstance(out, torch.Tensor) else leaves(out, torch.Tensor)


def _module_of(w: Any, phase: str, node: Any) -> str:
    """The module an op is named by: in the forward, the module whose forward runs; in the
    backward, the module whose forward made its node."""
    if phase != "backward" or node is None:
        return w.names.current()
    module = w.st.node_module.get(node)
    if module is None:
        module = w.names.of_node(node)
        if module is None:
            module = w.spans.module_of(node)
        if module is None:
            module = w.names.current()
    return module


def _shared_vec(st: Any, name: str, moved: list, o: torch.Tensor) -> Optional[VecRef]:
    """The statistics an output shares with an input whose values it only moves (a view, a
    transpose, a detach: same storage start, element count and dtype) or copies (a clone, a
    contiguous copy, a cast to a dtype that holds them exactly and calls the same ones
    subnormal: bf16 to f32), or None."""
    optr = o.data_ptr()
    copies = len(moved) == 1 and name in _stats.VALUE_COPIES
    for ptr, t, p in moved:
        if t.numel() == o.numel() and (
            (t.dtype == o.dtype and (ptr == optr or copies))
            or (copies and (t.dtype, o.dtype) == (torch.bfloat16, torch.float32))
        ):
            return st.ops[p].vec
    return None


def _wait(out: Any) -> None:
    """Waits for a collective's transfer: its output holds what other ranks sent once it is
    done (and its Inf or NaN is received, never made here)."""
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif not isinstance(x, torch.Tensor) and hasattr(x, "wait"):
            x.wait()


def _clean_vec(st: Any, o: torch.Tensor) -> VecRef:
    """A check that counts `o` as finite without reading it."""
    st.check_vecs.append([float(o.numel()), 0.0, 0.0, 0.0])
    return VecRef("check", len(st.check_vecs) - 1)


def _output_vec(w: Any, info: OpInfo, seen: Seen, floats: list, many: bool, can_make: bool) -> VecRef:
    """The statistics of the op's output, computed, shared or known."""
    st = w.st
    o = floats[0]
    if info.kind == "pending":
        # Uninitialised memory or values still in flight: nothing to read, no origin.
        return _clean_vec(st, o)
    if not info.mutable and seen.moved and not many:
        same = _shared_vec(st, info.name, seen.moved, o)
        if same is not None:
            return same
    if (
        seen.finite_in
        and info.name in _stats.FINITE_PRESERVING
        and all(_stats.RANGE[t.dtype] <= _stats.RANGE[o.dtype] for t in seen.ins if t.dtype in _stats.RANGE)
    ):
        # Finite inputs through an op that cannot make a non-finite value.
        return _clean_vec(st, o)
    vec = w._vector(floats if many else o)
    if vec.kind == "check" and not st.failing and can_make:
        v = st.check_vecs[vec.index]
        masked = seen.phase == "forward" and (seen.mask_scalar or seen.maskish_in or seen.const_in)
        if type(v) is list and v[1] + v[2] + (0 if masked else v[3]) > 0:
            # The step's first Inf or NaN that can be an origin: this op and the rest of
            # the step are recorded in full.
            st.failing = True
            vec = w._vector(floats if many else o)
    return vec


def _carry_written(w: Any, floats: list, vec: VecRef, many: bool) -> None:
    """What an op that writes in place wrote is its output's check from now on, or unknown
    (a write into part of an owned tensor's storage: a slice of a parameter's `.data`)."""
    carried, o = w.carried, floats[0]
    if carried.storage:
        carried.forget_written(floats)
    if (
        carried.enabled
        and vec.kind == "check"
        and not many
        and _stats.on_host(o)
        and not o.is_inference()
        and type(w.st.check_vecs[vec.index]) is list
    ):
        carried.remember(_key(o), o, w.st.check_vecs[vec.index], written=True)


def on_op(w: Any, func: Any, seen: Seen, out: Any, args: tuple = (), kwargs: Optional[dict] = None) -> None:
    """After an op ran: its record (the statistics of its first floating output, or of all
    its tensors together when they are one list) from what `read_inputs` saw."""
    st = w.st
    info = w._info(func)
    derived = seen.derived or info.name in _stats.RANDOM
    # Whether an Inf or NaN in the output can have been made here. A view of floating values
    # makes none: a non-finite value its input's record did not show was in that memory
    # before (FSDP2 reallocates a freed parameter at the address it had and views it before
    # the all-gather fills it). A view that reinterprets integers as floats can.
    can_make = (
        (info.kind is None or (info.kind == "alias" and not all(_stats.floating(t) for t in seen.ins)))
        and (seen.phase != "forward" or derived)
        and info.name not in FILLS
    )
    out, outs = _outputs(info, out, args, kwargs)
    floats = [t for t in outs if _stats.floating(t)]
    if not floats:
        # Integer outputs have no record, but a float made from them later must know
        # where they come from.
        for t in outs:
            if _stats.observed(t):
                st.integers.put(_key(t), t, (derived, seen.param_in, seen.maskish_in))
        return
    many = info.many and len(floats) > 1
    module = _module_of(w, seen.phase, seen.node)
    if info.kind == "collective":
        _wait(out)
    # Memory not written yet: an allocation's, or a view of it (FSDP2 views its
    # collectives' fresh buffers before it fills them), or, in a backward, a view of memory
    # no op of the step made that is no parameter (FSDP2's gradient buffers, made where no
    # mode sees them, viewed as the destinations of the copy that fills them; a backward's
    # own values are made by its step; a sharded model's only); nothing to read, no origin.
    unwritten = info.kind == "pending" or (
        info.kind == "alias"
        and (
            any(p in st.unwritten for p in seen.preds)
            or (seen.phase == "backward" and not w.carried.enabled and not seen.preds and not seen.param_in)
        )
    )
    vec = _clean_vec(st, floats[0]) if unwritten else _output_vec(w, info, seen, floats, many, can_make)
    if info.mutable:
        _carry_written(w, floats, vec, many)
    _append(st, info.name, seen, module, floats, many, vec, can_make and not unwritten, derived)
    if unwritten:
        st.unwritten.add(len(st.ops) - 1)


def _append(st: Any, name: str, seen: Seen, module: str, floats: list, many: bool, vec: VecRef, can_make: bool,
            derived: bool) -> None:
    """The op's record, and what later ops must know of its outputs."""
    o = floats[0]
    idx = len(st.ops)
    st.ops.append(
        OpRecord(
            phase=seen.phase,
            op=name,
            module=module,
            inputs=tuple([(t.dtype, tuple(t.shape)) for t in seen.ins]),
            output=(o.dtype, (sum(t.numel() for t in floats),) if many else tuple(o.shape)),
            vec=vec,
            preds=tuple(seen.preds),
            ext=tuple(seen.ext),
            eligible=can_make,
            # -inf written by a mask (a scalar like finfo.min or -inf, a mask built from one,
            # or a constant the model made) is not an overflow.
            masked=seen.phase == "forward" and (seen.mask_scalar or seen.maskish_in or seen.const_in),
            index=seen.index,
            # The micro-batch: backwards of the step before this op (a backward op belongs to
            # the backward running, a forward op to the next one).
            micro=st.replay_micro if st.replaying else max(0, len(st.losses) - (seen.phase != "forward")),
        )
    )
    for t in floats:
        st.producer.put(_key(t), t, idx)
    if derived:
        st.derived.add(idx)
    if seen.param_in:
        st.param_dep.add(idx)
    if (seen.mask_scalar or seen.maskish_in) and not seen.param_in:
        st.maskish.add(idx)
