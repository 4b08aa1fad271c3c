#!/usr/bin/env python3
"""Makes a tiny LLaMA checkpoint (LlamaForCausalLM, grouped-query attention) with an fp16
overflow planted at one layer's MLP output (`down_proj`, as large activations in LLaMA's
residual stream do), and records what PyTorch + transformers (CPU) give for it: per-module
forward outputs in fp32 (shape, max |x|, L2 norm), the loss, every parameter's gradient
after one fp32 backward (L2 norm and max |g|), and the first module whose output holds an
Inf / a NaN in fp32, autocast fp16, autocast bf16 and pure fp16.

Needs torch and transformers; CI does not run it. Its outputs are committed under
tests/golden/llama_tiny/ (config.json, model.safetensors, inputs.safetensors,
expected.json).

    python3 scripts/make_llama.py tests/golden/llama_tiny
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gpt2 import fp32_and_fp64_grads, module_trace, scenarios  # noqa: E402

LAYERS, LAYER = 3, 1  # the overflow is planted at layer LAYER's down_proj


def config():
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return cfg


def model_with(state, dtype=torch.float32):
    m = LlamaForCausalLM(config()).eval()
    m.load_state_dict(state)
    return m.to(dtype)


def main(out: Path):
    torch.manual_seed(2025)
    base = LlamaForCausalLM(config()).eval()
    sd = base.state_dict()
    # Modest weights rounded to bf16 (exact in fp16, bf16 and fp32); RMSNorm weights at 1.
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            continue
        sd[k] = (v * (0.5 / v.abs().max())).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(13))
    inputs = {"input_ids": ids, "labels": ids}
    # Plant: scale one output channel of layer LAYER's down_proj so that its output reaches
    # about 1.2e5, past fp16's 65504.
    captured = {}
    mlp = base.model.layers[LAYER].mlp
    hook = mlp.down_proj.register_forward_hook(
        lambda _m, _i, o: captured.setdefault("y", o.detach()))
    with torch.no_grad():
        base(input_ids=ids)
    hook.remove()
    ch = int(captured["y"].abs().amax(dim=(0, 1)).argmax())
    factor = 1.2e5 / float(captured["y"][..., ch].abs().max())
    w = f"model.layers.{LAYER}.mlp.down_proj.weight"
    sd = base.state_dict()
    sd[w][ch] = (sd[w][ch] * factor).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg_dict = config().to_dict()
    cfg_dict["model_type"] = "llama"
    cfg_dict["architectures"] = ["LlamaForCausalLM"]
    cfg_dict.pop("_attn_implementation", None)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    save_file({"input_ids": ids.to(torch.int64)}, str(out / "inputs.safetensors"))

    sc = scenarios(model_with, state, inputs)
    print(json.dumps(sc))
    loss, grads, grads64 = fp32_and_fp64_grads(model_with, state, inputs)
    expected = {
        "about": "transformers LlamaForCausalLM (eager attention, CPU); first module in completion "
                 "order whose first output holds an Inf / a NaN; the fp32 forward module by "
                 "module; the fp32 loss and the gradient of each parameter after one backward.",
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "planted": {"layer": LAYER, "channel": ch, "target_down_proj_max_abs": 1.2e5},
        "fp32_loss": float(loss.detach()),
        "fp32_module_trace": module_trace(model_with(state), {"input_ids": ids}),
        "fp32_grads": grads,
        "fp64_grads": grads64,
        "scenarios": sc,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, allow_nan=False))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/llama_tiny"))
