"""The companion held to amprobe's own engine: each Hugging Face sample trained by a
PyTorch script (train_hf.py: the same checkpoint, batch and objective, CPU fp16 autocast,
a GradScaler) and captured, against the native run of the same sample under PyTorch's CPU
autocast table. Per step: the first Inf and the first NaN (phase, module and op kind), the
skip decision and the loss scale before and after must be equal."""

import json
import os
import subprocess
import sys

import pytest

from test_watch import amprobe_bin

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))

# The native engine names an op by the torch function the model calls, the capture by the
# ATen op the dispatcher runs; an op kind is what both name alike.
KIND = {
    "linear": "matmul",
    "matmul": "matmul",
    "mm": "matmul",
    "addmm": "matmul",
    "bmm": "matmul",
    "baddbmm": "matmul",
    "softmax": "softmax",
    "_softmax": "softmax",
    "_safe_softmax": "softmax",
    "layer_norm": "layer_norm",
    "native_layer_norm": "layer_norm",
    "to": "cast",
    "_to_copy": "cast",
}

SAMPLES = [
    ("t5_overflow.toml", "t5_overflow_small"),
    ("gpt2_overflow.toml", "gpt2_overflow_tiny"),
    ("llama_overflow.toml", "llama_overflow_tiny"),
    ("bert_overflow.toml", "bert_overflow_tiny"),
    ("t5_seq2seq.toml", "t5_seq2seq_tiny"),
]


def steps(path):
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if r["type"] == "step"]


def origin(o):
    if o is None:
        return None
    return (o["step"], o["phase"], o["module"], KIND.get(o["op"], o["op"]))


def decisions(path):
    return [
        (
            s["step"],
            origin(s["origins"]["first_inf"]),
            origin(s["origins"]["first_nan"]),
            s["found_inf"],
            s["skipped"],
            s["scale_before"],
            s["scale_after"],
        )
        for s in steps(path)
    ]


@pytest.mark.parametrize("config,sample", SAMPLES)
def test_a_captured_script_diagnoses_as_the_native_run(tmp_path, config, sample):
    native, captured = tmp_path / "native.jsonl", tmp_path / "captured.jsonl"
    r = subprocess.run(
        [amprobe_bin(), "run", os.path.join(ROOT, "samples", config), "--policy", "cpu", "--trace", str(native)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    script = [sys.executable, os.path.join(HERE, "train_hf.py"), os.path.join(ROOT, "samples", sample)]
    r = subprocess.run(
        [amprobe_bin(), "run", "--trace", str(captured), "--"] + script,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    want, got = decisions(native), decisions(captured)
    assert len(want) == 3 and got == want
    # Each sample plants a forward overflow: the test compares diagnoses, not two blanks.
    assert all(d[1] is not None and d[1][1] == "forward" and d[2] is not None for d in want)
