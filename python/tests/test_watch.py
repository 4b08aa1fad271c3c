"""The companion against the scripts in scripts.py: observing changes nothing, the trace is
amprobe's and amprobe reads it, origins are where the planted overflow is."""

import json
import os
import subprocess
import sys

import pytest
import torch

import amprobe_torch
from amprobe_torch import _stats
from scripts import train

HERE = os.path.dirname(os.path.abspath(__file__))


def amprobe_bin():
    """The amprobe binary: $AMPROBE_BIN (the Rust test harness sets it), else this
    checkout's release build."""
    path = os.environ.get("AMPROBE_BIN") or os.path.join(HERE, "..", "..", "target", "release", "amprobe")
    assert os.path.exists(path), f"no amprobe binary at {path}: build it (cargo build --release) or set AMPROBE_BIN"
    return path


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def watcher(path, **kw):
    def w(model, opt, scaler):
        return amprobe_torch.watch(model, opt, scaler, trace=str(path), **kw)

    return w


def close_all():
    from amprobe_torch import _capture

    for w in list(_capture._WATCHERS):
        w.close()
    _capture._WATCHERS.clear()


def assert_same_training(plain, seen):
    """Losses (NaN as NaN), scales and final parameters bitwise equal."""
    for a, b in zip(plain[0], seen[0]):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())
    assert plain[1] == seen[1]
    for n in plain[2]:
        assert torch.equal(plain[2][n], seen[2][n]), n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_observing_changes_nothing_bitwise(tmp_path, dtype):
    # Overflow at step 2 in fp16: a skipped step and a lower scale are part of what must match.
    plain = train(dtype, steps=5, boom_step=2)
    seen = train(dtype, steps=5, boom_step=2, watch=watcher(tmp_path / "t.jsonl", sample_every=2))
    close_all()
    assert_same_training(plain, seen)
    if dtype == torch.float16:
        assert plain[1][2] == plain[1][1] / 2, "the planted overflow skipped step 2"


