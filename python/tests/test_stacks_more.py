"""More of the stacks people train with, run as `amprobe run -- python SCRIPT` with no
amprobe line in the script, as python/tests/test_stacks.py runs its own: PEFT's LoRA,
timm's ViT under its AMP loop. Each run is held to the same script run by plain `python`
(bitwise the same losses and parameters), to the figures the script reads itself
(clipping's norm, the scaler's scale, the gradients, the frozen weight), and, for a planted
overflow, to plain forward hooks (`stacks/hooks.py`)."""

from test_stacks import captured, close, plain, same, steps


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
