"""More of the stacks people train with, run as `amprobe run -- python SCRIPT` (or
`torchrun`) with no amprobe line in the script, as python/tests/test_stacks.py runs its
own: PEFT's LoRA, timm's ViT under its AMP loop, FSDP2's `fully_shard`. Each run is held to
the same script run by plain `python` (bitwise the same losses and parameters), to the
figures the script reads itself (clipping's norm, the scaler's scale, the gradients, the
frozen weight), and, for a planted overflow, to plain forward hooks (`stacks/hooks.py`)."""

import json
import os
import subprocess
import sys

import pytest

from test_stacks import STACKS, captured, close, plain, same, steps
from test_watch import amprobe_bin, read


def test_peft_lora_frozen_base_weight_and_adapters(tmp_path):
    ref = plain(tmp_path, "peft_lora.py", "--planted")
    got, trace, summary, stdout = captured(tmp_path, "peft_lora.py", "--planted")
    same(ref, got)
    h = trace[0]
    assert (h["model"], h["precision"], h["autocast_dtype"]) == ("PeftModelForCausalLM", "bf16", "bfloat16"), h
    d = h["source"]["discovery"]
    assert (d["models"], d["optimizers"], d["scaler"]) == (["PeftModelForCausalLM"], ["AdamW"], None), d
    assert "PeftModelForCausalLM under bf16" in stdout, stdout
    ss = steps(trace)
    assert len(ss) == len(ref["losses"]) == 4
    lora = set(ref["lora"])
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora), lora
    for i, s in enumerate(ss):
        assert s["micro_batches"] == 1 and close(s["loss"], ref["losses"][i]), (s["loss"], ref["losses"][i])
        assert close(s["grad_norm"], ref["grad_norms"][i]), (s["grad_norm"], ref["grad_norms"][i])
        # The PeftModel's own names, in its order.
        names = [p["name"] for p in s["params"]]
        assert names == ref["names"], names
        assert not any("_orig_mod." in n for n in names)
        by = {p["name"]: p for p in s["params"]}
        # The frozen base weight: its real largest |value| (the planted element), no gradient.
        frozen = by[ref["frozen"]]
        assert ref["frozen_max_abs"][i] == 10630.0
        assert frozen["param_max_abs_after"] == ref["frozen_max_abs"][i], frozen
        assert frozen["param_nan_after"] == 0
        assert frozen["grad_l2"] == 0 and frozen["grad_dtype"] is None, frozen
        for n, p in by.items():
            if n in lora:
                # The adapters' gradients, as the script read them before the step.
                assert p["grad_dtype"] == "float32", p
                assert close(p["grad_l2"], ref["lora_grads"][i][n], rel=1e-5), (n, p["grad_l2"], ref["lora_grads"][i][n])
            else:
                assert p["grad_l2"] == 0 and p["grad_dtype"] is None, p
        # lora_B starts at zero, so lora_A's first gradient is zero and lora_B's is not.
        for n in lora:
            assert by[n]["grad_l2"] > 0 or (i == 0 and ".lora_A." in n), (i, n, by[n])
    assert trace[-1]["type"] == "end" and trace[-1]["verdict"] == summary["verdict"] == "clean"


