"""`amprobe compare -- CMD` and `amprobe fix -- CMD` under the trainers of test_stacks.py,
with no amprobe line in the scripts: the plan (AMPROBE_AUTOCAST, AMPROBE_FP32_MODULES,
AMPROBE_INIT_SCALE) takes where the library enters autocast and holds its scaler, so the
fp32 reference is a real fp32 run (held to the same script run by plain python with the
library's own precision set to fp32) and a remedy is really run; a plan that cannot take
stops the command with its cause."""

import json
import os
import re
import subprocess
import sys

from test_stacks import STACKS, close, plain, steps
from test_stacks_more import torchrun
from test_watch import amprobe_bin, read


def cli(tmp_path, verb, script, *args, flags=(), env=None, launch=None):
    """`amprobe VERB --out DIR FLAGS -- python STACKS/SCRIPT OUT ARGS` (or the command
    `launch` gives): (the finished process, DIR)."""
    out = tmp_path / verb
    cmd = launch or [sys.executable, os.path.join(STACKS, script), str(tmp_path / "result"), *args]
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AMPROBE_")}
    e.update(env or {})
    r = subprocess.run([amprobe_bin(), verb, "--out", str(out), *flags, "--", *cmd],
                       capture_output=True, text=True, cwd=tmp_path, env=e, timeout=900)
    return r, out


def captured(tmp_path, script, *args, env):
    """The script run by `amprobe run` under the plan `env`: (its result.json, its trace)."""
    trace = tmp_path / "planned.jsonl"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--",
           sys.executable, os.path.join(STACKS, script), str(tmp_path / "planned"), *args]
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AMPROBE_")}
    e.update(env)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=e, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    return json.loads((tmp_path / "planned" / "result.json").read_text()), read(trace)


def op_dtypes(records, phases=("forward", "backward")):
    """The output dtypes of every op of the steps with op records, in `phases`."""
    return {o["output"]["dtype"] for s in steps(records) for o in s["ops"] or [] if o["phase"] in phases}


def aligned_counts(out):
    """The aligned op count of each run against the reference, from the comparison's
    summary."""
    return [int(n) for n in re.findall(r"Aligned ops: (\d+);", (out / "summary.md").read_text())]


def held_to_fp32(r, out, own_precision, low):
    """compare ran `own` in `own_precision` (its ops in dtype `low`) and a real fp32
    reference, and aligned their ops; returns the reference's records."""
    assert r.returncode == 0, r.stdout + r.stderr
    own, ref = read(out / "own.jsonl"), read(out / "fp32.jsonl")
    assert own[0]["precision"] == own_precision and low in op_dtypes(own), (own[0], op_dtypes(own))
    assert ref[0]["precision"] == "fp32" and ref[0]["autocast_dtype"] is None, ref[0]
    assert op_dtypes(ref) == {"float32"}, op_dtypes(ref)
    assert "fp32, forced (AMPROBE_AUTOCAST=fp32)" in r.stdout, r.stdout
    counts = aligned_counts(out)
    assert counts and all(n > 0 for n in counts), counts
    return ref


def test_compare_under_the_hf_trainer_bf16_runs_a_real_fp32_reference(tmp_path):
    r, out = cli(tmp_path, "compare", "trainer_gpt2.py")
    ref = held_to_fp32(r, out, "bf16", "bfloat16")
    assert "bf16: its own precision, run above" in r.stdout, r.stdout
    # The same script with the Trainer's fp16 on the CPU, which trains in fp32 (test_stacks):
    # its logged losses are the reference's.
    fp32 = plain(tmp_path, "trainer_gpt2.py", "--fp16")["logged"]
    assert len(steps(ref)) == len(fp32) == 4
    for s, logged in zip(steps(ref), fp32):
        assert close(s["loss"], logged["loss"]), (s["loss"], logged)
    own = steps(read(out / "own.jsonl"))
    assert any(not close(a["loss"], b["loss"], 1e-9) for a, b in zip(own, steps(ref))), "bf16 is not fp32"


def test_compare_under_lightning_bf16_mixed_runs_a_real_fp32_reference(tmp_path):
    r, out = cli(tmp_path, "compare", "lightning_autoencoder.py", "bf16-mixed")
    ref = held_to_fp32(r, out, "bf16", "bfloat16")
    fp32 = plain(tmp_path, "lightning_autoencoder.py", "32")["losses"]
    assert [s["loss"] for s in steps(ref)] == fp32


def test_compare_under_accelerate_bf16_runs_a_real_fp32_reference(tmp_path):
    r, out = cli(tmp_path, "compare", "accelerate_basic.py", "bf16")
    ref = held_to_fp32(r, out, "bf16", "bfloat16")
    # Accelerate's `no`: its step is the mean of its two micro-batches' losses.
    fp32 = plain(tmp_path, "accelerate_basic.py", "no")["losses"]
    assert len(steps(ref)) * 2 == len(fp32)
    for s, a, b in zip(steps(ref), fp32[::2], fp32[1::2]):
        assert close(s["loss"], (a + b) / 2), (s["loss"], a, b)


