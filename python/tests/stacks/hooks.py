"""The independent judge of where a forward first went non-finite: plain forward hooks on
every module, in the order their forwards end, naming the first whose output holds an Inf
or NaN while none of its inputs did (what a person would write to find it)."""

import torch


def first_nonfinite(model):
    """Hooks `model`'s modules; returns a dict whose "first" is filled with
    (step, module name) once a forward output first holds an Inf or NaN none of its
    inputs held. `seen["step"]` is to be advanced by the script at each step."""
    seen = {"first": None, "step": 0}

    def bad(x):
        ts = [x] if isinstance(x, torch.Tensor) else [t for t in (x if isinstance(x, (tuple, list)) else []) if isinstance(t, torch.Tensor)]
        return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in ts)

    def hook(name):
        def f(module, args, out):
            if seen["first"] is None and bad(out) and not any(bad(a) for a in args):
                seen["first"] = (seen["step"], name)

        return f

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(hook(name))
    return seen
