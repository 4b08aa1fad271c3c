"""DeepSpeed, run as `amprobe run -- torchrun ... deepspeed_zero.py` with no amprobe line in
the script (python/tests/stacks/deepspeed_zero.py, written as DeepSpeed's getting-started
guide teaches): fp16 with its dynamic loss scaler, ZeRO stages 1 and 2, on the CPU. Each run
is held to the same script run by plain torchrun (bitwise the same losses and parameters),
to what DeepSpeed itself says of each step (the loss scale it ran with, whether it skipped
the update: its `skipped_steps`), and, for a planted overflow, to plain forward hooks."""

import json
import math
import os
import subprocess
import sys

import pytest

from test_stacks import STACKS, same, steps
from test_watch import amprobe_bin, read

SCRIPT = os.path.join(STACKS, "deepspeed_zero.py")


def env():
    # DeepSpeed builds its shared-memory op with ninja, found on PATH (the venv's bin).
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def torchrun(out, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            SCRIPT, str(out), *args]


def plain(tmp_path, *args):
    r = subprocess.run(torchrun(tmp_path / "plain", *args), capture_output=True, text=True, cwd=tmp_path,
                       env=env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((tmp_path / "plain" / "result.json").read_text())


def captured(tmp_path, *args):
    trace, summary = tmp_path / "t.jsonl", tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary), "--",
           *torchrun(tmp_path / "captured", *args)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=600)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    got = json.loads((tmp_path / "captured" / "result.json").read_text())
    return got, read(trace), json.loads(summary.read_text()), r.stdout


def same_float(a, b):
    """(the trace writes a non-finite value as a string: "NaN", "inf")"""
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or a == b


def held_to_deepspeed(ref, trace):
    """Each step record against what DeepSpeed said of that step."""
    ss = steps(trace)
    assert len(ss) == len(ref["steps"]) == 8
    for i, (s, d) in enumerate(zip(ss, ref["steps"])):
        assert s["micro_batches"] == 1
        assert same_float(s["loss"], d["loss"]), (i, s["loss"], d["loss"])
        assert s["scale_before"] == d["scale"], (i, s["scale_before"], d["scale"])
        assert s["skipped"] == s["found_inf"] == d["skipped"], (i, s, d)
        if i + 1 < len(ss):
            assert s["scale_after"] == ref["steps"][i + 1]["scale"], (i, s["scale_after"])
    return ss


def test_deepspeed_zero2_fp16_planted_overflows_skips_and_hysteresis(tmp_path):
    ref = plain(tmp_path, "--stage", "2", "--planted", "--hooks")
    got, trace, summary, stdout = captured(tmp_path, "--stage", "2", "--planted")
    got["hooks_first"] = ref["hooks_first"]
    same(ref, got)
    h = trace[0]
    assert (h["model"], h["precision"]) == ("Net", "half"), h
    d = h["source"]["discovery"]
    assert (d["models"], d["optimizers"], d["scaler"]) == (["Net"], ["DeepSpeedZeroOptimizer"], "DynamicLossScaler"), d
    assert h["scaler"]["kind"] == "DynamicLossScaler" and h["scaler"]["hysteresis"] == 2, h["scaler"]
    assert h["scaler"]["init_scale"] == ref["steps"][0]["scale"]
    ss = held_to_deepspeed(ref, trace)
    # DeepSpeed's own decisions: both planted steps skipped, the scale kept at the first
    # (hysteresis) and halved at the second.
    assert [i for i, s in enumerate(ref["steps"]) if s["skipped"]] == [3, 5]
    assert ss[3]["scale_after"] == ss[3]["scale_before"] and ss[5]["scale_after"] == ss[5]["scale_before"] / 2
    step, module = ref["hooks_first"]
    assert (summary["first_inf"]["step"], summary["first_inf"]["module"], summary["first_inf"]["phase"]) == (
        step, module, "forward"), summary
    # The loss scaling is DeepSpeed's, not a model op.
    forward = [o["op"] for o in ss[3]["ops"] if o["phase"] == "forward"]
    assert "mse_loss" in forward and "mul" not in forward, forward
    assert summary["verdict"] == trace[-1]["verdict"]
    assert "found as the script made them: Net trained by DeepSpeedZeroOptimizer, scaler DynamicLossScaler" in stdout


