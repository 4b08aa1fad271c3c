"""`amprobe run -- torchrun ...`: a data-parallel script (DDP, FSDP) on two ranks (gloo, CPU),
with an overflow planted in rank 1's batch only, is summarized from the two rank traces: the
first Inf is rank 1's, made there, at the planted step, op and module; rank 0 did not make
one; the ranks agreed on found_inf."""

import json
import os
import subprocess
import sys

import pytest
import torch

from test_watch import amprobe_bin

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ddp_train.py")

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is needed",
)


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args]


@pytest.mark.parametrize(
    "wrap,watched",
    [("ddp", "wrapper"), ("ddp", "model"), ("fsdp", "wrapper"), ("fsdp2", "model")],
)
def test_the_rank_that_made_the_overflow_is_named(tmp_path, wrap, watched):
    trace = tmp_path / "t.jsonl"
    summary = tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary),
           "--fail-on", "nonfinite", "--", *torchrun("--wrap", wrap, "--watch", watched, "--steps", "4")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    # One trace per rank, next to the path given; none at the path itself.
    assert (tmp_path / "t.rank0.jsonl").exists() and (tmp_path / "t.rank1.jsonl").exists()
    assert not trace.exists()
    s = json.loads(summary.read_text())
    ranks = s["ranks"]
    assert ranks["world_size"] == 2
    inf = ranks["first_inf"]
    # The input, scaled by 3e4 on rank 1 at step 2, overflows where the first linear
    # casts it to fp16; names are the model's own, whichever of DDP and model was watched.
    assert inf["rank"] == 1 and not inf["received"], inf
    assert inf["op"]["step"] == 2 and inf["op"]["phase"] == "forward"
    assert inf["op"]["op"] == "_to_copy" and inf["op"]["module"] == "embed"
    assert s["first_inf"] == inf["op"] and s["verdict"] == "forward-nonfinite"
    # Rank 0 made nothing: what reached it came through a collective (DDP's all-reduce of
    # the gradients, FSDP's reduce-scatter).
    r0 = next(f for f in ranks["ranks"] if f["rank"] == 0)
    for o in (r0["first_inf"], r0["first_nan"]):
        assert o is None or (o["received"] and o["collectives_before"] >= 1), r0
    assert r0["verdict"] == "overflow-skips"
    f = ranks["first_failure"]
    assert f["step"] == 2 and f["made_by"] == [1]
    assert f["received_by"] in ([], [0])
    # The collective spread the non-finite gradient to both ranks (FSDP's scaler all-reduces
    # found_inf too): both skipped step 2.
    assert ranks["found_inf_agreed"] is True
    assert ranks["found_inf"] == [{"step": 2, "found": [0, 1], "not_found": [], "missing": [], "agreed": True}]
    assert "first Inf: rank 1, step 2 forward op #" in out
    assert "`_to_copy` in `embed`, made on rank 1" in out
    assert "found_inf: the ranks agreed at every step (all found an Inf or NaN at step(s) 2)" in out
    # The summary's own first Inf line (under the verdict) names the rank it was made on.
    lines = out.splitlines()
    v = lines.index("verdict: forward-nonfinite")
    assert lines[v + 1].startswith("  first Inf: rank 1, step 2 forward op #"), lines[v : v + 3]
    # Each rank's file is a trace of its own that amprobe reads alone.
    rep = subprocess.run([amprobe_bin(), "report", str(tmp_path / "t.rank1.jsonl"), "--out", str(tmp_path / "rep")],
                         capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    assert "verdict: forward-nonfinite" in rep.stdout
