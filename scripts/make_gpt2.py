#!/usr/bin/env python3
"""Makes a tiny GPT-2 checkpoint (GPT2LMHeadModel) with an fp16 overflow planted in one
block's attention scores, and records what PyTorch + transformers (CPU) give for it:
per-module forward outputs in fp32 (shape, max |x|, L2 norm), the loss, the gradient of
every parameter after one fp32 backward (L2 norm and max |g|), and the first module whose
output holds an Inf / a NaN in fp32, autocast fp16, autocast bf16 and pure fp16, for the
plain config and for each of transformers' fp16 switches (`reorder_and_upcast_attn`,
`scale_attn_by_inverse_layer_idx`).

Needs torch and transformers; CI does not run it. Its outputs are committed under
tests/golden/gpt2_tiny/ (config.json, model.safetensors, inputs.safetensors,
expected.json).

    python3 scripts/make_gpt2.py tests/golden/gpt2_tiny
"""
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

LAYERS, BLOCK = 3, 1  # the overflow is planted in block BLOCK's scores


def config(**switches):
    cfg = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        **switches,
    )
    cfg._attn_implementation = "eager"
    return cfg


def model_with(state, dtype=torch.float32, **switches):
    m = GPT2LMHeadModel(config(**switches)).eval()
    m.load_state_dict(state)
    return m.to(dtype)


def first_nonfinite(model, inputs, ctx):
    """First module (completion order) with an Inf / a NaN in its first output tensor (a
    ModelOutput's logits or last_hidden_state), running model(**inputs) under ctx()."""
    hits = {"inf": None, "nan": None}
    handles = []

    def hook(name):
        def f(_m, _i, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(t, "logits"):
                t = t.logits
            elif hasattr(t, "last_hidden_state"):
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
        out = model(**inputs)
    for h in handles:
        h.remove()
    return {
        "first_inf": hits["inf"],
        "first_nan": hits["nan"],
        "loss": float(out.loss) if torch.isfinite(out.loss) else None,
        "logits_n_nan": int(torch.isnan(out.logits).sum()),
    }


def scenarios(model_with, state, inputs):
    """first_nonfinite for model_with(state) in fp32, autocast fp16 and autocast bf16, and for
    model_with(state, torch.float16) (pure fp16)."""
    m = model_with(state)
    return {
        "fp32": first_nonfinite(m, inputs, lambda: torch.autocast("cpu", enabled=False)),
        "autocast_fp16": first_nonfinite(m, inputs,
                                         lambda: torch.autocast("cpu", dtype=torch.float16)),
        "autocast_bf16": first_nonfinite(m, inputs,
                                         lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "fp16_half": first_nonfinite(model_with(state, torch.float16), inputs,
                                     lambda: torch.autocast("cpu", enabled=False)),
    }


def module_trace(model, inputs):
    """Each module's first output tensor in fp32 (ModelOutputs and logits left out): shape,
    max |x| and L2 norm, in completion order, running model(**inputs)."""
    rows = []
    handles = []

    def hook(name):
        def f(_m, _i, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(t, "logits"):
                return
            if torch.is_tensor(t) and t.is_floating_point():
                d = t.detach().double()
                rows.append({"module": name, "shape": list(t.shape),
                             "max_abs": float(d.abs().max()), "l2": float(d.pow(2).sum().sqrt())})
        return f

    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_hook(hook(name)))
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return rows


def fp32_and_fp64_grads(model_with, state, inputs):
    """The fp32 loss and each parameter's gradient (L2 norm, max |g|) after one backward in
    fp32, and the same gradients from a float64 backward (how far fp32 itself is from the
    exact gradient)."""
    out = []
    for dtype in (torch.float32, torch.float64):
        m = model_with(state, dtype)
        m.train()
        m.zero_grad()
        loss = m(**inputs).loss
        loss.backward()
        grads = {}
        for n, p in m.named_parameters():
            g = p.grad.detach().double()
            grads[n] = {"l2": float(g.pow(2).sum().sqrt()), "max_abs": float(g.abs().max())}
        out.append((loss, grads))
    return out[0][0], out[0][1], out[1][1]


def main(out: Path):
    torch.manual_seed(2024)
    base = GPT2LMHeadModel(config()).eval()
    sd = base.state_dict()
    # Modest weights, rounded to bf16 so they are exact in fp16, bf16 and fp32; LayerNorm at
    # its init (weight 1, bias 0); small biases.
    for k, v in sd.items():
        if ".ln_" in k or k.startswith("transformer.ln_f"):
            continue
        if k.endswith(".bias"):
            sd[k] = (torch.randn_like(v) * 0.02).to(torch.bfloat16).float()
        else:
            sd[k] = (v * (0.5 / v.abs().max())).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(11))
    inputs = {"input_ids": ids, "labels": ids}
    # Plant: scale head 0's query and key columns of block BLOCK so that its largest raw
    # score q·k is about 2e5, past fp16's 65504 (scaled by 1/sqrt(8) it is still finite).
    captured = {}
    hook = base.transformer.h[BLOCK].attn.c_attn.register_forward_hook(
        lambda _m, _i, o: captured.setdefault("qkv", o.detach()))
    with torch.no_grad():
        base(input_ids=ids)
    hook.remove()
    d, hd = 32, 8
    q = captured["qkv"][..., 0:hd]
    k = captured["qkv"][..., d:d + hd]
    raw = (q @ k.transpose(-1, -2)).abs().max()
    f = math.sqrt(2.0e5 / float(raw))
    w = f"transformer.h.{BLOCK}.attn.c_attn.weight"
    b = f"transformer.h.{BLOCK}.attn.c_attn.bias"
    sd = base.state_dict()
    for lo in (0, d):
        sd[w][:, lo:lo + hd] = (sd[w][:, lo:lo + hd] * f).to(torch.bfloat16).float()
        sd[b][lo:lo + hd] = (sd[b][lo:lo + hd] * f).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = config().to_dict()
    cfg_dict["model_type"] = "gpt2"
    cfg_dict["architectures"] = ["GPT2LMHeadModel"]
    cfg_dict.pop("_attn_implementation", None)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    save_file({"input_ids": ids.to(torch.int64)}, str(out / "inputs.safetensors"))

    variants = {}
    for name, switches in [
        ("plain", {}),
        ("reorder_and_upcast_attn", {"reorder_and_upcast_attn": True}),
        ("scale_attn_by_inverse_layer_idx", {"scale_attn_by_inverse_layer_idx": True}),
    ]:
        sc = scenarios(lambda st, dt=torch.float32: model_with(st, dt, **switches), state, inputs)
        variants[name] = sc
        print(name, json.dumps(sc))

    loss, grads, grads64 = fp32_and_fp64_grads(model_with, state, inputs)
    expected = {
        "about": "transformers GPT2LMHeadModel (eager attention, CPU); first module in completion "
                 "order whose first output holds an Inf / a NaN; the fp32 forward module by "
                 "module; the fp32 loss and the gradient of each parameter after one backward.",
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "planted": {"block": BLOCK, "head": 0, "raw_score_max_abs": 2.0e5},
        "fp32_loss": float(loss.detach()),
        "fp32_module_trace": module_trace(model_with(state), {"input_ids": ids}),
        "fp32_grads": grads,
        "fp64_grads": grads64,
        "variants": variants,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, allow_nan=False))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/gpt2_tiny"))