def test_trace_is_amprobes_and_names_the_planted_overflow(tmp_path):
    path = tmp_path / "t.jsonl"
    train(torch.float16, steps=4, boom_step=2, watch=watcher(path))
    close_all()
    recs = read(path)
    assert [r["type"] for r in recs] == ["header", "step", "step", "step", "step", "end"]
    h = recs[0]
    assert h["schema_version"] == 1 and h["precision"] == "fp16"
    assert h["autocast_dtype"] == "float16" and h["source"]["kind"] == "pytorch"
    steps = recs[1:5]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    # Full records in the first step, none in clean later ones, counts in the failing one.
    assert steps[0]["ops"] and steps[1]["ops"] is None and steps[3]["ops"] is None
    assert steps[2]["ops"], "a step with a non-finite value keeps its records"
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert steps[2]["scale_after"] == steps[2]["scale_before"] / 2
    o = steps[2]["origins"]
    # The input, scaled by 3e4, overflows fp16 where the first linear casts it.
    assert o["first_inf"]["module"] == "embed" and o["first_inf"]["phase"] == "forward"
    assert o["first_inf"]["op"] == "_to_copy"
    # The chain runs from the first Inf to the first NaN along the data path (amprobe's rule).
    assert o["first_nan"] is not None and o["chain"][0] == o["first_inf"]
    assert o["chain"][-1] == o["first_nan"] and len(o["chain"]) == 3
    for s in (steps[0], steps[1], steps[3]):
        assert s["origins"]["first_inf"] is None and s["origins"]["first_nan"] is None
    # Records of the first step: every phase, modules named as the model names them.
    ops = steps[0]["ops"]
    phases = {r["phase"] for r in ops}
    assert phases == {"forward", "backward", "optimizer"}
    # The loss scaling and its gradient are the scaler's, not the model's: not recorded.
    first_backward = next(r for r in ops if r["phase"] == "backward")
    assert first_backward["stats"]["max_abs"] != steps[0]["scale_before"]
    assert not any(r["op"] == "mul" and r["module"] == "" and r["phase"] == "backward" for r in ops)
    modules = {r["module"] for r in ops if r["phase"] == "backward"}
    assert {"blocks.1.up", "blocks.1.down", "head"} <= modules
    mm = [r for r in ops if r["phase"] == "forward" and r["module"] == "blocks.1.up" and r["op"] == "addmm"]
    assert len(mm) == 1 and mm[0]["output"]["dtype"] == "float16"
    st = mm[0]["stats"]
    assert st["numel"] == 12 * 64 and st["max_abs"] > 0 and sum(st["exp_hist"]["counts"]) > 0
    names = [p["name"] for p in steps[0]["params"]]
    assert names[0] == "embed.weight" and len(names) == 3 * 6 + 4
    assert all(p["grad_l2"] > 0 for p in steps[0]["params"])
    # amprobe reads it: its report finds the same origin and the skipped step.
    out = subprocess.run(
        [amprobe_bin(), "report", str(path), "--out", str(tmp_path / "report")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "verdict: forward-nonfinite" in out.stdout
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "`_to_copy` | `embed`" in summary
    assert "1 of 4 step(s) skipped" in summary


def test_no_collection_runs_while_a_record_is_written_and_the_collector_is_left_as_found(tmp_path, monkeypatch):
    # A step's record is built, written and dropped with the garbage collector paused (a
    # collection there would only promote what is about to be freed); the script's own
    # setting is what it finds after each step, on or off.
    import gc

    from amprobe_torch import _capture

    inside, during = [False], []
    real = _capture.Watcher._finish

    def finish(self, read):
        inside[0] = True
        try:
            # (enough tracked garbage-free allocations to pass the youngest threshold)
            keep = [[i] for i in range(3 * gc.get_threshold()[0])]
            return real(self, read)
        finally:
            del keep
            inside[0] = False

    def seen(phase, info):
        if phase == "start" and inside[0]:
            during.append(info["generation"])

    monkeypatch.setattr(_capture.Watcher, "_finish", finish)
    gc.callbacks.append(seen)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            try:
                train(torch.float16, steps=3, boom_step=1, watch=watcher(tmp_path / f"t{enabled}.jsonl"))
                close_all()
                assert gc.isenabled() == enabled
            finally:
                gc.enable()
    finally:
        gc.callbacks.remove(seen)
    assert during == []
    assert len(read(tmp_path / "tTrue.jsonl")) == len(read(tmp_path / "tFalse.jsonl")) == 5


def test_disabled_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPROBE_DISABLE", "1")
    path = tmp_path / "t.jsonl"
    assert amprobe_torch.watch(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=1), None, trace=str(path)) is None
    assert not path.exists()


def test_an_error_inside_the_companion_stops_capture_not_training(tmp_path, monkeypatch, capsys):
    calls = {"n": 0}
    real = _stats.full

    def broken(t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("planted")
        return real(t)

    monkeypatch.setattr(_stats, "full", broken)
    plain = train(torch.float16, steps=3)
    seen = train(torch.float16, steps=3, watch=watcher(tmp_path / "t.jsonl"))
    close_all()
    for n in plain[2]:
        assert torch.equal(plain[2][n], seen[2][n])
    err = capsys.readouterr().err
    assert err.count("capture stopped") == 1 and "planted" in err


def test_a_killed_run_keeps_every_finished_step(tmp_path):
    path = tmp_path / "t.jsonl"
    code = f"""
import os, sys, torch
sys.path[:0] = [{os.path.join(HERE, '..')!r}, {HERE!r}]
import amprobe_torch, scripts
def kill_after(model, opt, scaler):
    amprobe_torch.watch(model, opt, scaler, trace={str(path)!r})
    upd = scaler.update
    n = [0]
    def update(*a, **k):
        upd(*a, **k)
        n[0] += 1
        if n[0] == 3:
            os._exit(9)
    scaler.update = update
scripts.train(torch.float16, steps=5, watch=kill_after)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    recs = read(path)
    assert [r["type"] for r in recs] == ["header", "step", "step", "step"]
    out = subprocess.run([amprobe_bin(), "report", str(path), "--out", str(tmp_path / "r")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_amprobe_run_runs_the_script_and_gates_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        f"""
import sys, torch
sys.path[:0] = [{os.path.join(HERE, '..')!r}, {HERE!r}]
import amprobe_torch, scripts
scripts.train(torch.float16, steps=4, boom_step=2, watch=amprobe_torch.watch)
"""
    )
    trace = tmp_path / "captured.jsonl"
    summary = tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary),
           "--fail-on", "nonfinite", "--", sys.executable, str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verdict: forward-nonfinite" in r.stdout
    assert "first Inf: step 2 forward" in r.stdout and "embed" in r.stdout
    assert "skipped steps: 1 of 4" in r.stdout
    s = json.loads(summary.read_text())
    assert s["verdict"] == "forward-nonfinite" and s["first_inf"]["module"] == "embed"
    assert s["precision"] == "fp16" and s["skipped_steps"] == 1
    # A clean script passes the gate; one that writes no trace is an error that says why.
    script.write_text(script.read_text().replace("boom_step=2", "boom_step=None"))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "verdict: clean" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([amprobe_bin(), "run", "--", sys.executable, "-c", "pass"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "wrote no trace" in r.stderr and "amprobe_torch.watch" in r.stderr


def test_parameters_the_update_made_nan_are_a_diverged_run(tmp_path):
    # A fused AdamW update (one op that writes every parameter and returns nothing) at a
    # learning rate of 3e38 overflows at step 2; the next step's gradients are NaN and so
    # are the parameters after it, all of them: their largest |p| over non-NaN values is
    # 0, and the NaN count after the step says what it hides. The run diverged, and the
    # update is the origin.
    script = tmp_path / "train.py"
    script.write_text(
        f"""
import sys, torch
sys.path[:0] = [{os.path.join(HERE, '..')!r}]
import amprobe_torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
amprobe_torch.watch(m, opt, None)
for s in range(4):
    opt.param_groups[0]["lr"] = 3e38 if s == 2 else 1e-3
    opt.zero_grad()
    m(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
"""
    )
    trace, summary = tmp_path / "t.jsonl", tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary), "--", sys.executable, str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "verdict: diverged" in r.stdout, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["verdict"] == "diverged"
    assert (s["first_inf"]["phase"], s["first_inf"]["op"], s["first_inf"]["step"]) == ("optimizer", "_fused_adamw_", 2)
    last = read(trace)[4]["params"]
    assert all(p["param_nan_after"] == p["numel"] and p["param_max_abs_after"] == 0.0 for p in last), last


def test_views_share_statistics_and_in_place_ops_do_not(tmp_path):
    # A transpose moves values (its statistics are its input's); an in-place add changes
    # them in the same storage (its statistics are its own).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    x = model(torch.ones(2, 4))
    y = x.t()
    y.add_(1000.0)
    y.sum().backward()
    opt.step()
    close_all()
    ops = read(tmp_path / "t.jsonl")[1]["ops"]
    by = {r["op"]: r for r in ops if r["phase"] == "forward"}
    assert by["t"]["stats"] == by["addmm"]["stats"]
    assert by["add_"]["stats"]["max_abs"] > 900 > by["addmm"]["stats"]["max_abs"]
    assert w is not None


def test_a_copy_shares_its_inputs_statistics_only_when_it_holds_the_same_values(tmp_path):
    # Values in fp16's subnormal range: a clone and a bf16 -> f32 cast hold the input's
    # values with the same subnormals, so their records are the input's; an fp16 -> f32
    # cast holds the same values but none is subnormal in f32, and a narrowing cast rounds.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            a = x * self.w
            f16 = a.half()
            b16 = a.bfloat16()
            return (f16.float() + b16.float().clone()).sum()

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    x = torch.tensor([1.0e-6, 3.0e-5, 0.5, 70000.0, 1.0 + 2.0**-12])
    model(x).backward()
    opt.step()
    close_all()
    ops = [r for r in read(tmp_path / "t.jsonl")[1]["ops"] if r["phase"] == "forward"]
    casts = [r for r in ops if r["op"] == "_to_copy"]
    (clone,) = [r for r in ops if r["op"] == "clone"]
    to_f16, to_bf16, f16_to_f32, bf16_to_f32 = (
        next(r for r in casts if (r["inputs"][0]["dtype"], r["output"]["dtype"]) == pair)
        for pair in (("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32"))
    )
    assert to_f16["stats"]["subnormal"] == 2 and to_f16["stats"]["pos_inf"] == 1
    assert f16_to_f32["stats"]["subnormal"] == 0 and f16_to_f32["stats"]["pos_inf"] == 1
    assert to_bf16["stats"]["max_abs"] == 70144.0
    assert bf16_to_f32["stats"] == to_bf16["stats"] == clone["stats"]


def test_a_step_checked_by_ops_counts_what_full_statistics_count(tmp_path):
    # A step checked op by op reads only NaN/Inf counts, and skips reading outputs of ops
    # that cannot make a non-finite value from finite inputs; its failing step's counts must
    # be those that full statistics of every op give.
    full, fast = tmp_path / "full.jsonl", tmp_path / "fast.jsonl"
    train(torch.float16, steps=4, boom_step=2, watch=watcher(full, sample_every=1))
    close_all()
    train(torch.float16, steps=4, boom_step=2, watch=watcher(fast, check="ops"))
    close_all()
    a, b = read(full)[3], read(fast)[3]
    assert a["step"] == b["step"] == 2 and a["skipped"] and b["skipped"]
    assert len(a["ops"]) == len(b["ops"])
    nonfinite = 0
    for x, y in zip(a["ops"], b["ops"]):
        assert (x["op"], x["module"], x["phase"]) == (y["op"], y["module"], y["phase"])
        counts = [(r["stats"]["nan"], r["stats"]["pos_inf"], r["stats"]["neg_inf"]) for r in (x, y)]
        assert counts[0] == counts[1], (x["op"], x["module"], x["phase"])
        nonfinite += sum(counts[0]) > 0
    assert nonfinite > 10
    assert a["origins"] == b["origins"]


@pytest.mark.parametrize("check", ["modules", "ops"])
def test_the_device_path_finds_what_the_host_path_finds(tmp_path, monkeypatch, check):
    # A device's checks, module flags and full vectors stay on it until the step's read
    # back: run here through that path (on the CPU), the trace's origins, skips, scales
    # and every op's NaN/Inf counts are those of the host path.
    host, dev = tmp_path / "host.jsonl", tmp_path / "device.jsonl"
    train(torch.float16, steps=4, boom_step=2, watch=watcher(host, check=check))
    close_all()
    monkeypatch.setattr(_stats, "check", lambda t: _stats.device_check(_stats.local(t).detach()))
    monkeypatch.setattr(_stats, "full", lambda t: _stats._full_device(_stats.local(t)))
    monkeypatch.setattr(_stats, "nonfinite_flag", lambda ts: _stats.device_flag([_stats.local(t).detach() for t in ts]))
    from amprobe_torch import _recorder

    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", True)
    monkeypatch.setattr(_recorder, "BATCHED_INPUTS", 2)
    train(torch.float16, steps=4, boom_step=2, watch=watcher(dev, check=check))
    close_all()
    a, b = read(host), read(dev)
    assert len(a) == len(b) == 6
    for x, y in zip(a[1:5], b[1:5]):
        assert x["origins"] == y["origins"]
        assert (x["skipped"], x["scale_before"], x["scale_after"]) == (y["skipped"], y["scale_before"], y["scale_after"])
        # The device path's norms accumulate in f64, the host's in f32: the rest is exact.
        for p, q in zip(x["params"], y["params"]):
            assert p["grad_l2"] == pytest.approx(q["grad_l2"], rel=1e-6)
            assert {**p, "grad_l2": 0} == {**q, "grad_l2": 0}
        assert (x["ops"] is None) == (y["ops"] is None)
        for p, q in zip(x["ops"] or [], y["ops"] or []):
            assert (p["op"], p["module"], p["phase"]) == (q["op"], q["module"], q["phase"])
            counts = [(r["stats"]["numel"], r["stats"]["nan"], r["stats"]["pos_inf"], r["stats"]["neg_inf"]) for r in (p, q)]
            if check == "ops" and y["step"] > 0 and p["op"].startswith(("_foreach", "_amp_foreach")):
                # A multi-tensor op's check on a device, in a step whose records are not kept
                # (checked by ops, a device's step has no records in full, failing or not),
                # says whether a NaN is there, and whether an infinity is where none is.
                (n, nan, pos, neg), (m, dnan, dinf, dneg) = counts
                assert (m, dnan, dinf, dneg) == (n, int(nan > 0), int(pos + neg > 0 and nan == 0), 0), p["op"]
            else:
                assert counts[0] == counts[1], (p["op"], p["module"], p["phase"])
    assert a[3]["origins"]["first_inf"] is not None
    # The first step is kept: its full statistics agree field by field (Σx² of an f32
    # tensor accumulates in f32 on the host, in f64 on a device).
    for p, q in zip(a[1]["ops"], b[1]["ops"]):
        assert p["stats"]["sum_sq"] == pytest.approx(q["stats"]["sum_sq"], rel=1e-6)
        assert {**p["stats"], "sum_sq": 0} == {**q["stats"], "sum_sq": 0}, (p["op"], p["module"])
    assert len(a[1]["ops"]) == len(b[1]["ops"])


def test_a_constant_made_from_integers_is_no_origin(tmp_path):
    # T5's position buckets: log of an integer arange made float has log(0) = -inf, a
    # constant of the model, not an overflow of the batch or the parameters.
    class Buckets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            pos = torch.arange(4)
            bucket = torch.log(pos.float()).clamp(min=-1.0)
            return self.lin(x) + bucket

    model = Buckets()
    with torch.no_grad():
        model.lin.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [torch.ones(2, 4), torch.full((2, 4), 3.0e38)]
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    for x in batches:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    close_all()
    steps = read(tmp_path / "t.jsonl")[1:3]
    log = [r for r in steps[0]["ops"] if r["op"] == "log"]
    assert len(log) == 1 and log[0]["stats"]["neg_inf"] == 1
    assert steps[0]["origins"]["first_inf"] is None
    # An overflow of the batch through the parameters still is one: 4 x 3e38 in f32.
    o = steps[1]["origins"]["first_inf"]
    assert o is not None and (o["module"], o["op"], o["phase"]) == ("lin", "addmm", "forward")


def test_a_view_is_no_origin_of_what_its_memory_held(tmp_path):
    # FSDP2 frees a parameter after the forward and, in the backward, reallocates it (often
    # at the address it had) and views it before the all-gather fills it: the view reads
    # whatever the memory held, NaN included, while its input's record (made when the
    # address held the parameter) says finite. Written here behind the dispatcher, as the
    # reallocation is. A view makes no value: no origin, in any phase.
    buf = torch.ones(2, 4)
    behind = buf.numpy()

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x) + buf

            def hook(g):
                behind[0, 0] = float("nan")
                buf.view(8)
                return g

            y.register_hook(hook)
            return y

    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    close_all()
    step = read(tmp_path / "t.jsonl")[1]
    views = [r for r in step["ops"] if r["op"] == "view" and r["output"]["shape"] == [8]]
    assert len(views) == 1 and views[0]["stats"]["nan"] == 1, views
    assert step["origins"]["first_nan"] is None, step["origins"]


def test_a_failing_step_checked_by_ops_is_recorded_in_full_from_its_first_nonfinite_value(tmp_path):
    # Step 2 is not a kept step: its ops are checked until the planted overflow, and
    # recorded with full statistics from that op on.
    path = tmp_path / "t.jsonl"
    train(torch.float16, steps=4, boom_step=2, watch=watcher(path, check="ops"))
    close_all()
    s = read(path)[3]
    assert s["step"] == 2 and s["skipped"]
    ops = s["ops"]
    first = next(i for i, r in enumerate(ops) if r["index"] == s["origins"]["first_inf"]["op_index"])
    assert first > 0
    assert all(r["stats"]["exp_hist"]["counts"] == [] and r["stats"]["max_abs"] == 0.0 for r in ops[:first])
    origin = ops[first]["stats"]
    assert origin["pos_inf"] + origin["neg_inf"] > 0 and origin["max_abs"] > 0
    assert sum(origin["exp_hist"]["counts"]) > 0
    full = [r for r in ops[first:] if r["stats"]["exp_hist"]["counts"]]
    assert len(full) > len(ops[first:]) // 2


def test_a_batch_drawn_inside_the_step_is_the_batch(tmp_path):
    # A script that draws its batch with torch ops after the previous step's update: the
    # values are data, not constants of the model, so their own overflow is an origin.
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    for scale in (1.0, 1.0e39):
        opt.zero_grad()
        x = torch.rand(2, 4) * 0.5 + 0.5
        model(x * scale).sum().backward()
        opt.step()
    close_all()
    steps = read(tmp_path / "t.jsonl")[1:3]
    assert steps[0]["origins"]["first_inf"] is None
    o = steps[1]["origins"]["first_inf"]
    assert o is not None and (o["phase"], o["module"], o["op"]) == ("forward", "", "mul"), o


def test_a_devices_statistics_need_no_histc_under_deterministic_algorithms(tmp_path, monkeypatch, capsys):
    # On a GPU, torch.histc refuses to run once a script turns on
    # torch.use_deterministic_algorithms(True); the device path's exponent histogram is then
    # counted by a sort and a search. Here histc is made to refuse as it does there: the
    # figures are histc's, and a run through the device paths keeps capturing.
    g = torch.Generator().manual_seed(3)
    xs = [
        torch.randn(1000, generator=g) * 1e3,
        (torch.randn(64, 33, generator=g) * 1e-3).to(torch.float16),
        torch.tensor([0.0, -0.0, float("inf"), float("nan"), 2.0**-149, 3.4e38, -1e-40, 1.0]),
        torch.zeros(17, dtype=torch.bfloat16),
        (torch.randn(5000, generator=g, dtype=torch.float64) * 1e200),
    ]
    want = [_stats._full_device(x).tolist() for x in xs]

    def refuses(*args, **kwargs):
        raise RuntimeError("histc_cuda does not have a deterministic implementation")

    plain = train(torch.float16, steps=3, boom_step=1)
    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setattr(torch, "histc", refuses)
    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", True)
    torch.use_deterministic_algorithms(True)
    try:
        got = [_stats._full_device(x).tolist() for x in xs]
        seen = train(torch.float16, steps=3, boom_step=1, watch=watcher(tmp_path / "t.jsonl"))
        close_all()
    finally:
        torch.use_deterministic_algorithms(was)
    assert got == want
    assert "capture stopped" not in capsys.readouterr().err
    assert plain[1] == seen[1]
    for n in plain[2]:
        assert torch.equal(plain[2][n], seen[2][n]), n
    steps = read(tmp_path / "t.jsonl")[1:4]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert sum(sum(r["stats"]["exp_hist"]["counts"]) for r in steps[0]["ops"]) > 0
    assert steps[1]["skipped"] and steps[1]["origins"]["first_inf"] is not None


@pytest.mark.parametrize("device_path", [False, True])
def test_an_update_written_in_place_over_many_tensors_is_recorded_and_can_be_the_origin(
    tmp_path, monkeypatch, device_path
):
    # The multi-tensor ops that write their results into their arguments and return
    # nothing (an optimizer's foreach update, the default on a GPU; the scaler's unscale;
    # the clipping's scaling): one record each over all their tensors, the clipping after
    # the script's own unscale in the optimizer phase. SGD's update overflows f32 at step 2
    # when the learning rate is 3e38: the first Inf is the update's, on the host's checks
    # and on the device's multi-tensor ones (run on the CPU here), in a step whose records
    # are not kept.
    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", device_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    for step in range(3):
        opt.param_groups[0]["lr"] = 3e38 if step == 2 else 0.1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.ones(2, 4)).float().sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        scaler.step(opt)
        scaler.update()
    close_all()
    steps = read(tmp_path / "t.jsonl")[1:4]
    kept = {r["op"]: r for r in steps[0]["ops"] if r["phase"] == "optimizer"}
    for name in ("_amp_foreach_non_finite_check_and_unscale_", "_foreach_mul_", "_foreach_add_"):
        r = kept[name]
        assert r["output"]["shape"] == [20] and r["stats"]["numel"] == 20, r
        assert r["stats"]["max_abs"] > 0 and r["stats"]["exp_hist"]["counts"], r
    assert "_foreach_norm" in kept and all(r["phase"] != "forward" for r in steps[0]["ops"][-12:])
    assert steps[0]["origins"]["first_inf"] is None and steps[1]["origins"]["first_inf"] is None
    o = steps[2]["origins"]["first_inf"]
    assert o is not None and (o["phase"], o["op"]) == ("optimizer", "_foreach_add_"), o
    assert steps[2]["origins"]["first_nan"] is None


@pytest.mark.parametrize("check", ["modules", "ops"])
def test_gradient_clipping_is_the_optimizer_phase_without_a_scaler(tmp_path, check):
    # bf16 without a scaler: nothing but the clipping marks where the optimizer phase
    # begins. torch.nn.utils' clipping runs in it, in a kept step and in the steps after;
    # the clipped gradients are those of the same script without the capture.
    def run(watch):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if watch is not None:
            watch(model, opt, None)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(3, 4)).float().pow(2).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.001)
            opt.step()
        close_all()
        return [p.detach().clone() for p in model.parameters()]

    plain = run(None)
    seen = run(watcher(tmp_path / "t.jsonl", sample_every=2, check=check))
    assert all(torch.equal(a, b) for a, b in zip(plain, seen))
    steps = read(tmp_path / "t.jsonl")[1:4]
    for st in (steps[0], steps[2]):
        clip = [r for r in st["ops"] if r["op"] in ("_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "clamp_")]
        assert clip and all(r["phase"] == "optimizer" for r in clip), [(r["op"], r["phase"]) for r in clip]
        assert all(r["phase"] != "forward" for r in st["ops"] if r["op"] == "_foreach_mul_")


@pytest.mark.parametrize("dtype,mode", [(torch.float16, "half"), (torch.bfloat16, "bfloat16-pure"), (torch.float32, "fp32")])
def test_a_model_made_16_bit_without_autocast_is_amprobes_pure_mode(tmp_path, dtype, mode):
    # `model.half()` / `model.bfloat16()` trains in 16 bits throughout: the header says so
    # (amprobe's own names for those modes), not fp32 because no autocast ran.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    opt.zero_grad()
    model(torch.ones(2, 4, dtype=dtype)).float().sum().backward()
    opt.step()
    close_all()
    header = read(tmp_path / "t.jsonl")[0]
    assert (header["precision"], header["autocast_dtype"]) == (mode, None)


def accumulate(dtype, watch=None, boom=None, steps=3, micro=2):
    """Net trained with `micro` backwards a step (gradient accumulation) under CPU autocast
    and a GradScaler; at `boom` = (step, micro-batch) the input overflows fp16. Returns the
    micro-batches' losses, the scales and the final parameters."""
    from scripts import Net

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    if watch is not None:
        watch(model, opt, scaler)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, micro, 12, 8, generator=g)
    ys = torch.randint(0, 5, (steps, micro, 12), generator=g)
    losses, scales = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            x = xs[s, m] * (3.0e4 if (s, m) == boom else 1.0)
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x).float(), ys[s, m]) / micro
            scaler.scale(loss).backward()
            losses.append(loss.detach().clone())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return losses, scales, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_is_one_step_of_several_micro_batches(tmp_path):
    path = tmp_path / "t.jsonl"
    plain = accumulate(torch.float16, boom=(1, 1))
    seen = accumulate(torch.float16, boom=(1, 1), watch=watcher(path, sample_every=1))
    close_all()
    assert_same_training(plain, seen)
    steps = [r for r in read(path) if r["type"] == "step"]
    assert [s["micro_batches"] for s in steps] == [2, 2, 2]
    assert [s["skipped"] for s in steps] == [False, True, False]
    # The step's loss is the objective whose gradient it applies: the sum of its
    # micro-batches' backward roots (each already divided by 2 here: their mean).
    want = float(plain[0][0]) + float(plain[0][1])
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-6)
    # Ops carry their micro-batch; the overflow is in the second one of step 1.
    micros = {r["micro"] for r in steps[0]["ops"]}
    assert micros == {0, 1}
    o = steps[1]["origins"]["first_inf"]
    assert (o["step"], o["micro"], o["phase"], o["module"]) == (1, 1, "forward", "embed")
    first_backward = next(r for r in steps[0]["ops"] if r["phase"] == "backward")
    assert first_backward["micro"] == 0
    last_forward = [r for r in steps[0]["ops"] if r["phase"] == "forward"][-1]
    assert last_forward["micro"] == 1


