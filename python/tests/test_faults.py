"""An error inside the companion never breaks the training: an exception raised in each of
its entry points in turn (the dispatch mode's two halves, every hook, every wrapped call of
the optimizer and scaler, the backward interception, the step's read back and record, the
trace writer, a full disk) leaves the training bitwise as without amprobe, is reported once
on stderr, and leaves the trace written so far readable (whole lines of JSON)."""

import errno
import json
import os

import pytest
import torch

from amprobe_torch import _capture, _dispatch, _intercept, _trace
from scripts import train
from test_watch import assert_same_training, close_all, watcher

W = _capture.Watcher

# (where, attribute): each raises when called. A step checked by modules that fails (step 2
# overflows fp16) reaches the replay's paths too.
POINTS = [
    (_dispatch, "read_inputs"),
    (_dispatch, "on_op"),
    (W, "_call_enter"),
    (W, "_call_leave"),
    (W, "on_backward"),
    (W, "before_backward"),
    (W, "after_backward"),
    (W, "_node_enter"),
    (W, "_enter_optimizer"),
    (W, "_name_loss"),
    (W, "_decide"),
    (W, "_replay"),
    (W, "_read_step"),
    (W, "_finish"),
    (W, "_begin_step"),
    (_intercept, "found_inf"),
    (_capture, "keep_grad"),
    (_capture, "header"),
    (_trace.TraceWriter, "write"),
]


def _raising(name):
    def f(*a, **k):
        raise RuntimeError(f"injected into {name}")

    return f


def _readable(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text == "" or text.endswith("\n"), "the trace ends inside a line"
    return [json.loads(line) for line in text.splitlines()]


def _reports(err):
    return err.count("amprobe_torch: capture stopped") + err.count("amprobe_torch: watch could not start")


@pytest.mark.parametrize("where,name", POINTS, ids=[f"{getattr(w, '__name__', w)}.{n}" for w, n in POINTS])
def test_an_error_in_an_entry_point_never_breaks_the_training(tmp_path, monkeypatch, capsys, where, name):
    path = tmp_path / "t.jsonl"
    plain = train(torch.float16, steps=5, boom_step=2)
    monkeypatch.setattr(where, name, _raising(name))
    try:
        seen = train(torch.float16, steps=5, boom_step=2, watch=watcher(path, sample_every=0))
        # (the clipping wrapper is on the process-wide interception: called here)
    finally:
        close_all()
    assert_same_training(plain, seen)
    err = capsys.readouterr().err
    assert _reports(err) == 1, err
    assert f"injected into {name}" in err
    _readable(path)


class _FullDisk:
    """A trace file whose `writes`-th write writes half its bytes, then fails as a full
    disk does."""

    def __init__(self, f, writes):
        self.f = f
        self.left = writes

    def write(self, data):
        self.left -= 1
        if self.left == 0:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("writes", [1, 3])
def test_a_full_disk_keeps_the_whole_lines_written_and_the_training(tmp_path, monkeypatch, capsys, writes):
    path = tmp_path / "t.jsonl"
    plain = train(torch.float16, steps=5, boom_step=2)
    real_open = open
    monkeypatch.setattr(_trace, "open", lambda *a, **k: _FullDisk(real_open(*a, **k), writes), raising=False)
    try:
        seen = train(torch.float16, steps=5, boom_step=2, watch=watcher(path))
    finally:
        close_all()
    assert_same_training(plain, seen)
    err = capsys.readouterr().err
    assert _reports(err) == 1 and "No space left on device" in err, err
    records = _readable(path)
    # Every record before the failing write is there, whole; none after it.
    assert len(records) == writes - 1
    if records:
        assert records[0]["type"] == "header" and all(r["type"] == "step" for r in records[1:])


def test_after_an_internal_error_the_mode_is_off_the_stack(tmp_path, monkeypatch, capsys):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    monkeypatch.setattr(_dispatch, "on_op", _raising("on_op"))
    try:
        train(torch.float16, steps=2, watch=watcher(tmp_path / "t.jsonl"))
        assert _get_current_dispatch_mode() is None
    finally:
        close_all()
    assert _get_current_dispatch_mode() is None
    capsys.readouterr()
