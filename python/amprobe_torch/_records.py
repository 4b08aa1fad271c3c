"""The capture's per-op records, typed. NamedTuples of plain values: a step recorded in full
keeps thousands of them until it ends, and the garbage collector stops tracking a tuple
that holds no container it must follow."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch


class VecRef(NamedTuple):
    """Where an op's statistics are: in the step's full vectors or its check vectors."""

    kind: str  # "full" or "check"
    index: int


class OpInfo(NamedTuple):
    """What an ATen op is, as the recorder needs it (see `describe`)."""

    name: str
    # Whether it writes an argument.
    mutable: bool
    # "collective" (moves values between ranks), "pending" (its output is not written yet:
    # an allocation, a functional collective before its wait), "alias" (a view), or None.
    kind: Optional[str]
    # (position, name) of the argument it writes when it returns nothing (the in-place
    # multi-tensor ops: the optimizers' foreach updates, the scaler's unscale), or None.
    written: Optional[Tuple[int, str]]
    # Whether its outputs are one list of tensors.
    many: bool


class Seen(NamedTuple):
    """What the recorder saw of an op's inputs before it ran (`_recorder.read_inputs`)."""

    phase: str
    node: Any
    ins: list
    # Indices of the ops of this step that made its inputs.
    preds: list
    # Indices of the check vectors of the inputs no op of this step made.
    ext: list
    # (data pointer, tensor, producing op) of each input an op of this step made.
    moved: list
    # Whether an input derives from the parameters or the batch.
    derived: bool
    # Whether an input is only a constant the model made.
    const_in: bool
    maskish_in: bool
    param_in: bool
    # Whether a scalar argument masks (-inf or a dtype's most negative value).
    mask_scalar: bool
    # Whether every input is known finite on the host now.
    finite_in: bool
    # The op's place in its step: an int, or a replayed op's key (see `order_key`).
    index: Any


class OpRecord(NamedTuple):
    """One recorded op of a step."""

    phase: str
    op: str
    module: str
    # (dtype, shape) of each tensor input.
    inputs: tuple
    # (dtype, shape) of the output (a list's tensors as one: their element count).
    output: tuple
    vec: VecRef
    preds: tuple
    ext: tuple
    # Whether an Inf or NaN in its output can have been made here.
    eligible: bool
    # Whether -inf in its output is a mask's, not an overflow.
    masked: bool
    index: Any
    micro: int


def describe(func: Any, names_allocating: frozenset) -> OpInfo:
    """The `OpInfo` of an ATen op (`names_allocating`: the ops whose output is memory not
    yet written)."""
    name = func.overloadpacket.__name__
    kind = None
    if func.namespace == "c10d" or (func.namespace == "_c10d_functional" and name == "wait_tensor"):
        kind = "collective"
    elif func.namespace == "_c10d_functional" or name in names_allocating:
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
    return OpInfo(name, schema.is_mutable, kind, written, many)


def order_key(index: Any) -> tuple:
    """An op's place in its step: a live op's index, or a replayed op's key (see
    `Watcher._replay_key`), which goes before the live op of the same index."""
    return index if isinstance(index, tuple) else (index, 1, 0)


def in_order(ops: list) -> list:
    """A step's ops with the replayed ones (appended after the step's own) where their
    indices put them, each renumbered and its predecessors renumbered with it."""
    order = sorted(range(len(ops)), key=lambda i: order_key(ops[i].index))
    pos = [0] * len(order)
    for new, old in enumerate(order):
        pos[old] = new
    return [ops[old]._replace(preds=tuple(pos[p] for p in ops[old].preds), index=new) for new, old in enumerate(order)]