def test_a_multi_tensor_ops_inputs_checked_together_keep_its_origins(tmp_path, monkeypatch):
    # Adam without a scaler meets +inf gradients (no NaN among them) and makes NaN
    # parameters: its op is the first NaN. On a device the optimizer's inputs are checked
    # together (a NaN exactly, an Inf where one may be): the origins must not move.
    from amprobe_torch import _recorder

    def run(path):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        amprobe_torch.watch(model, opt, None, trace=str(path))
        for k in (1.0, 1.0e39, 1.0):
            opt.zero_grad()
            (model(torch.ones(3, 4)).sum() * k).backward()
            opt.step()
        close_all()
        return [r for r in read(path) if r["type"] == "step"]

    host = run(tmp_path / "host.jsonl")
    o = host[1]["origins"]
    assert o["first_nan"]["phase"] == "optimizer" and o["first_inf"]["phase"] == "forward", o
    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", True)
    monkeypatch.setattr(_recorder, "BATCHED_INPUTS", 2)
    monkeypatch.setattr(_stats, "check", lambda t: _stats.device_check(_stats.local(t).detach()))
    dev = run(tmp_path / "dev.jsonl")
    assert [s["origins"] for s in dev] == [s["origins"] for s in host]


def test_what_watch_is_given_is_checked_and_named(tmp_path):
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = str(tmp_path / "t.jsonl")
    with pytest.raises(TypeError, match="torch.nn.Module, or a dict or list of them, not str"):
        amprobe_torch.watch("model", opt, trace=path)
    with pytest.raises(TypeError, match=r"model\['b'\] is a int"):
        amprobe_torch.watch({"a": m, "b": 3}, opt, trace=path)
    with pytest.raises(ValueError, match="without dots, not 'a.b'"):
        amprobe_torch.watch({"a.b": m}, opt, trace=path)
    with pytest.raises(ValueError, match="no model given"):
        amprobe_torch.watch([], opt, trace=path)
    with pytest.raises(TypeError, match=r"optimizer\[1\] is a int, not a torch.optim.Optimizer"):
        amprobe_torch.watch(m, [opt, 1], trace=path)
    assert not amprobe_torch._capture._WATCHERS


