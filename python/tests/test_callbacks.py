"""amprobe's callbacks for trainings a library runs (`amprobe_torch.TrainerCallback`,
`amprobe_torch.LightningCallback`): each stack script (python/tests/stacks/*_callback.py,
written as its library's documentation teaches, the callback its one added line) is run by
plain python with and without the callback, and held to the same losses and parameters
bitwise, a trace with the right header, one step record per optimizer step and an end
record, and no watcher left open after the training. What the callbacks take from what the
trainer hands them, their errors, and the lazy import are checked in process."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import amprobe_torch
from amprobe_torch import callbacks

HERE = os.path.dirname(os.path.abspath(__file__))
STACKS = os.path.join(HERE, "stacks")
PYTHON_DIR = os.path.dirname(HERE)


def run_script(tmp_path, name, script, *args):
    """`python SCRIPT OUT ARGS` with this checkout's companion on PYTHONPATH and the trace
    in tmp_path: (its result.json, its stderr, the trace's path)."""
    out, trace = tmp_path / name, tmp_path / f"{name}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPROBE_")}
    env["PYTHONPATH"] = PYTHON_DIR
    env["AMPROBE_TRACE"] = str(trace)
    r = subprocess.run([sys.executable, os.path.join(STACKS, script), str(out), *args],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "result.json").read_text()), r.stderr, trace


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def with_and_without(tmp_path, script, *args):
    """The script run without and with the callback: (the run with it's result.json and
    trace records), after holding both runs to the same figures bitwise."""
    ref, _, unwatched = run_script(tmp_path, "plain", script, *args)
    assert not unwatched.exists()
    got, stderr, trace = run_script(tmp_path, "watched", script, *args, "--amprobe")
    assert "amprobe_torch:" not in stderr, stderr
    assert got.pop("open_watchers") == 0
    assert ref.pop("open_watchers") is None
    assert json.dumps(ref, sort_keys=True) == json.dumps(got, sort_keys=True), (ref, got)
    return got, records(trace)


def steps(recs):
    return [r for r in recs if r["type"] == "step"]


