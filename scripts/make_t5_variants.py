#!/usr/bin/env python3
"""Makes small T5 encoder checkpoints with a planted fp16 overflow at a chosen block, and
records where PyTorch + transformers (CPU) find the first Inf and NaN, module by module.

Needs torch and transformers; CI does not run it. Its outputs are committed under
tests/golden/t5_variants/<name>/ (config.json, model.safetensors, inputs.safetensors,
expected.json).

    python3 scripts/make_t5_variants.py tests/golden/t5_variants
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import T5Config, T5EncoderModel

VARIANTS = [
    # name, feed_forward_proj, layers, block whose wo output is pushed past 65504
    ("gated_gelu_block1", "gated-gelu", 3, 1),
    ("relu_6_layers_block4", "relu", 6, 4),
]


def first_nonfinite(model, ids, ctx):
    """First module (completion order) with an Inf / a NaN in its first output tensor."""
    hits = {"inf": None, "nan": None}
    handles = []

    def hook(name):
        def f(_m, _i, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(t, "last_hidden_state"):
                t = t.last_hidden_state
            if not torch.is_tensor(t) or not t.is_floating_point():
                return
            if hits["inf"] is None and torch.isinf(t).any():
                hits["inf"] = name
            if hits["nan"] is None and torch.isnan(t).any():
                hits["nan"] = name
        return f

    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_hook(hook(name)))
    with torch.no_grad(), ctx():
        out = model(input_ids=ids).last_hidden_state
    for h in handles:
        h.remove()
    return {
        "first_inf": hits["inf"],
        "first_nan": hits["nan"],
        "final_output_n_nan": int(torch.isnan(out).sum()),
        "final_output_n_inf": int(torch.isinf(out).sum()),
    }


def make(out_dir: Path, name, ffp, layers, block):
    torch.manual_seed(1234 + layers)
    cfg = T5Config(
        vocab_size=96, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=layers,
        feed_forward_proj=ffp, dropout_rate=0.0, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
        is_encoder_decoder=False, use_cache=False, tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    model = T5EncoderModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    sd = model.state_dict()
    # Scale every weight to a modest range and round it to bf16, so it is exact in fp16,
    # bf16 and fp32.
    for k, v in sd.items():
        if k.endswith("layer_norm.weight"):
            sd[k] = torch.ones_like(v)
        else:
            sd[k] = (v * (0.5 / v.abs().max())).to(torch.bfloat16).to(torch.float32)
    model.load_state_dict(sd, strict=False)
    # Push one channel of the chosen block's `wo` output to about 1.2e5 (past fp16's 65504).
    wo = f"encoder.block.{block}.layer.1.DenseReluDense.wo.weight"
    captured = {}
    h = model.encoder.block[block].layer[1].DenseReluDense.wo.register_forward_hook(
        lambda _m, _i, o: captured.setdefault("y", o.detach()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    ch = int(captured["y"].abs().amax(dim=(0, 1)).argmax())
    factor = 1.2e5 / float(captured["y"][..., ch].abs().max())
    sd = model.state_dict()
    sd[wo][ch] = (sd[wo][ch] * factor).to(torch.bfloat16).to(torch.float32)
    model.load_state_dict(sd)
    d = out_dir / name
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = cfg.to_dict()
    cfg_dict["model_type"] = "t5"
    cfg_dict["architectures"] = ["T5EncoderModel"]
    (d / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    save_file({"input_ids": ids.to(torch.int64)}, str(d / "inputs.safetensors"))
    scenarios = {}
    fp32 = first_nonfinite(model, ids, lambda: torch.autocast("cpu", enabled=False))
    scenarios["fp32"] = fp32
    scenarios["autocast_fp16"] = first_nonfinite(model, ids, lambda: torch.autocast("cpu", dtype=torch.float16))
    scenarios["autocast_bf16"] = first_nonfinite(model, ids, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    half = T5EncoderModel(cfg).eval()
    half.load_state_dict(model.state_dict())
    half = half.half()
    scenarios["fp16_half"] = first_nonfinite(half, ids, lambda: torch.autocast("cpu", enabled=False))
    expected = {
        "about": "transformers T5EncoderModel (eager attention, CPU); first module in completion order "
                 "whose first output holds an Inf / a NaN; clamp as transformers applies it in fp16.",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "planted": {"block": block, "channel": ch, "target_wo_max_abs": 1.2e5},
        "feed_forward_proj": ffp,
        "num_layers": layers,
        "scenarios": scenarios,
    }
    (d / "expected.json").write_text(json.dumps(expected, indent=1))
    print(name, json.dumps(scenarios))


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/t5_variants")
    for v in VARIANTS:
        make(out, *v)
