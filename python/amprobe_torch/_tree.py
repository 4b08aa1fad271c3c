"""The nested lists, tuples and dicts that carry a call's tensors: their leaves, and the
same structure with each tensor replaced."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple, Type, Union

import torch


def leaves(tree: Any, kind: Union[Type[Any], Tuple[Type[Any], ...]]) -> List[Any]:
    """The leaves of type `kind` in a tree of lists, tuples and dicts, in order."""
    out = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, kind):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def map_tensors(obj: Any, f: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with each tensor `t` in it replaced by `f(t)`, through plain lists and tuples
    and through dicts (rebuilt as plain ones); anything else, a named tuple or a container
    of the script's own class included, as it is."""
    if isinstance(obj, torch.Tensor):
        return f(obj)
    if type(obj) in (list, tuple):
        return type(obj)(map_tensors(x, f) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, f) for k, v in obj.items()}
    return obj