def test_hf_trainer_callback_watches_the_training_and_changes_nothing(tmp_path):
    pytest.importorskip("transformers")
    got, trace = with_and_without(tmp_path, "trainer_gpt2_callback.py")
    h = trace[0]
    assert h["type"] == "header"
    assert (h["model"], h["precision"], h["scaler"]) == ("GPT2LMHeadModel", "bf16", None), h
    assert h["optimizer"]["kind"] == "AdamW", h["optimizer"]
    ss = steps(trace)
    assert len(ss) == len(got["logged"]) == 3
    for s, logged in zip(ss, got["logged"]):
        assert s["micro_batches"] == 2
        assert s["loss"] == pytest.approx(logged["loss"], rel=1e-6)
        assert s["grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-6)
    assert trace[-1]["type"] == "end" and trace[-1]["steps"] == 3 and trace[-1]["verdict"] == "clean"


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", "bf16"), ("16-plugin", "fp16")])
def test_lightning_callback_watches_the_training_and_changes_nothing(tmp_path, precision, dtype):
    pytest.importorskip("lightning")
    got, trace = with_and_without(tmp_path, "lightning_autoencoder_callback.py", precision)
    h = trace[0]
    assert h["type"] == "header"
    assert (h["model"], h["precision"]) == ("LitAutoEncoder", dtype), h
    assert h["optimizer"]["kind"] == "Adam"
    if dtype == "fp16":
        assert h["scaler"] is not None and h["scaler"]["init_scale"] == 65536.0, h["scaler"]
    else:
        assert h["scaler"] is None
    ss = steps(trace)
    assert len(ss) == len(got["losses"]) == 4
    for s, loss in zip(ss, got["losses"]):
        assert s["loss"] == pytest.approx(loss, rel=1e-6)
    assert trace[-1]["type"] == "end" and trace[-1]["steps"] == 4


def test_importing_the_companion_imports_no_training_library(tmp_path):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    code = ("import amprobe_torch, sys; "
            "print('transformers' in sys.modules, 'lightning' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "False"], r.stdout
    # (named on the package, not in __all__: a star import must not import the libraries)
    assert not {"TrainerCallback", "LightningCallback"} & set(amprobe_torch.__all__)
    assert amprobe_torch.TrainerCallback.__name__ == "TrainerCallback"
    with pytest.raises(AttributeError):
        amprobe_torch.NoSuchThing


# ---- in process: what the callbacks take, and their errors


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper as Accelerate's `AcceleratedOptimizer` is made: a
    `torch.optim.Optimizer` subclass (never initialized as one) whose `.optimizer` is the
    one that updates and whose `.scaler` is the GradScaler or None."""

    def __init__(self, inner, scaler=None):
        self.optimizer, self.scaler = inner, scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)


class Outer:
    """A wrapper that is no `torch.optim.Optimizer` (as Lightning's `LightningOptimizer`)."""

    def __init__(self, inner):
        self.optimizer = inner
        self.param_groups = inner.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)


class FakeWatcher:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


@pytest.fixture
def fake_watch(monkeypatch):
    """`amprobe_torch.watch` replaced by one that notes what it was given."""
    calls = []

    def watch(model, optimizer, scaler=None, **options):
        w = FakeWatcher()
        calls.append((model, optimizer, scaler, options, w))
        return w

    monkeypatch.setattr(amprobe_torch, "watch", watch)
    return calls


def test_inner_optimizer_is_found_through_nested_wrappers():
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert callbacks.inner_optimizer(sgd) == (sgd, None)
    assert callbacks.inner_optimizer(Wrapper(Wrapper(sgd), scaler)) == (sgd, scaler)
    assert callbacks.inner_optimizer(Wrapper(Wrapper(sgd, scaler))) == (sgd, scaler)
    assert callbacks.inner_optimizer(Outer(Wrapper(sgd, scaler))) == (sgd, scaler)


def test_trainer_callback_watches_what_the_trainer_hands_it(fake_watch):
    transformers = pytest.importorskip("transformers")
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    cb = amprobe_torch.TrainerCallback(trace="x.jsonl", sample_every=3, check="ops")
    assert isinstance(cb, transformers.TrainerCallback)
    cb.on_train_begin(None, None, None, model=model, optimizer=Wrapper(sgd, scaler))
    (m, opt, sc, options, w), = fake_watch
    assert (m, opt, sc) == (model, sgd, scaler)
    assert options == {"trace": "x.jsonl", "sample_every": 3, "check": "ops"}
    cb.on_train_end(None, None, None, model=model)
    cb.on_train_end(None, None, None, model=model)
    assert w.closed == 1


def test_lightning_callback_watches_the_modules_optimizers_and_plugin_scaler(fake_watch):
    pl = pytest.importorskip("lightning.pytorch")
    model = torch.nn.Linear(2, 2)
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    cb = amprobe_torch.LightningCallback()
    assert isinstance(cb, pl.Callback)
    one = types.SimpleNamespace(optimizers=[a], precision_plugin=types.SimpleNamespace(scaler=scaler))
    cb.on_train_start(one, model)
    cb.on_train_end(one, model)
    two = types.SimpleNamespace(optimizers=[a, b],
                                strategy=types.SimpleNamespace(precision_plugin=types.SimpleNamespace()))
    cb.on_train_start(two, model)
    cb.on_exception(two, model, RuntimeError("stopped"))
    (m1, o1, s1, _, w1), (m2, o2, s2, _, w2) = fake_watch
    assert (m1, o1, s1) == (model, a, scaler)
    assert (m2, o2, s2) == (model, [a, b], None)
    assert w1.closed == w2.closed == 1


def test_an_error_in_a_callback_is_told_once_and_the_training_goes_on(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    cb = amprobe_torch.TrainerCallback()
    cb.on_train_begin(None, None, None, model=torch.nn.Linear(2, 2), optimizer=None)
    cb.on_train_begin(None, None, None, model="not a model", optimizer=object())
    cb.on_train_end(None, None, None)
    err = capsys.readouterr().err
    assert err.count("amprobe_torch:") == 1, err
    assert "TrainerCallback could not start watching (the training goes on unwatched)" in err, err
    assert "no optimizer" in err, err

    lit = amprobe_torch.LightningCallback()
    lit.on_train_start(types.SimpleNamespace(optimizers=[], precision_plugin=None), torch.nn.Linear(2, 2))
    lit.on_train_end(None, None)
    err = capsys.readouterr().err
    assert err.count("amprobe_torch: LightningCallback could not start watching") == 1, err


def test_a_watch_refusal_in_the_callback_leaves_the_scripts_watcher_alone(tmp_path, capsys):
    pytest.importorskip("transformers")
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    own = amprobe_torch.watch(model, sgd, trace=str(tmp_path / "own.jsonl"))
    try:
        again = amprobe_torch.TrainerCallback(trace=str(tmp_path / "cb.jsonl"))
        again.on_train_begin(None, None, None, model=model, optimizer=sgd)
        again.on_train_end(None, None, None)
        assert not own.closed
        refused = amprobe_torch.TrainerCallback(trace=str(tmp_path / "cb.jsonl"))
        refused.on_train_begin(None, None, None, model=model, optimizer=other)
        assert "already watched" in capsys.readouterr().err
        refused.on_train_end(None, None, None)
        assert not own.closed
    finally:
        own.close()


def test_bad_options_are_refused_where_the_callback_is_made():
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    with pytest.raises(ValueError, match="check"):
        amprobe_torch.TrainerCallback(check="everything")
    with pytest.raises(ValueError, match="sample_every"):
        amprobe_torch.LightningCallback(sample_every=-1)
