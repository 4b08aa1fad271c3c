"""The trainers people use, run as `amprobe run -- python SCRIPT` with no amprobe line in
the script (python/tests/stacks/, each written as its library's documentation teaches):
the companion the CLI carries discovers the model, optimizer and scaler. Each run is held
to the same script run by plain `python` (bitwise the same losses and parameters), to what
the library itself logs (loss, gradient norm), and, for a planted overflow, to plain
forward hooks (`stacks/hooks.py`)."""

import json
import math
import os
import subprocess
import sys

import pytest

from test_watch import amprobe_bin, read

HERE = os.path.dirname(os.path.abspath(__file__))
STACKS = os.path.join(HERE, "stacks")


def plain(tmp_path, script, *args):
    """The script run by plain python: its result.json."""
    out = tmp_path / "plain"
    r = subprocess.run([sys.executable, os.path.join(STACKS, script), str(out), *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "result.json").read_text())


def captured(tmp_path, script, *args, fail_on=None):
    """The script run by `amprobe run` (no amprobe line in it): (its result.json, the
    trace's records, the summary JSON, the CLI's stdout)."""
    out, trace, summary = tmp_path / "captured", tmp_path / "t.jsonl", tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary)]
    if fail_on:
        cmd += ["--fail-on", fail_on]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd + ["--", sys.executable, os.path.join(STACKS, script), str(out), *args],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return (json.loads((out / "result.json").read_text()), read(trace), json.loads(summary.read_text()),
            r.stdout)


def same(a, b):
    """Bitwise the same figures (NaN equal to NaN)."""
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), (a, b)


def steps(records):
    return [r for r in records if r["type"] == "step"]


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_hf_trainer_bf16_with_accumulation_is_seen_as_it_trains(tmp_path):
    ref = plain(tmp_path, "trainer_gpt2.py")
    got, trace, summary, stdout = captured(tmp_path, "trainer_gpt2.py")
    same(ref, got)
    h = trace[0]
    assert (h["model"], h["precision"], h["autocast_dtype"]) == ("GPT2LMHeadModel", "bf16", "bfloat16"), h
    d = h["source"]["discovery"]
    assert (d["models"], d["optimizers"], d["scaler"]) == (["GPT2LMHeadModel"], ["AdamW"], None), d
    assert "GPT2LMHeadModel under bf16" in stdout, stdout
    # The Trainer logs, at each optimizer step, the mean of its accumulated micro-batches'
    # losses (each divided by the accumulation count before its backward: their sum) and
    # the gradient norm its clipping returned.
    ss = steps(trace)
    assert len(ss) == len(ref["logged"]) == 4
    for s, logged in zip(ss, ref["logged"]):
        assert s["micro_batches"] == 2
        assert close(s["loss"], logged["loss"]), (s["loss"], logged)
        assert close(s["grad_norm"], logged["grad_norm"]), (s["grad_norm"], logged)
        assert 0 < s["clip_coef"] <= 1.0
        assert close(s["clip_coef"], min(1.0, 1.0 / (logged["grad_norm"] + 1e-6)))
    assert trace[-1]["type"] == "end" and trace[-1]["verdict"] == "clean"
    assert summary["verdict"] == "clean"


def test_accelerate_bf16_planted_overflow_is_where_forward_hooks_say(tmp_path):
    ref = plain(tmp_path, "accelerate_basic.py", "bf16", "--planted", "--hooks")
    got, trace, summary, _ = captured(tmp_path, "accelerate_basic.py", "bf16", "--planted")
    got["hooks_first"] = ref["hooks_first"]
    same(ref, got)
    assert trace[0]["precision"] == "bf16", trace[0]
    step, module = ref["hooks_first"]
    first = summary["first_inf"] or summary["first_nan"]
    assert (first["step"], first["module"], first["phase"]) == (step, module, "forward"), summary
    assert trace[-1]["verdict"] == summary["verdict"] == "diverged"