def train_sparse(dtype, steps=4, watch=None, boom_step=None):
    """An embedding with sparse gradients (SparseAdam) and a dense head (Adam)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 16, sparse=True)
    head = torch.nn.Linear(16, 4)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    o1 = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2)
    o2 = torch.optim.Adam(head.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=dtype == torch.float16)
    if watch is not None:
        watch(model, [o1, o2], scaler)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (steps, 8, 5), generator=g)
    ys = torch.randint(0, 4, (steps, 8), generator=g)
    losses, scales = [], []
    for s in range(steps):
        o1.zero_grad()
        o2.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            h = emb(ids[s]).mean(1) * (1.0e39 if s == boom_step else 1.0)
            loss = torch.nn.functional.cross_entropy(head(h).float(), ys[s])
        scaler.scale(loss).backward()
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_gradients_are_captured(tmp_path, dtype):
    path = tmp_path / "t.jsonl"
    plain = train_sparse(dtype, boom_step=2)
    seen = train_sparse(dtype, boom_step=2, watch=watcher(path))
    close_all()
    # (bitwise: the failing step's update makes NaN parameters in bf16)
    for a, b in zip(plain[0] + list(plain[2].values()), seen[0] + list(seen[2].values())):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert plain[1] == seen[1]
    steps = [r for r in read(path) if r["type"] == "step"]
    assert len(steps) == 4
    emb = [q for q in steps[0]["params"] if q["name"] == "emb.weight"][0]
    # Five ids a row, eight rows: at most 40 of the 100 rows have a gradient.
    assert emb["zero_frac"] >= 0.6 and emb["grad_l2"] > 0 and emb["nonfinite"] == 0
    assert steps[2]["origins"]["first_inf"] is not None


def test_a_compiled_model_runs_eagerly_while_watched_and_compiles_again_after(tmp_path):
    # A dispatch mode sees nothing inside a compiled graph: every step of a watched run is
    # eager (before, the steps checked by modules ran compiled and trained otherwise).
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(1)
        return gm.forward

    def run(watch):
        torch._dynamo.reset()
        model, opt, scaler, data = train_setup()
        cm = torch.compile(model, backend=backend)
        if watch:
            w = amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
        losses = []
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(cm(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach().clone())
        if watch:
            w.close()
            _capture._WATCHERS.clear()
        return losses, [p.detach().clone() for p in model.parameters()]

    def train_setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        g = torch.Generator().manual_seed(1)
        return model, opt, scaler, [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(4)]

    from amprobe_torch import _capture

    with torch.compiler.set_stance("force_eager"):
        eager = run(False)
    assert not compiled
    watched = run(True)
    assert not compiled
    for a, b in zip(eager[0] + eager[1], watched[0] + watched[1]):
        assert torch.equal(a, b)
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    assert len(steps) == 4 and steps[0]["ops"]
    # Closed, compiling is back.
    run(False)
    assert compiled


def test_watch_called_again_goes_on_and_a_second_watch_of_a_model_or_trace_is_refused(tmp_path, capsys):
    path = tmp_path / "t.jsonl"

    def every_epoch(model, opt, scaler):
        # A script that calls watch in its epoch loop: once a step here.
        orig = opt.zero_grad

        def zero_grad(*a, **k):
            amprobe_torch.watch(model, opt, scaler, trace=str(path))
            return orig(*a, **k)

        opt.zero_grad = zero_grad

    plain = train(torch.float16, steps=4, boom_step=2)
    seen = train(torch.float16, steps=4, boom_step=2, watch=every_epoch)
    close_all()
    assert_same_training(plain, seen)
    steps = [r for r in read(path) if r["type"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[2]["origins"]["first_inf"] is not None
    assert capsys.readouterr().err.count("called again") == 1

    m, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = amprobe_torch.watch(m, opt, trace=str(tmp_path / "a.jsonl"))
    with pytest.raises(ValueError, match="already watched with other models, optimizers or scaler"):
        amprobe_torch.watch(m, torch.optim.SGD(m.parameters(), lr=0.1), trace=str(tmp_path / "b.jsonl"))
    with pytest.raises(ValueError, match="already writes the trace"):
        amprobe_torch.watch(other, torch.optim.SGD(other.parameters(), lr=0.1), trace=str(tmp_path / "a.jsonl"))
    w2 = amprobe_torch.watch(other, torch.optim.SGD(other.parameters(), lr=0.1), trace=str(tmp_path / "c.jsonl"))
    assert w2 is not w and amprobe_torch.watch(m, opt, trace=str(tmp_path / "a.jsonl")) is w
    close_all()


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("made", ["before", "after"])
def test_an_lr_scheduler_made_before_or_after_watch_runs_as_without_it(tmp_path, scaled, made):
    # A scheduler wraps the optimizer's step through its `__func__`: made after `watch`, it
    # raised on the watcher's wrapper, a plain function.
    def run(path):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        if made == "before":
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        if path is not None:
            amprobe_torch.watch(model, opt, scaler, trace=str(path))
        if made == "after":
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4, generator=g)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        return [p.detach().clone() for p in model.parameters()]

    import warnings

    with warnings.catch_warnings():
        # (that the scheduler stepped before the optimizer: it did not)
        warnings.simplefilter("error", UserWarning)
        plain = run(None)
        seen = run(tmp_path / "t.jsonl")
    close_all()
    assert all(torch.equal(a, b) for a, b in zip(plain, seen))
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    assert [s["lr"] for s in steps] == [0.1, 0.05, 0.025]


def test_torch_autograd_backward_takes_any_iterable_and_gradient_edges(tmp_path):
    from torch.autograd.graph import get_gradient_edge

    def run(watched):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if watched:
            amprobe_torch.watch(m, opt, None, trace=str(tmp_path / "t.jsonl"))
        x = torch.randn(3, 4)
        for s in range(3):
            opt.zero_grad()
            a = m(x).pow(2).mean()
            if s == 0:
                # A generator, read once: the step's loss is the sum of its roots.
                torch.autograd.backward(r for r in [a, a * 2])
            else:
                # A gradient edge beside a loss: its seed is autograd's to make (in the
                # steps checked by modules too).
                torch.autograd.backward([a, get_gradient_edge(m(x).sum())])
            opt.step()
        close_all()
        return [p.detach().clone() for p in m.parameters()]

    plain, seen = run(False), run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain, seen))
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    assert len(steps) == 3 and all(s["loss"] is not None for s in steps)


def test_a_watched_model_can_be_copied_and_saved_whole(tmp_path):
    # An EMA model made by copy.deepcopy, a model saved by torch.save: their hooks held the
    # watcher, which neither copies nor pickles. The copy is not watched.
    import copy
    import io

    model, opt = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "t.jsonl"
    amprobe_torch.watch(model, opt, None, trace=str(path))
    ema = copy.deepcopy(model)
    x = torch.randn(3, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            ema(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    close_all()
    assert torch.equal(loaded(x), model(x))
    steps = [r for r in read(path) if r["type"] == "step"]
    assert len(steps) == 2
    from amprobe_torch._hooks import ModuleHook

    for m in (ema, loaded):
        hooks = [h for sub in m.modules() for h in (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values())]
        assert hooks and all(isinstance(h, ModuleHook) and h.f is None for h in hooks)


def test_a_watched_scaler_can_be_saved_whole_and_copied(tmp_path):
    # torch.save(scaler) of the whole object raised (its wrapped methods were closures); a
    # deep copy's methods were the closures themselves, still updating the original scaler
    # and writing its steps to the trace. A copy is a scaler of its own, not watched.
    import copy
    import io

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    path = tmp_path / "t.jsonl"
    amprobe_torch.watch(model, opt, scaler, trace=str(path))
    x = torch.randn(3, 4)

    def step(sc, new_scale=None):
        opt.zero_grad()
        sc.scale(model(x).pow(2).mean()).backward()
        sc.step(opt)
        sc.update(new_scale)

    step(scaler)
    buf = io.BytesIO()
    torch.save(scaler, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(scaler)
    for other in (loaded, twin):
        step(other, 512.0)
        assert other.get_scale() == 512.0
    assert scaler.get_scale() == 1024.0
    close_all()
    # (the copies' steps ran the optimizer, not the watched scaler: not steps of the trace)
    steps = [r for r in read(path) if r["type"] == "step"]
    assert len(steps) == 1 and steps[0]["scale_before"] == 1024.0


def test_a_stance_dynamo_refuses_does_not_stop_the_script(tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise RuntimeError("not here")

    monkeypatch.setattr(torch.compiler, "set_stance", refuse)
    m = torch.nn.Linear(2, 1)
    w = amprobe_torch.watch(m, torch.optim.SGD(m.parameters(), lr=0.1), trace=str(tmp_path / "t.jsonl"))
    assert w is not None and not w.eager
    close_all()
    assert "could not make torch.compile run eagerly" in capsys.readouterr().err


def test_a_step_checked_by_modules_reads_back_once_where_it_decides_and_once_where_it_ends(tmp_path, monkeypatch):
    # On a GPU every read back waits for the device's queue to drain, and the host's work
    # after it then runs with the device idle. A step checked by modules reads twice: where
    # it enters the optimizer phase (does it replay?) and where it ends (its figures); the
    # scaler reads its own found-inf once. The device paths run here on the CPU, where a
    # read is a call that brings a tensor's values to Python.
    monkeypatch.setattr(_stats, "DEVICE_PATH_ON_CPU", True)
    reads = []
    counting = [False]

    def counted(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            out = orig(self, *a, **k)
            if counting[0] and not getattr(self, "_amprobe_test_host", False):
                reads.append(name)
                if isinstance(out, torch.Tensor):
                    out._amprobe_test_host = True  # its tolist is the same read
            return out

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        counted(name)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 32)  # rows no batch uses: zero gradients, flush counts needed
    model = torch.nn.Sequential(emb, torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 100))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    amprobe_torch.watch(model, opt, scaler, trace=str(tmp_path / "t.jsonl"))
    x = torch.randint(0, 100, (4, 16))
    y = torch.randint(0, 100, (4, 16))
    per_step = []
    for step in range(5):
        reads.clear()
        counting[0] = True
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            h = model(x)
            loss = torch.nn.functional.cross_entropy(h.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        counting[0] = False
        per_step.append(len(reads))
    close_all()
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    assert len(steps) == 5 and not any(s["skipped"] for s in steps)
    assert steps[1]["ops"] is None  # checked by modules, not kept
    # The embedding's flush counts were needed (its zeros): from the second light step on
    # they are begun before the read, not read after it.
    assert steps[-1]["params"][0]["zero_frac"] > 0
    assert per_step[2:] == [3, 3, 3], per_step


def test_several_losses_of_one_forward_are_one_micro_batch(tmp_path):
    # loss1.backward(retain_graph=True); loss2.backward(): two backwards, one micro-batch,
    # whose loss is the sum (the gradients are the sum's). They were counted as two
    # micro-batches with the mean of the two as the step's loss. A failing step's origin is
    # the same checked by modules as with full statistics.
    def run(path, sample_every):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        amprobe_torch.watch(m, opt, sc, trace=str(path), sample_every=sample_every)
        x = torch.randn(4, 8)
        totals = []
        for step in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
                l1 = out.float().pow(2).mean()
                l2 = out.float().abs().mean() * (1e6 if step == 2 else 1.0)
            totals.append((l1 + l2).item())
            sc.scale(l1).backward(retain_graph=True)
            sc.scale(l2).backward()
            sc.step(opt)
            sc.update()
        close_all()
        return totals, [r for r in read(path) if r["type"] == "step"]

    totals, light = run(tmp_path / "light.jsonl", 0)
    _, full = run(tmp_path / "full.jsonl", 1)
    assert [s["micro_batches"] for s in light] == [1, 1, 1, 1]
    for s, t in zip(light, totals):
        assert s["loss"] == pytest.approx(t, rel=1e-6)
    assert light[2]["skipped"] and light[2]["origins"]["first_inf"] is not None
    for a, b in zip(light, full):
        # (where: the op indices differ, the model's backward ops of a step checked by
        # modules being its replay's, which runs one backward for the two)
        for k in ("first_inf", "first_nan"):
            x, y = a["origins"][k], b["origins"][k]
            assert (x is None) == (y is None)
            if x is not None:
                assert (x["module"], x["op"], x["phase"], x["micro"]) == (y["module"], y["op"], y["phase"], y["micro"])
        assert a["loss"] == b["loss"]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_parameters_check_is_carried_to_the_next_step_until_something_writes_it(tmp_path, monkeypatch, kind):
    # The values an update wrote are the next step's inputs of the update (and of any op of
    # the script's that reads the parameter): their check is carried over, not taken again,
    # until the parameter is written: by an op the step sees (a slice of its `.data`: the
    # same storage, its own version counter), or by one it does not (inside the model's
    # forward, which a step checked by modules runs unseen: the version counter moves).
    from amprobe_torch import _capture

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 1)
            self.poison = False

        def forward(self, x):
            y = self.b(torch.relu(self.a(x)))
            if self.poison:
                with torch.no_grad():
                    self.a.weight[0, 0] = float("nan")  # after its use: the output is finite
            return y

    torch.manual_seed(0)
    m = M()
    if kind == "sgd":
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    w = amprobe_torch.watch(m, opt, None, trace=str(tmp_path / "t.jsonl"))
    # Checks taken because none was carried (an optimizer's state is carried as its
    # parameters are).
    taken = []
    remember = w.carried.remember

    def counting_remember(k, t, v, written=False):
        if not written:
            taken.append(t.numel())
        return remember(k, t, v, written)

    w.carried.remember = counting_remember
    checked = []
    check = _stats.check

    def counting(t):
        checked.append(t.numel())
        return check(t)

    monkeypatch.setattr(_stats, "check", counting)
    weight = m.a.weight
    k = _capture._key(weight)

    def step(poison=False):
        m.poison = poison
        opt.zero_grad()
        m(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()

    try:
        for _ in range(3):
            step()
        assert w.carried.checks[k][0] == weight._version and w.carried.checks[k][1][1:] == [0.0, 0.0, 0.0]
        checked.clear()
        taken.clear()
        step()
        assert taken == []
        if kind == "sgd":
            # The gradients' checks where the step decides, the update's outputs: no input
            # of the update is a parameter checked again.
            assert 64 * 64 in checked and checked.count(64 * 64) == 2, checked
        weight.data[0, 1] = 0.5  # seen: the check is dropped
        assert k not in w.carried.checks
        step()
        assert k in w.carried.checks
        step(poison=True)  # unseen: the update reads the NaN, and says so
        step()
    finally:
        close_all()
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    # The update only passed on the NaN its input held: no origin in the step it was
    # written, and the parameter after it holds one.
    poisoned = steps[5]
    assert poisoned["origins"]["first_nan"] is None
    assert [p["param_nan_after"] for p in poisoned["params"] if p["name"] == "a.weight"] == [1]


def test_an_optimizer_like_wrapper_without_a_state_is_watched(tmp_path, capsys):
    # A wrapper with `step`, `zero_grad` and `param_groups` (as training frameworks wrap an
    # optimizer) but no `state` of its own: its steps are the steps, nothing is carried
    # from a state it does not show, and nothing stops the capture.
    class Wrapper:
        def __init__(self, inner):
            self.inner = inner
            self.param_groups = inner.param_groups

        def step(self, closure=None):
            return self.inner.step(closure)

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none=set_to_none)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = Wrapper(torch.optim.AdamW(model.parameters(), lr=1e-3))
    amprobe_torch.watch(model, opt, None, trace=str(tmp_path / "t.jsonl"))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    close_all()
    steps = [r for r in read(tmp_path / "t.jsonl") if r["type"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert "capture stopped" not in capsys.readouterr().err
