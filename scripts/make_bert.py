#!/usr/bin/env python3
"""Makes a tiny BERT checkpoint (BertForMaskedLM, MLM head tied to the word embeddings) with
an fp16 overflow planted at one layer's FFN output (`output.dense`), and records what PyTorch
+ transformers (CPU) give for it on a padded, masked-LM batch (input_ids, token_type_ids,
attention_mask, labels): per-module forward outputs in fp32 (shape, max |x|, L2 norm), the
loss, every parameter's gradient after one fp32 backward (L2 norm and max |g|), and the first
module whose output holds an Inf / a NaN in fp32, autocast fp16, autocast bf16 and pure fp16,
for the planted weights and for the same weights before the plant (unplanted.safetensors).

Needs torch and transformers; CI does not run it. Its outputs are committed under
tests/golden/bert_tiny/ (config.json, model.safetensors, unplanted.safetensors,
inputs.safetensors, expected.json).

    python3 scripts/make_bert.py tests/golden/bert_tiny
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gpt2 import fp32_and_fp64_grads, module_trace, scenarios  # noqa: E402

LAYERS, LAYER, MASK_ID = 3, 1, 3  # the overflow is planted at layer LAYER's output.dense
PLANT = f"bert.encoder.layer.{LAYER}.output.dense"
# Tied to bert.embeddings.word_embeddings.weight and cls.predictions.bias; save_pretrained
# leaves them out too.
TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def config():
    cfg = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
        pad_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return cfg


def model_with(state, dtype=torch.float32):
    m = BertForMaskedLM(config()).eval()
    m.load_state_dict(state)
    return m.to(dtype)


def batch():
    """Two rows of 12: token types 0 then 1 from position 6; row 1's last 3 positions are
    padding (id 0, mask 0); 3 unpadded positions a row are masked (id MASK_ID) and labelled
    with the original id, every other label is -100."""
    g = torch.Generator().manual_seed(17)
    ids = torch.randint(4, 96, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 9:] = 0
    ids[1, 9:] = 0
    types = torch.zeros(2, 12, dtype=torch.int64)
    types[:, 6:] = 1
    labels = torch.full((2, 12), -100, dtype=torch.int64)
    for r, n in ((0, 12), (1, 9)):
        pos = torch.randperm(n, generator=g)[:3]
        labels[r, pos] = ids[r, pos]
        ids[r, pos] = MASK_ID
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def save_weights(state, path):
    save_file({k: v.contiguous() for k, v in state.items() if k not in TIED}, str(path),
              metadata={"format": "pt"})


def main(out: Path):
    torch.manual_seed(2026)
    base = BertForMaskedLM(config()).eval()
    sd = base.state_dict()
    # Modest weights rounded to bf16 (exact in fp16, bf16 and fp32); LayerNorm at its init
    # (weight 1, bias 0); small biases. The word embeddings' padding row stays zero.
    for k, v in sd.items():
        if ".LayerNorm." in k or k in TIED:
            continue
        if k.endswith("bias"):
            sd[k] = (torch.randn_like(v) * 0.02).to(torch.bfloat16).float()
        else:
            sd[k] = (v * (0.5 / v.abs().max())).to(torch.bfloat16).float()
    sd[TIED[0]], sd[TIED[1]] = sd["bert.embeddings.word_embeddings.weight"], sd["cls.predictions.bias"]
    base.load_state_dict(sd)
    unplanted = {k: v.clone() for k, v in base.state_dict().items()}
    inputs = batch()
    # Plant: scale the largest output channel of layer LAYER's output.dense (its weight row
    # and bias) so that the module's output reaches about 1.2e5, past fp16's 65504.
    captured = {}
    hook = base.bert.encoder.layer[LAYER].output.dense.register_forward_hook(
        lambda _m, _i, o: captured.setdefault("y", o.detach()))
    with torch.no_grad():
        base(**inputs)
    hook.remove()
    ch = int(captured["y"].abs().amax(dim=(0, 1)).argmax())
    factor = 1.2e5 / float(captured["y"][..., ch].abs().max())
    sd = base.state_dict()
    for k in (f"{PLANT}.weight", f"{PLANT}.bias"):
        sd[k][ch] = (sd[k][ch] * factor).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    out.mkdir(parents=True, exist_ok=True)
    save_weights(state, out / "model.safetensors")
    save_weights(unplanted, out / "unplanted.safetensors")
    cfg_dict = config().to_dict()
    cfg_dict["model_type"] = "bert"
    cfg_dict["architectures"] = ["BertForMaskedLM"]
    cfg_dict.pop("_attn_implementation", None)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    save_file(inputs, str(out / "inputs.safetensors"))

    variants = {}
    for name, st in (("plain", state), ("unplanted", unplanted)):
        variants[name] = scenarios(model_with, st, inputs)
        print(name, json.dumps(variants[name]))
    loss, grads, grads64 = fp32_and_fp64_grads(model_with, state, inputs)
    # The planted outlier (1.2e5 into a LayerNorm) leaves fp32 gradients off the exact ones
    # by up to ~1e-3 relative in PyTorch itself; the unplanted weights are well conditioned.
    loss_u, grads_u, grads64_u = fp32_and_fp64_grads(model_with, unplanted, inputs)
    expected = {
        "about": "transformers BertForMaskedLM (eager attention, CPU) on a padded masked-LM "
                 "batch; first module in completion order whose first output holds an Inf / a "
                 "NaN; the fp32 forward module by module; the fp32 loss and the gradient of "
                 "each parameter after one backward (of the planted model, and unplanted_* of "
                 "unplanted.safetensors, which variant unplanted runs).",
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "planted": {"layer": LAYER, "module": PLANT, "channel": ch, "target_max_abs": 1.2e5},
        "fp32_loss": float(loss.detach()),
        "fp32_module_trace": module_trace(model_with(state), inputs),
        "fp32_grads": grads,
        "fp64_grads": grads64,
        "variants": variants,
        "unplanted_fp32_loss": float(loss_u.detach()),
        "unplanted_fp32_grads": grads_u,
        "unplanted_fp64_grads": grads64_u,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, allow_nan=False))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/bert_tiny"))
