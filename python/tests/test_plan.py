"""The plan (AMPROBE_AUTOCAST, AMPROBE_FP32_MODULES, AMPROBE_INIT_SCALE) against the script
in plan_scripts.py, each run in its own process as `amprobe compare` and `amprobe fix` run
a user's script: a forced run is bitwise the run the script would make written that way,
and without a plan watching changes nothing."""

import json
import os
import subprocess
import sys

import pytest
import torch

from amprobe_torch import _plan
from amprobe_torch._patches import Patches

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "plan_scripts.py")


def run(tmp_path, *args, env=None, name="r", check=True):
    """Runs the script with `args` and the plan variables in `env` (none else); returns its
    result, its trace's records (None when it wrote none) and the finished process."""
    out = tmp_path / f"{name}.json"
    trace = tmp_path / f"{name}.jsonl"
    e = {k: v for k, v in os.environ.items() if not k.startswith("AMPROBE_")}
    e.update(env or {})
    e["AMPROBE_TRACE"] = str(trace)
    p = subprocess.run(
        [sys.executable, "-W", "ignore", SCRIPT, "--out", str(out), *args], env=e, capture_output=True, text=True
    )
    if check:
        assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text()) if out.exists() else None
    recs = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else None
    return result, recs, p


def same_training(a, b):
    assert a["losses"] == b["losses"]
    assert a["scales"] == b["scales"]
    assert a["params"] == b["params"]


def test_without_a_plan_watching_changes_nothing(tmp_path):
    plain, _, _ = run(tmp_path, "--no-watch", name="plain")
    seen, recs, _ = run(tmp_path, name="seen")
    same_training(plain, seen)
    assert recs[0]["precision"] == "fp16" and recs[0]["scaler"]["init_scale"] == 2.0**16
    assert _plan.from_env({}) is None
    assert _plan.from_env({"AMPROBE_AUTOCAST": "", "AMPROBE_FP32_MODULES": " , "}) is None
    # autocast itself is left alone.
    code = (
        "import torch, amprobe_torch;"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=1);"
        "orig = torch.amp.autocast_mode.autocast.__enter__;"
        "amprobe_torch.watch(m, o, None);"
        "assert torch.amp.autocast_mode.autocast.__enter__ is orig;"
        "assert 'forward' not in m.__dict__"
    )
    e = {k: v for k, v in os.environ.items() if not k.startswith("AMPROBE_")}
    e["AMPROBE_TRACE"] = str(tmp_path / "x.jsonl")
    e["PYTHONPATH"] = os.path.join(HERE, "..")
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=e, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("form", ["with", "decorator", "cpu-amp"])
def test_bf16_is_the_script_written_in_bf16(tmp_path, form):
    want, _, _ = run(tmp_path, "--no-watch", "--dtype", "bf16", "--form", form, name="want")
    got, recs, _ = run(tmp_path, "--form", form, env={"AMPROBE_AUTOCAST": "bf16"}, name="got")
    same_training(want, got)
    assert not got["scaler_enabled"] and set(got["dtypes"].values()) == {"bfloat16"}
    h = recs[0]
    assert h["precision"] == "bf16" and h["autocast_dtype"] == "bfloat16" and h["scaler"] is None
    # The spike that overflows fp16 at step 2 is in range in bf16.
    assert [s["skipped"] for s in recs[1:5]] == [False] * 4


def test_fp32_turns_autocast_and_the_scaler_off(tmp_path):
    want, _, _ = run(tmp_path, "--no-watch", "--dtype", "none", name="want")
    got, recs, _ = run(tmp_path, env={"AMPROBE_AUTOCAST": "fp32"}, name="got")
    same_training(want, got)
    assert set(got["dtypes"].values()) == {"float32"}
    assert recs[0]["precision"] == "fp32" and recs[0]["autocast_dtype"] is None
    forward = [r for r in recs[1]["ops"] if r["phase"] == "forward"]
    assert forward and all(r["output"]["dtype"] == "float32" for r in forward)


def test_a_region_the_script_disables_stays_disabled(tmp_path):
    got, _, _ = run(tmp_path, "--head-fp32", env={"AMPROBE_AUTOCAST": "bf16"})
    assert got["dtypes"]["amplifier"] == "bfloat16" and got["dtypes"]["head"] == "float32"


def test_a_script_without_autocast_gets_one_around_its_model(tmp_path):
    # The script autocasts only the model's call, so the forced run is that script's.
    want, _, _ = run(tmp_path, "--no-watch", "--dtype", "bf16", name="want")
    got, recs, _ = run(tmp_path, "--dtype", "none", env={"AMPROBE_AUTOCAST": "bf16"}, name="got")
    same_training(want, got)
    assert recs[0]["precision"] == "bf16"