@pytest.mark.parametrize("stage", ["1"])
def test_deepspeed_zero1_fp16_clean_run_grows_its_scale(tmp_path, stage):
    ref = plain(tmp_path, "--stage", stage)
    got, trace, summary, _ = captured(tmp_path, "--stage", stage)
    same(ref, got)
    ss = held_to_deepspeed(ref, trace)
    assert not any(s["skipped"] for s in ss)
    # (its scale window is 3: the scale doubles after each 3 steps without overflow)
    assert ss[-1]["scale_before"] > ss[0]["scale_before"]
    assert summary["first_inf"] is None and summary["first_nan"] is None and summary["verdict"] == "clean"


def test_deepspeed_fp16_without_zero_is_watched_and_its_unread_scaler_told(tmp_path):
    # DeepSpeed's fp16 optimizer without ZeRO steps its fp32 copies once as it is made,
    # before any forward: discovery waits for the engine's.
    ref = plain(tmp_path, "--stage", "0", "--planted", "--hooks")
    got, trace, summary, stdout = captured(tmp_path, "--stage", "0", "--planted")
    got["hooks_first"] = ref["hooks_first"]
    same(ref, got)
    d = trace[0]["source"]["discovery"]
    assert (d["models"], d["optimizers"], d["scaler"]) == (["Net"], ["FP16_UnfusedOptimizer"], None), d
    assert "keeps its loss scale where the companion does not read it" in stdout, stdout
    ss = steps(trace)
    assert len(ss) == 8 and all(same_float(s["loss"], r["loss"]) for s, r in zip(ss, ref["steps"]))
    step, module = ref["hooks_first"]
    assert (summary["first_inf"]["step"], summary["first_inf"]["module"]) == (step, module), summary


def test_the_plans_initial_scale_takes_in_deepspeeds_loss_scaler(tmp_path):
    # The config starts at 2**12; the plan's 1024 is what DeepSpeed itself then scales by.
    trace = tmp_path / "t.jsonl"
    e = env()
    e["AMPROBE_INIT_SCALE"] = "1024"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--", *torchrun(tmp_path / "captured", "--stage", "1")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=e, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    got = json.loads((tmp_path / "captured" / "result.json").read_text())
    recs = read(trace)
    assert recs[0]["scaler"]["init_scale"] == 1024.0, recs[0]["scaler"]
    # The script reads step 0's scale before the engine's first forward, where discovery
    # attaches and the plan is applied; from step 1 on it is DeepSpeed's own, grown from
    # 1024 as the config's window of 3 grows it.
    assert got["steps"][0]["scale"] == 4096.0
    assert [s["scale"] for s in got["steps"][1:]] == [1024.0, 1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0]
    got["steps"][0]["scale"] = 1024.0
    held_to_deepspeed(got, recs)


def test_compare_under_deepspeed_fp16_names_its_config_as_the_cause(tmp_path):
    # DeepSpeed casts the module to fp16 itself: no autocast region for the plan to force.
    out = tmp_path / "cmp"
    cmd = [amprobe_bin(), "compare", "--out", str(out), "--", *torchrun(tmp_path / "result", "--stage", "2")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=900)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "half, its own precision: 8 steps" in r.stdout, r.stdout
    words = "AMPROBE_AUTOCAST=bf16: DeepSpeed's `fp16` config made Net's parameters torch.float16 itself"
    assert words in r.stderr and '"fp16": {"enabled": false}' in r.stderr, r.stderr
    assert not (out / "index.html").exists()