def test_compare_under_the_lightning_fp16_plugin_forces_the_region_lightning_entered_first(tmp_path):
    # Lightning enters its autocast before the forward where the plan is applied: step 0's
    # ops are the forced dtype's too.
    r, out = cli(tmp_path, "compare", "lightning_autoencoder.py", "16-plugin")
    held_to_fp32(r, out, "fp16", "float16")
    bf16 = read(out / "bf16.jsonl")
    assert bf16[0]["precision"] == "bf16" and bf16[0]["scaler"] is None, bf16[0]
    first = [o["output"]["dtype"] for o in steps(bf16)[0]["ops"] if o["phase"] == "forward"]
    assert "bfloat16" in first and "float16" not in first, first


def test_fix_under_the_lightning_fp16_plugin_proves_a_remedy_for_its_planted_overflow(tmp_path):
    r, out = cli(tmp_path, "fix", "lightning_autoencoder.py", "16-plugin", "--planted", flags=["--bisect-budget", "2"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "First failing step: 2 (fp16 on cpu" in r.stdout and "The run is fp32" not in r.stdout, r.stdout
    assert "FIXES IT: bf16 autocast (AMPROBE_AUTOCAST=bf16) makes every step to 2 finite" in r.stdout, r.stdout
    assert "\nFix: " in r.stdout, r.stdout
    own, remedy = steps(read(out / "own.jsonl")), read(out / "bf16.jsonl")
    assert own[2]["skipped"] and own[2]["found_inf"], own[2]
    assert remedy[0]["precision"] == "bf16", remedy[0]
    # (the run is stopped once step 2 is written: it may have written another)
    ss = [s for s in steps(remedy) if s["step"] <= 2]
    assert [s["step"] for s in ss] == [0, 1, 2] and not any(s["skipped"] or s["found_inf"] for s in ss)
    assert all(s["loss"] is not None and s["origins"]["first_inf"] is None for s in ss), ss[2]["origins"]


def test_the_plan_reaches_the_scaler_and_modules_of_the_lightning_fp16_plugin(tmp_path):
    # Seen from outside the companion (lightning_plan.py): the precision plugin's scaler
    # and plain forward hooks.
    base = plain(tmp_path, "lightning_plan.py")
    assert {s["scale"] for s in base["scaler"]} == {65536.0}
    got, trace = captured(tmp_path, "lightning_plan.py", env={"AMPROBE_INIT_SCALE": "1024"})
    assert [s["scale"] for s in got["scaler"]] == [1024.0] * 4, got["scaler"]
    for s, loss in zip(got["scaler"], got["losses"]):
        assert close(s["scaled_loss"], loss * 1024.0, 1e-3), (s, loss)
    assert trace[0]["scaler"]["init_scale"] == 1024.0 and steps(trace)[0]["scale_before"] == 1024.0
    got, _ = captured(tmp_path, "lightning_plan.py", env={"AMPROBE_FP32_MODULES": "encoder.0"})
    for step, d in got["dtypes"].items():
        assert d["encoder.0"] == "float32" and d["decoder.0"] == "float16", (step, d)
    got, _ = captured(tmp_path, "lightning_plan.py", env={"AMPROBE_AUTOCAST": "bf16"})
    assert not any(s["enabled"] for s in got["scaler"]), got["scaler"]
    assert {t for d in got["dtypes"].values() for t in d.values()} == {"bfloat16"}, got["dtypes"]


def test_fix_under_accelerate_names_an_overflow_fp32_has_too(tmp_path):
    # The planted weights (1e38) overflow in fp32 as well: no precision remedy is offered.
    r, out = cli(tmp_path, "fix", "accelerate_basic.py", "bf16", "--planted")
    assert r.returncode == 1, r.stdout + r.stderr
    ref = read(out / "fp32.jsonl")
    assert ref[0]["precision"] == "fp32" and op_dtypes(ref, ("forward",)) == {"float32"}, ref[0]
    assert "fp32 reference: step 0 fails in fp32 too" in r.stdout and "not a precision problem" in r.stdout, r.stdout
    assert "FIXES IT" not in r.stdout


def test_a_plan_fsdp2s_own_mixed_precision_does_not_take_is_refused_with_its_cause(tmp_path):
    # FSDP2's MixedPrecisionPolicy casts the parameters, outside autocast: no fp32 run.
    r, out = cli(tmp_path, "compare", None, launch=torchrun(tmp_path / "result", "mp"))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "bf16, its own precision: 4 steps" in r.stdout, r.stdout
    words = "AMPROBE_AUTOCAST=fp32: FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) casts MLP's parameters"
    assert words in r.stderr, r.stderr
    assert not (out / "fp32.rank0.jsonl").exists() and not (out / "index.html").exists()


def test_compare_under_fsdp2_with_autocast_runs_a_real_fp32_reference_on_rank_0(tmp_path):
    r, out = cli(tmp_path, "compare", None, launch=torchrun(tmp_path / "result", "autocast"))
    assert r.returncode == 0, r.stdout + r.stderr
    own, ref = read(out / "own.rank0.jsonl"), read(out / "fp32.rank0.jsonl")
    assert own[0]["precision"] == "bf16" and ref[0]["precision"] == "fp32", (own[0], ref[0])
    assert ref[0]["source"]["world_size"] == 2 and op_dtypes(ref) == {"float32"}, op_dtypes(ref)
    assert "vs fp32 (fp32.rank0)" in r.stdout, r.stdout