def test_fp16_turns_a_disabled_scaler_on(tmp_path):
    want, _, _ = run(tmp_path, "--no-watch", "--dtype", "fp16", name="want")
    got, recs, _ = run(tmp_path, "--dtype", "bf16", env={"AMPROBE_AUTOCAST": "fp16"}, name="got")
    same_training(want, got)
    assert got["scaler_enabled"] and got["scales"][2] == 2.0**15, "the spike skips step 2 in fp16"
    assert recs[0]["precision"] == "fp16" and recs[0]["scaler"]["init_scale"] == 2.0**16


def test_modules_kept_in_fp32_run_outside_autocast(tmp_path):
    plain, _, _ = run(tmp_path, "--no-watch", name="plain")
    assert float.fromhex(plain["losses"][2]) != float.fromhex(plain["losses"][2]), "fp16 overflows at step 2"
    got, recs, _ = run(tmp_path, env={"AMPROBE_FP32_MODULES": "amplifier"}, name="got")
    d = got["dtypes"]
    assert d["amplifier"] == "float32" and d["embed"] == "float16" and d["head"] == "float16"
    assert all(float.fromhex(x) == float.fromhex(x) for x in got["losses"]), "the overflow is gone"
    assert got["scales"] == [2.0**16] * 4
    ops = [r for r in recs[1]["ops"] if r["phase"] == "forward"]
    assert all(r["output"]["dtype"] == "float32" for r in ops if r["module"] == "amplifier")
    assert any(r["output"]["dtype"] == "float16" for r in ops if r["module"] == "mid.0")
    # A pattern keeps every module it matches: `mid` and its children.
    got, _, _ = run(tmp_path, env={"AMPROBE_FP32_MODULES": "mid, amplifier"}, name="mid")
    assert {got["dtypes"][m] for m in ("mid", "mid.0", "mid.2", "amplifier")} == {"float32"}


def test_init_scale_is_the_scalers_first_scale(tmp_path):
    got, recs, _ = run(tmp_path, env={"AMPROBE_INIT_SCALE": "1024"})
    assert got["scales"] == [1024.0, 1024.0, 512.0, 512.0]
    assert recs[0]["scaler"]["init_scale"] == 1024.0 and recs[1]["scale_before"] == 1024.0


@pytest.mark.parametrize(
    "env, words",
    [
        ({"AMPROBE_AUTOCAST": "fp8"}, "AMPROBE_AUTOCAST='fp8': expected fp16, bf16 or fp32"),
        ({"AMPROBE_FP32_MODULES": "amplifer"}, "no module of Tower matches `amplifer`"),
        ({"AMPROBE_INIT_SCALE": "-4"}, "AMPROBE_INIT_SCALE='-4': expected a positive finite number"),
        ({"AMPROBE_AUTOCAST": "bf16", "AMPROBE_INIT_SCALE": "8"}, "AMPROBE_INIT_SCALE: needs an enabled GradScaler"),
    ],
)
def test_a_plan_that_cannot_apply_says_which_variable(tmp_path, env, words):
    _, recs, p = run(tmp_path, env=env, check=False)
    assert p.returncode != 0 and words in p.stderr, p.stderr
    assert recs is None


def test_patterns_match_whole_segments_in_a_row():
    assert _plan.matches("wo", "encoder.block.3.layer.1.DenseReluDense.wo")
    assert not _plan.matches("wo", "encoder.block.3.layer.1.DenseReluDense.wox")
    assert _plan.matches("block.3", "encoder.block.3.layer.1")
    assert not _plan.matches("block.3", "encoder.block.13.layer.1")
    assert _plan.matches("block.*.layer", "encoder.block.7.layer.0")
    assert not _plan.matches("a.b.c", "a.b")


def test_a_module_kept_in_fp32_is_kept_so_in_its_copies_on_their_own_weights():
    # An EMA copy of a model whose module is kept in fp32: a replaced forward would have run
    # the original module (its weights) in the copy; the hooks run the copy's.
    import copy
    import io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    _plan._run_in_fp32(model[0], "cpu", Patches())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        h, h_twin = model[0](x), twin[0](x)
    assert h.dtype == h_twin.dtype == torch.float32
    assert torch.equal(h_twin, torch.nn.functional.linear(x, twin[0].weight, twin[0].bias))
    assert not torch.equal(h_twin, h)
    # Saved whole and loaded, the module runs as a plain one.
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.load(buf, weights_only=False)[0](x).dtype == torch.float16