def test_timm_vit_fp16_native_scaler_planted_overflow_and_its_skip(tmp_path):
    ref = plain(tmp_path, "timm_vit.py", "--planted", "--hooks")
    got, trace, summary, stdout = captured(tmp_path, "timm_vit.py", "--planted")
    got["hooks_first"] = ref["hooks_first"]
    same(ref, got)
    h = trace[0]
    assert (h["model"], h["precision"], h["autocast_dtype"]) == ("VisionTransformer", "fp16", "float16"), h
    assert h["scaler"] is not None and h["scaler"]["init_scale"] == 65536.0, h
    d = h["source"]["discovery"]
    assert (d["models"], d["optimizers"], d["scaler"]) == (["VisionTransformer"], ["AdamW"], "GradScaler"), d
    step, module = ref["hooks_first"]
    assert (step, module) == (2, "patch_embed.proj"), ref["hooks_first"]
    first = summary["first_inf"]
    assert (first["step"], first["module"], first["phase"]) == (step, module, "forward"), summary
    ss = steps(trace)
    assert len(ss) == len(ref["losses"]) == 5
    # The scaler's scale before each step, as the script read it; the planted step alone
    # skipped, and the scale halved after it.
    assert [s["scale_before"] for s in ss] == ref["scales"]
    assert ss[-1]["scale_after"] == ref["final_scale"]
    assert [s["skipped"] for s in ss] == [i == step for i in range(len(ss))]
    assert ss[step]["found_inf"] and ss[step + 1]["scale_before"] == ss[step]["scale_before"] / 2
    for i, (s, loss) in enumerate(zip(ss, ref["losses"])):
        # (the trace writes a non-finite float as a string: JSON has none)
        if i == step:
            assert loss != loss and s["loss"] == "NaN", (s["loss"], loss)
        else:
            assert close(s["loss"], loss), (s["loss"], loss)
    names = {p["name"] for p in ss[0]["params"]}
    assert "patch_embed.proj.weight" in names and "blocks.0.attn.qkv.weight" in names, names
    assert trace[-1]["verdict"] == summary["verdict"] == "forward-nonfinite"


def torchrun(out, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(STACKS, "fsdp2_train.py"), str(out), *args]


def rank_results(out):
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["mp", "autocast"])
def test_fsdp2_fully_shard_two_ranks(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(torchrun(tmp_path / "plain", mode), capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ref = rank_results(tmp_path / "plain")
    trace, summary = tmp_path / "t.jsonl", tmp_path / "summary.json"
    cmd = [amprobe_bin(), "run", "--trace", str(trace), "--summary-json", str(summary), "--",
           *torchrun(tmp_path / "captured", mode)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    got = rank_results(tmp_path / "captured")
    for a, b in zip(ref, got):
        same(a, b)
    assert not trace.exists()
    for rank, res in enumerate(ref):
        recs = read(tmp_path / f"t.rank{rank}.jsonl")
        h = recs[0]
        assert h["type"] == "header" and (h["source"]["rank"], h["source"]["world_size"]) == (rank, 2), h
        assert h["precision"] == "bf16" and h["model"] == "MLP", h
        assert h["source"]["discovery"]["optimizers"] == ["AdamW"], h
        ss = steps(recs)
        assert len(ss) == len(res["losses"]) == 4
        for i, s in enumerate(ss):
            assert close(s["loss"], res["losses"][i]), (rank, i, s["loss"], res["losses"][i])
            assert close(s["grad_norm"], res["grad_norms"][i]), (rank, i, s["grad_norm"], res["grad_norms"][i])
            # The model's own names; each rank's figures are of its shard.
            assert [p["name"] for p in s["params"]] == res["names"] == [
                "inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias"]
            # Nothing this small MLP computes comes near 1e6 (its inputs are N(0, 1), its
            # weights below 1, its gradients' norm under 10): an op's figures beyond that
            # were read from memory nothing had written yet.
            big = [(o["phase"], o["op"], o["module"], o["stats"]["max_abs"]) for o in s["ops"] or []
                   if o["stats"]["max_abs"] is not None and o["stats"]["max_abs"] > 1e6]
            assert not big, (rank, i, big)
        assert recs[-1]["type"] == "end" and recs[-1]["verdict"] == "clean", recs[-1]
    s = json.loads(summary.read_text())
    assert s["verdict"] == "clean" and s["first_inf"] is None and s["first_nan"] is None, s
    assert s["ranks"]["world_size"] == 2 and s["ranks"]["found_inf_agreed"] is True, s["ranks"]
    assert [f["verdict"] for f in s["ranks"]["ranks"]] == ["clean", "clean"], s["ranks"]
