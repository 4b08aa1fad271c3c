#!/usr/bin/env python3
"""Makes a tiny T5 v1.1-style encoder-decoder checkpoint (T5ForConditionalGeneration,
gated-gelu, its own lm_head) with an fp16 overflow planted at the last decoder block's
feed-forward output (`wo`), and records what PyTorch + transformers (CPU) give for it on a
padded batch (input_ids, attention_mask, labels; transformers shifts the labels right into
the decoder's input): per-module forward outputs in fp32 (shape, max |x|, L2 norm), the loss,
every parameter's gradient after one fp32 backward (L2 norm and max |g|), and the first
module whose output holds an Inf / a NaN in fp32, autocast fp16, autocast bf16 and pure fp16,
with transformers' fp16 clamp in T5Block (plain) and without it (no_clamp).

Needs torch and transformers; CI does not run it. Its outputs are committed under
tests/golden/t5_seq2seq_tiny/ (config.json, model.safetensors, inputs.safetensors,
expected.json).

    python3 scripts/make_t5_seq2seq.py tests/golden/t5_seq2seq_tiny
"""
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
import transformers
from safetensors.torch import save_file
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5 import modeling_t5

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gpt2 import fp32_and_fp64_grads, module_trace, scenarios  # noqa: E402

PLANT = "decoder.block.1.layer.2.DenseReluDense.wo"
TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")  # = shared.weight


def config():
    cfg = T5Config(
        vocab_size=96, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
        num_decoder_layers=2, feed_forward_proj="gated-gelu", dropout_rate=0.0,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6, tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, use_cache=False,
    )
    cfg._attn_implementation = "eager"
    return cfg


def model_with(state, dtype=torch.float32):
    # T5Config turns tie_word_embeddings=False into scale_decoder_outputs=False and then ties
    # anyway; from_pretrained unties lm_head when the checkpoint's lm_head.weight differs
    # from shared.weight, as in T5 v1.1 checkpoints and in this one: so do we.
    m = T5ForConditionalGeneration(config()).eval()
    m.lm_head.weight = torch.nn.Parameter(torch.empty_like(m.lm_head.weight))
    m.load_state_dict(state)
    return m.to(dtype)


class _TorchWithoutClamp:
    """modeling_t5's view of torch with clamp as the identity: its only torch.clamp calls
    are T5Block's three fp16 clamps (after self-attention, cross-attention and the FF)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def clamp(x, min=None, max=None):
        return x


def no_clamp():
    return mock.patch.object(modeling_t5, "torch", _TorchWithoutClamp())


def main(out: Path):
    torch.manual_seed(2027)
    base = model_with(T5ForConditionalGeneration(config()).state_dict())
    sd = base.state_dict()
    # Modest weights rounded to bf16 (exact in fp16, bf16 and fp32); layer norms at 1; the
    # lm_head drawn apart from the embeddings.
    sd["lm_head.weight"] = torch.randn(sd["lm_head.weight"].shape)
    for k, v in sd.items():
        if k.endswith("layer_norm.weight"):
            sd[k] = torch.ones_like(v)
        elif k not in TIED:
            sd[k] = (v * (0.5 / v.abs().max())).to(torch.bfloat16).float()
    sd[TIED[0]] = sd[TIED[1]] = sd["shared.weight"]
    base.load_state_dict(sd)
    unplanted = {k: v.clone() for k, v in base.state_dict().items()}
    g = torch.Generator().manual_seed(19)
    ids = torch.randint(2, 96, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.int64)
    ids[1, 8:] = 0
    mask[1, 8:] = 0
    labels = torch.randint(2, 96, (2, 7), generator=g)
    labels[1, 6] = -100
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    # Plant: scale the largest output channel of PLANT so that its output reaches about
    # 1.2e5, past fp16's 65504.
    captured = {}
    hook = base.get_submodule(PLANT).register_forward_hook(
        lambda _m, _i, o: captured.setdefault("y", o.detach()))
    with torch.no_grad():
        base(**inputs)
    hook.remove()
    ch = int(captured["y"].abs().amax(dim=(0, 1)).argmax())
    factor = 1.2e5 / float(captured["y"][..., ch].abs().max())
    sd = base.state_dict()
    sd[f"{PLANT}.weight"][ch] = (sd[f"{PLANT}.weight"][ch] * factor).to(torch.bfloat16).float()
    base.load_state_dict(sd)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items() if k not in TIED},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in unplanted.items() if k not in TIED},
              str(out / "unplanted.safetensors"), metadata={"format": "pt"})
    cfg_dict = config().to_dict()
    cfg_dict["model_type"] = "t5"
    cfg_dict["architectures"] = ["T5ForConditionalGeneration"]
    cfg_dict["tie_word_embeddings"] = False  # as T5 v1.1 configs say (to_dict says True)
    cfg_dict.pop("_attn_implementation", None)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    save_file(inputs, str(out / "inputs.safetensors"))
    # The checkpoint as transformers loads it is the model measured here.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    loaded = T5ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model_with(state)(**inputs).logits)

    variants = {}
    for name, ctx in (("plain", contextlib.nullcontext), ("no_clamp", no_clamp)):
        with ctx():
            variants[name] = scenarios(model_with, state, inputs)
        print(name, json.dumps(variants[name]))
    loss, grads, grads64 = fp32_and_fp64_grads(model_with, state, inputs)
    # The planted outlier leaves PyTorch's own fp32 gradients about 1e-4 off the exact
    # ones; the unplanted weights are well conditioned.
    loss_u, grads_u, grads64_u = fp32_and_fp64_grads(model_with, unplanted, inputs)
    expected = {
        "about": "transformers T5ForConditionalGeneration (eager attention, CPU, untied lm_head, "
                 "no decoder output scaling) on a padded batch; first module in completion "
                 "order whose first output holds an Inf / a NaN, with T5Block's fp16 clamp "
                 "(plain) and without it (no_clamp); the fp32 forward module by module; the "
                 "fp32 loss and the gradient of each parameter after one backward (of the planted "
                 "model, and unplanted_* of unplanted.safetensors).",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "planted": {"module": PLANT, "channel": ch, "target_max_abs": 1.2e5},
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
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/t5_seq2seq_tiny"))
