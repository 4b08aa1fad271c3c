"""Architectures amprobe does not implement natively, captured with an overflow planted
where the test knows its origin (foreign.py): the first Inf and NaN are there, the same
models unplanted run clean, and amprobe reads the traces."""

import subprocess

import pytest

import amprobe_torch
from foreign import train
from test_watch import amprobe_bin, close_all, read


def capture(tmp_path, kind, planted):
    path = tmp_path / f"{kind}-{planted}.jsonl"
    train(kind, watch=lambda m, o, s: amprobe_torch.watch(m, o, s, trace=str(path)), planted=planted)
    close_all()
    return path, [r for r in read(path) if r["type"] == "step"]


def where(o):
    return None if o is None else (o["phase"], o["module"], o["op"])


# kind: (first Inf, first NaN of step 0, whether the step is skipped)
EXPECTED = {
    # The custom norm's own fp16 product overflows; dividing by the infinite energy gives
    # zeros, not NaN: the loss stays finite and the step is not skipped (a silent failure).
    "custom": (("forward", "energy", "mul"), None, False),
    # A convolution passes 65504; the batch norm after it turns the Inf into NaN.
    "resnet": (
        ("forward", "layer2.conv2", "convolution"),
        ("forward", "layer2.bn2", "native_batch_norm"),
        True,
    ),
    # OPT's FFN output passes 65504; the decoder's final layer norm turns it into NaN.
    "opt": (
        ("forward", "model.decoder.layers.1.fc2", "addmm"),
        ("forward", "model.decoder.final_layer_norm", "native_layer_norm"),
        True,
    ),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_a_planted_overflow_is_found_where_it_was_planted(tmp_path, kind):
    first_inf, first_nan, skipped = EXPECTED[kind]
    path, steps = capture(tmp_path, kind, planted=True)
    s = steps[0]
    assert where(s["origins"]["first_inf"]) == first_inf
    assert where(s["origins"]["first_nan"]) == first_nan
    assert s["skipped"] == skipped and s["found_inf"] == skipped
    assert s["scale_after"] == (s["scale_before"] / 2 if skipped else s["scale_before"])
    # The planted module's backward ops are named by it too.
    assert any(r["phase"] == "backward" and r["module"] == first_inf[1] for r in s["ops"])
    r = subprocess.run([amprobe_bin(), "report", str(path), "--out", str(tmp_path / "report")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"`{first_inf[2]}` | `{first_inf[1]}`" in (tmp_path / "report" / "summary.md").read_text()


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_the_same_model_unplanted_runs_clean(tmp_path, kind):
    _, steps = capture(tmp_path, kind, planted=False)
    for s in steps:
        assert s["origins"]["first_inf"] is None and s["origins"]["first_nan"] is None
        assert not s["skipped"]
