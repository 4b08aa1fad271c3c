"""`amprobe compare -- CMD` and `amprobe fix -- CMD` on the script in plan_scripts.py, whose
`amplifier` overflows fp16 at step 2: the comparison runs it in fp16, bf16 and fp32; the fix
finds the module by bisection, ranks the remedies against fp32, and the code it prints,
pasted into the script, makes it finite."""

import json
import os
import re
import subprocess
import sys

from test_watch import amprobe_bin

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "plan_scripts.py")


def amprobe(tmp_path, *args):
    e = {k: v for k, v in os.environ.items() if not k.startswith("AMPROBE_")}
    return subprocess.run([amprobe_bin(), *args], capture_output=True, text=True, cwd=tmp_path, env=e)


def script(*args):
    return ["--", sys.executable, "-W", "ignore", SCRIPT, *args]


def read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.endswith("\n")]


def test_compare_runs_the_script_in_three_precisions(tmp_path):
    r = amprobe(tmp_path, "compare", "--out", "cmp", "--steps", "3", *script())
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "fp16, its own precision: 3 steps (then stopped), 1 skipped, verdict forward-nonfinite" in out
    assert "bf16, forced (AMPROBE_AUTOCAST=bf16): 3 steps (then stopped), 0 skipped, verdict clean" in out
    assert "fp32, forced (AMPROBE_AUTOCAST=fp32): 3 steps (then stopped), 0 skipped, verdict clean" in out
    for name, precision in [("own", "fp16"), ("bf16", "bf16"), ("fp32", "fp32")]:
        recs = read(tmp_path / "cmp" / f"{name}.jsonl")
        assert recs[0]["precision"] == precision
        # Op records of every step, for the op-by-op comparison.
        assert [s["step"] for s in recs[1:4]] == [0, 1, 2] and all(s["ops"] for s in recs[1:4])
    assert "fp16 (own) vs fp32 (fp32): first divergence" in out
    summary = (tmp_path / "cmp" / "summary.md").read_text()
    assert "fp16 (own)" in summary and "bf16 (bf16)" in summary
    assert (tmp_path / "cmp" / "index.html").exists()


def test_fix_finds_the_module_ranks_the_remedies_and_prints_code_that_works(tmp_path):
    r = amprobe(tmp_path, "fix", "--out", "fix", *script())
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "First failing step: 2 (fp16 on cpu; first non-finite: `addmm` in `amplifier` (forward))" in out
    assert "fp32 reference (AMPROBE_AUTOCAST=fp32): finite to step 2" in out
    assert "FIXES IT: bf16 autocast (AMPROBE_AUTOCAST=bf16)" in out
    assert "keeping amplifier in fp32 makes step 2 finite (1-minimal" in out
    assert "FIXES IT: keeping amplifier in fp32 (AMPROBE_FP32_MODULES=amplifier)" in out
    ranking = out.split("Ranked by what they cost against fp32")[1].split("\n\n")[0]
    rows = re.findall(r"^  \d+\. (.+?)\s+(\S+)$", ranking, re.M)
    assert {name for name, _ in rows} == {"keeping amplifier in fp32", "bf16 autocast"}
    costs = [float(c) for _, c in rows]
    assert costs == sorted(costs) and costs[0] < costs[1]
    # bf16 rounds every op; fp16 with one module in fp32 is closer to fp32.
    assert rows[0][0] == "keeping amplifier in fp32"
    assert "Fix: keeping amplifier in fp32 (what AMPROBE_FP32_MODULES=amplifier did)" in out
    code = "\n".join(line[4:] for line in out.split("Paste into the script:\n")[1].splitlines())
    assert 'for name in ["amplifier"]:' in code
    # The printed fix, pasted into the script without the companion, makes it finite.
    fix = tmp_path / "fix.py"
    fix.write_text(code)
    res = tmp_path / "res.json"
    p = subprocess.run([sys.executable, "-W", "ignore", SCRIPT, "--no-watch", "--exec", str(fix), "--out", str(res)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    got = json.loads(res.read_text())
    assert all(float.fromhex(x) == float.fromhex(x) for x in got["losses"]) and got["scales"] == [2.0**16] * 4
    assert got["dtypes"]["amplifier"] == "float32" and got["dtypes"]["head"] == "float16"


def test_fix_lowers_a_scale_that_is_too_high(tmp_path):
    r = amprobe(tmp_path, "fix", "--out", "fix", *script("--init-scale", str(2.0**40), "--spike-step", "-1"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "First failing step: 0" in out and "(backward))" in out
    m = re.search(r"FIXES IT: initial loss scale (\d+) = 2\^\d+ \(AMPROBE_INIT_SCALE=\1\)", out)
    assert m, out
    # No module set is tried: at scale 1 the step is finite.
    assert "Bisection" not in out
    scale = m.group(1)
    # A scale in range keeps fp16's rounding: closer to fp32 than bf16.
    assert f"Fix: initial loss scale {scale} = 2^" in out
    assert f'    scaler = torch.amp.GradScaler("cpu", init_scale={float(scale)!r})' in out
    res = tmp_path / "res.json"
    p = subprocess.run([sys.executable, "-W", "ignore", SCRIPT, "--no-watch", "--init-scale", scale, "--spike-step", "-1", "--out", str(res)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(res.read_text())["scales"][0] == float(scale), "step 0 is not skipped"


def test_fix_of_a_clean_script_has_nothing_to_do(tmp_path):
    r = amprobe(tmp_path, "fix", "--out", "fix", *script("--spike-step", "-1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No step failed in 4 steps: nothing to fix." in r.stdout


def test_a_lockfile_of_the_script_holds_its_reruns_and_catches_a_larger_init(tmp_path):
    clean = script("--spike-step", "-1")
    r = amprobe(tmp_path, "baseline", "--out", "tower.lock", *clean)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"lockfile: tower.lock \(\d+ ops over 4 step\(s\) with op records\)", r.stdout), r.stdout
    text = (tmp_path / "tower.lock").read_text()
    assert 'model = "Tower"' in text and 'precision = "fp16"' in text
    r = amprobe(tmp_path, "run", "--fail-on", "drift=tower.lock", *clean)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   drift=tower.lock: every op within its envelope" in r.stdout
    # The amplifier's weights ten times larger: its weight cast is the first op out.
    r = amprobe(tmp_path, "run", "--fail-on", "drift=tower.lock", *script("--spike-step", "-1", "--gain", "2000"))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.split("FAIL drift=tower.lock: ")[1].splitlines()
    assert lines[1].strip().startswith("step 0: forward `_to_copy` in `amplifier` #2: max |x| 499.75"), r.stdout
    # The overflow at step 2: the amplifier's Inf is new, and the scale path leaves the lock's.
    r = amprobe(tmp_path, "run", "--fail-on", "drift=tower.lock", *script())
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"step 2: forward `addmm` in `amplifier`: \d+ NaN/Inf value\(s\), where the lock has none", r.stdout), r.stdout
    assert "2 steps off the loss-scale path" in r.stdout
