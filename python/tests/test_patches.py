"""Patches that undo: after `close()` (or the end of a `watching` block) every hook is gone and
every function and method the companion replaced is the original again; a later watch
captures again."""

import json
import traceback

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

import amprobe_torch
from amprobe_torch import _patches

CLIP_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)


def process_state():
    """The identity of everything the companion may replace process-wide."""
    state = {
        "Tensor.backward": torch.Tensor.__dict__["backward"],
        "autograd.backward": torch.autograd.backward,
        "autograd.grad": torch.autograd.grad,
        "autocast.__enter__": torch.amp.autocast_mode.autocast.__dict__["__enter__"],
        "global pre hooks": dict(nn_module._global_forward_pre_hooks),
        "global hooks": dict(nn_module._global_forward_hooks),
        "dispatch mode": _get_current_dispatch_mode(),
    }
    for mod in CLIP_MODULES:
        for name in _patches._CLIP_FUNCTIONS:
            if hasattr(mod, name):
                state[f"{mod.__name__}.{name}"] = getattr(mod, name)
    return state


def objects_state(model, opt, scaler):
    """The identity of what the companion may replace on the script's own objects."""
    def methods(obj):
        # (its other attributes are the training's state, which training moves)
        return {k: v for k, v in vars(obj).items() if callable(v) and not isinstance(v, (dict, list, torch.Tensor))}

    return {
        "opt": methods(opt),
        "scaler": methods(scaler),
        "hooks": [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()],
    }


def same_objects(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert a[k].keys() == b[k].keys(), k
            for j in a[k]:
                assert a[k][j] is b[k][j], (k, j)
        else:
            assert a[k] is b[k] or a[k] == b[k], k


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return model, opt, scaler


def train(model, opt, scaler, steps=2, clip=True):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def steps_in(path):
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["type"] == "step"]


def test_close_puts_back_every_function_and_hook(tmp_path, monkeypatch):
    # With a plan too: it replaces autocast's `__enter__` and hooks the model.
    monkeypatch.setenv("AMPROBE_AUTOCAST", "bf16")
    model, opt, scaler = setup()
    before, objects = process_state(), objects_state(model, opt, scaler)
    w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    during = process_state()
    changed = [k for k in before if during[k] is not before[k] and during[k] != before[k]]
    # (what the test checks is what the watcher really replaces)
    assert {"Tensor.backward", "autograd.backward", "autograd.grad", "autocast.__enter__",
            "dispatch mode", "global hooks", "torch.nn.utils.clip_grad_norm_"} <= set(changed)
    train(model, opt, scaler)
    w.close()
    same_objects(process_state(), before)
    same_objects(objects_state(model, opt, scaler), objects)


def test_a_second_watch_after_a_close_captures_again(tmp_path):
    model, opt, scaler = setup()
    amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "a.jsonl")).close()
    w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "b.jsonl"))
    train(model, opt, scaler, steps=2)
    w.close()
    got = steps_in(tmp_path / "b.jsonl")
    assert [s["step"] for s in got] == [0, 1] and got[0]["ops"]


def test_watching_closes_where_its_block_ends_however_it_ends(tmp_path):
    model, opt, scaler = setup()
    before = process_state()
    try:
        with amprobe_torch.watching(model, opt, scaler, trace=str(tmp_path / "t.jsonl")) as w:
            assert w is not None and not w.closed
            train(model, opt, scaler, steps=1)
            raise KeyError("the script's own error")
    except KeyError:
        pass
    assert w.closed
    same_objects(process_state(), before)
    assert len(steps_in(tmp_path / "t.jsonl")) == 1


def test_a_scripts_error_after_close_does_not_pass_through_the_companion(tmp_path):
    model, opt, scaler = setup()
    with amprobe_torch.watching(model, opt, scaler, trace=str(tmp_path / "t.jsonl")):
        train(model, opt, scaler, steps=1)
    try:
        torch.ones(2, 3) @ torch.ones(2, 3)
    except RuntimeError as e:
        files = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    assert not any("amprobe_torch" in f for f in files), files


def test_a_method_wrapped_again_after_watch_is_left_to_its_wrapper_and_passes_through(tmp_path):
    # An LR scheduler made after `watch` wraps the watched `step`: closing leaves the
    # scheduler's wrapper, and the step under it runs as the optimizer's own.
    model, opt, scaler = setup()
    w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w.close()
    train(model, opt, scaler, steps=1)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_watching_what_an_open_watcher_watches_leaves_it_open(tmp_path):
    model, opt, scaler = setup()
    w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    with amprobe_torch.watching(model, opt, scaler, trace=str(tmp_path / "t.jsonl")) as inner:
        assert inner is w
    assert not w.closed
    w.close()