def test_accelerate_fp16_on_the_cpu_is_told_it_trained_in_fp32(tmp_path):
    ref = plain(tmp_path, "accelerate_basic.py", "fp16")
    got, trace, summary, stdout = captured(tmp_path, "accelerate_basic.py", "fp16")
    same(ref, got)
    h = trace[0]
    assert h["precision"] == "fp32", h
    assert h["source"]["requested_precision"]["precision"] == "fp16"
    assert "asked for fp16" in stdout and "ran in fp32" in stdout, stdout
    assert any("asked for fp16" in n for n in summary["capture_notes"]), summary


@pytest.mark.parametrize("precision,manual", [("bf16-mixed", False), ("bf16-mixed", True)])
def test_lightning_training_step_that_calls_submodules(tmp_path, precision, manual):
    args = [precision] + (["--manual"] if manual else [])
    ref = plain(tmp_path, "lightning_autoencoder.py", *args)
    got, trace, summary, _ = captured(tmp_path, "lightning_autoencoder.py", *args)
    same(ref, got)
    h = trace[0]
    assert (h["model"], h["precision"]) == ("LitAutoEncoder", "bf16"), h
    ss = steps(trace)
    # One optimizer step per batch, its loss the training_step's.
    assert len(ss) == len(ref["losses"]) == 5
    for s, loss in zip(ss, ref["losses"]):
        assert s["micro_batches"] == 1 and close(s["loss"], loss), (s["loss"], loss)
        assert s["grad_norm"] is not None and 0 < s["clip_coef"] <= 1.0
    names = {p["name"] for p in ss[0]["params"]}
    assert "encoder.0.weight" in names and not any(n.startswith("_forward_module") for n in names), names


def test_lightning_fp16_plugin_planted_overflow_and_its_skip(tmp_path):
    ref = plain(tmp_path, "lightning_autoencoder.py", "16-plugin", "--planted", "--hooks")
    got, trace, summary, _ = captured(tmp_path, "lightning_autoencoder.py", "16-plugin", "--planted")
    got["hooks_first"] = ref["hooks_first"]
    same(ref, got)
    h = trace[0]
    assert h["precision"] == "fp16" and h["scaler"] is not None, h
    assert h["source"]["discovery"]["scaler"] == "GradScaler"
    step, module = ref["hooks_first"]
    assert (summary["first_inf"]["step"], summary["first_inf"]["module"]) == (step, module), summary
    ss = steps(trace)
    assert ss[step]["skipped"] and ss[step]["found_inf"]
    assert [s["skipped"] for s in ss].count(True) == 1
    assert ss[step + 1]["scale_before"] == ss[step]["scale_before"] / 2


def test_hf_trainer_fp16_on_the_cpu_is_told_it_trained_in_fp32(tmp_path):
    ref = plain(tmp_path, "trainer_gpt2.py", "--fp16")
    got, trace, summary, stdout = captured(tmp_path, "trainer_gpt2.py", "--fp16")
    same(ref, got)
    assert trace[0]["precision"] == "fp32"
    assert trace[0]["source"]["requested_precision"]["precision"] == "fp16"
    assert "asked for fp16" in stdout and "ran in fp32" in stdout, stdout


def test_a_compiled_model_runs_eagerly_while_watched_and_is_told(tmp_path):
    # The choice (docs/companion.md, "torch.compile"): watched, compiled code runs eagerly,
    # and the summary says so. What that changes is exactly that: the training is the
    # uncompiled model's, bitwise.
    eager = plain(tmp_path, "compiled.py", "--no-compile")
    got, trace, summary, stdout = captured(tmp_path, "compiled.py")
    same(eager, got)
    h = trace[0]
    assert h["model"] == "Sequential" and h["source"]["compiled"] == {"regions": [""], "ran": "eager"}, h
    names = [p["name"] for p in steps(trace)[0]["params"]]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"], names
    assert "torch.compile: the model ran eagerly while watched" in stdout, stdout
    assert any(n.startswith("torch.compile:") for n in summary["capture_notes"])
