//! LLaMA (`LlamaForCausalLM`) from Hugging Face files (`config.json` + safetensors),
//! mirroring the eager forward of transformers' `modeling_llama.py` (5.x) with its casts:
//! RMSNorm with the variance in fp32 and the result cast back to the input's dtype before
//! the weight; rotary position embeddings (cos and sin in fp32, `q·cos + rotate_half(q)·sin`,
//! which under autocast makes the rotated queries and keys fp32); grouped-query attention
//! (`repeat_kv`); scores `q·kᵀ × head_dim^-0.5` plus the additive causal mask (the
//! embeddings' dtype and its `finfo.min`), softmax in fp32 cast back to the queries' dtype;
//! the SwiGLU MLP `down(silu(gate(x)) · up(x))`; an untied LM head unless
//! `tie_word_embeddings`.
//!
//! Objective: transformers' `ForCausalLMLoss`, as for GPT-2 (logits cast to fp32, labels
//! padded with -100 and shifted left by one on the host).

use super::gpt2::{causal_lm_labels, causal_lm_output};
use super::hf_config::{bool_field, check_size, config_json, usize_field};
use super::masks::causal_mask;
use super::pretrained::Pretrained;
use super::tokens::{check_token_batch, forward_ids, refuse_inputs};
use super::{Batch, Model, Output, ParamAccess};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::path::Path;

/// Most layers a LLaMA `config.json` may describe.
pub const MAX_LLAMA_LAYERS: usize = 1024;
/// Most parameters a LLaMA `config.json` may describe (2^38: a 256-billion-parameter
/// model).
pub const MAX_LLAMA_PARAMS: u64 = 1 << 38;

/// A LLaMA architecture, read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key and value heads (grouped-query attention when fewer than the query heads).
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
    /// Longest sequence.
    pub max_positions: usize,
    /// Biases in the attention projections.
    pub attention_bias: bool,
    /// Biases in the MLP projections.
    pub mlp_bias: bool,
    /// LM head tied to the embedding.
    pub tie_word_embeddings: bool,
    /// The padding id, if any (its embedding row gets no gradient in PyTorch).
    pub pad_token_id: Option<i64>,
}

impl LlamaConfig {
    /// Reads `config.json`; refuses other model types with a message naming the file.
    pub fn load(path: &Path) -> Result<LlamaConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        LlamaConfig::parse(&text, path)
    }

    /// [`LlamaConfig::load`] of a file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<LlamaConfig> {
        let v = config_json(text, path, "llama")?;
        let at = path.display();
        let act = v
            .get("hidden_act")
            .and_then(|x| x.as_str())
            .unwrap_or("silu");
        if act != "silu" {
            return Err(Error::config(
                format!("{at}: hidden_act"),
                format!("`{act}` is not supported (expected `silu`)"),
            ));
        }
        if let Some(tp) = v.get("pretraining_tp").and_then(|x| x.as_u64()) {
            if tp != 1 {
                return Err(Error::config(
                    format!("{at}: pretraining_tp"),
                    format!("{tp} is not supported (expected 1)"),
                ));
            }
        }
        // transformers 5.x keeps the rotary settings in `rope_parameters`; older files in
        // `rope_theta` and `rope_scaling`.
        let rope = v.get("rope_parameters").filter(|r| r.is_object());
        let rope_type = rope
            .and_then(|r| r.get("rope_type"))
            .or_else(|| v.get("rope_scaling").and_then(|r| r.get("rope_type")))
            .and_then(|x| x.as_str())
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(Error::config(
                format!("{at}: rope_parameters.rope_type"),
                format!("`{rope_type}` is not supported (expected `default`)"),
            ));
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(|x| x.as_f64())
            .unwrap_or(10000.0);
        let flag = |name: &str, default: bool| bool_field(&v, path, name, default);
        let hidden_size = usize_field(&v, path, "hidden_size")?;
        let num_heads = usize_field(&v, path, "num_attention_heads")?;
        let num_kv_heads = match v.get("num_key_value_heads") {
            None | Some(serde_json::Value::Null) => num_heads,
            Some(_) => usize_field(&v, path, "num_key_value_heads")?,
        };
        if num_heads % num_kv_heads != 0 {
            return Err(Error::config(
                format!("{at}: num_key_value_heads"),
                format!("{num_kv_heads} key/value heads do not divide {num_heads} query heads"),
            ));
        }
        let head_dim = match v.get("head_dim") {
            None | Some(serde_json::Value::Null) => {
                if hidden_size % num_heads != 0 {
                    return Err(Error::config(
                        format!("{at}: num_attention_heads"),
                        format!("{num_heads} heads do not divide hidden_size {hidden_size}"),
                    ));
                }
                hidden_size / num_heads
            }
            Some(_) => usize_field(&v, path, "head_dim")?,
        };
        if head_dim % 2 != 0 {
            return Err(Error::config(
                format!("{at}: head_dim"),
                format!("{head_dim} is odd; rotary embeddings need an even head width"),
            ));
        }
        let cfg = LlamaConfig {
            vocab_size: usize_field(&v, path, "vocab_size")?,
            hidden_size,
            intermediate_size: usize_field(&v, path, "intermediate_size")?,
            num_layers: usize_field(&v, path, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            eps: v
                .get("rms_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-6),
            rope_theta,
            max_positions: v
                .get("max_position_embeddings")
                .and_then(|x| x.as_u64())
                .unwrap_or(2048) as usize,
            attention_bias: flag("attention_bias", false)?,
            mlp_bias: flag("mlp_bias", false)?,
            tie_word_embeddings: flag("tie_word_embeddings", false)?,
            pad_token_id: v.get("pad_token_id").and_then(|x| x.as_i64()),
        };
        cfg.check_size(path)?;
        Ok(cfg)
    }

    /// The number of parameters, or `None` when it does not fit a `u64`.
    pub fn param_count(&self) -> Option<u64> {
        let d = self.hidden_size as u64;
        let (q, kv) = (
            (self.num_heads as u64).checked_mul(self.head_dim as u64)?,
            (self.num_kv_heads as u64).checked_mul(self.head_dim as u64)?,
        );
        let f = self.intermediate_size as u64;
        let attn = d
            .checked_mul(q.checked_add(2 * kv)?)?
            .checked_add(q.checked_mul(d)?)?;
        let attn = attn.checked_add(if self.attention_bias {
            q + 2 * kv + d
        } else {
            0
        })?;
        let mlp = (3 * d)
            .checked_mul(f)?
            .checked_add(if self.mlp_bias { 2 * f + d } else { 0 })?;
        let per_layer = attn.checked_add(mlp)?.checked_add(2 * d)?;
        let embed = (self.vocab_size as u64).checked_mul(d)?;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed
            .checked_add(head)?
            .checked_add(per_layer.checked_mul(self.num_layers as u64)?)?
            .checked_add(d)
    }

    fn check_size(&self, path: &Path) -> Result<()> {
        check_size(
            path,
            ("num_hidden_layers", self.num_layers, MAX_LLAMA_LAYERS),
            self.param_count(),
            MAX_LLAMA_PARAMS,
        )
    }

    /// Parameter names (transformers' `LlamaForCausalLM`), shapes, and whether each is an
    /// RMSNorm weight.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let mut v = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, d],
            false,
        )];
        for i in 0..self.num_layers {
            let l = format!("model.layers.{i}");
            let mut push = |name: &str, shape: Vec<usize>, norm: bool| {
                v.push((format!("{l}.{name}"), shape, norm));
            };
            push("input_layernorm.weight", vec![d], true);
            for (p, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                push(&format!("self_attn.{p}.weight"), vec![out, d], false);
                if self.attention_bias {
                    push(&format!("self_attn.{p}.bias"), vec![out], false);
                }
            }
            push("self_attn.o_proj.weight", vec![d, q], false);
            if self.attention_bias {
                push("self_attn.o_proj.bias", vec![d], false);
            }
            push("post_attention_layernorm.weight", vec![d], true);
            for (p, shape) in [
                ("gate_proj", vec![f, d]),
                ("up_proj", vec![f, d]),
                ("down_proj", vec![d, f]),
            ] {
                let out = shape[0];
                push(&format!("mlp.{p}.weight"), shape, false);
                if self.mlp_bias {
                    push(&format!("mlp.{p}.bias"), vec![out], false);
                }
            }
        }
        v.push(("model.norm.weight".to_string(), vec![d], true));
        if !self.tie_word_embeddings {
            v.push((
                "lm_head.weight".to_string(),
                vec![self.vocab_size, d],
                false,
            ));
        }
        v
    }
}

/// LLaMA with its LM head and the causal LM loss.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Architecture.
    pub cfg: LlamaConfig,
}

impl Llama {
    /// A model.
    pub fn new(cfg: LlamaConfig) -> Llama {
        Llama { cfg }
    }

    /// LlamaRMSNorm: `weight · (x₃₂ · rsqrt(mean(x₃₂²) + eps)).to(x.dtype)`.
    fn rms_norm(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        name: &str,
        x: &Tensor,
    ) -> Result<Tensor> {
        let w = p.get(e, &format!("{name}.weight"))?;
        e.scope(name, |e| {
            let xf = e.to_dtype(x, DType::F32)?;
            let sq = e.pow(&xf, 2.0)?;
            let var = e.mean(&sq, &[-1], true)?;
            let ve = e.add_scalar(&var, self.cfg.eps)?;
            let r = e.rsqrt(&ve)?;
            let h = e.mul(&xf, &r)?;
            let h = e.to_dtype(&h, x.dtype())?;
            let out = e.mul(&w, &h)?;
            // Norm weights stay fp32 masters in O2 and pure 16-bit modes, where PyTorch's
            // cast model holds them in 16 bits: the product goes back to the model's dtype.
            match p.precision().o2_dtype() {
                Some(d) => e.to_dtype(&out, d),
                None => Ok(out),
            }
        })
    }

    /// cos and sin [1, 1, s, head_dim] of the default rotary embedding as transformers
    /// makes them (`inv_freq = 1 / θ^(2i/d)` in fp32, angles `position · inv_freq` in fp32,
    /// duplicated, cos and sin rounded to `like`'s dtype), on `like`'s device.
    fn rotary(&self, s: usize, like: &Tensor) -> Result<(Tensor, Tensor)> {
        let hd = self.cfg.head_dim;
        let theta = self.cfg.rope_theta as f32;
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        let (mut cos, mut sin) = (Vec::with_capacity(s * hd), Vec::with_capacity(s * hd));
        for pos in 0..s {
            for _ in 0..2 {
                for f in &inv {
                    let a = pos as f32 * f;
                    cos.push((a as f64).cos() as f32);
                    sin.push((a as f64).sin() as f32);
                }
            }
        }
        // `cos.to(dtype=x.dtype)`: the embeddings' dtype (fp32 under autocast, 16 bits in a
        // pure 16-bit model).
        let dtype = match like.dtype() {
            d @ (DType::F16 | DType::BF16) => d,
            _ => DType::F32,
        };
        let put = |v: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_f32(v, &[1, 1, s, hd], dtype)?;
            match like.device() {
                Some(d) => t.to_device(d),
                None => Ok(t),
            }
        };
        Ok((put(cos)?, put(sin)?))
    }

    /// `x·cos + rotate_half(x)·sin`, `rotate_half(x) = cat(-x₂, x₁)`.
    fn rope(&self, e: &mut Engine, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = self.cfg.head_dim as isize;
        let a = e.mul(x, cos)?;
        let x1 = e.slice(x, -1, 0, hd / 2)?;
        let x2 = e.slice(x, -1, hd / 2, hd)?;
        let n2 = e.neg(&x2)?;
        let rot = e.cat(&[&n2, &x1], -1)?;
        let b = e.mul(&rot, sin)?;
        e.add(&a, &b)
    }

    /// `repeat_kv`: each key/value head repeated for its group of query heads.
    fn repeat_kv(&self, e: &mut Engine, x: &Tensor) -> Result<Tensor> {
        let rep = self.cfg.num_heads / self.cfg.num_kv_heads;
        if rep == 1 {
            return Ok(x.clone());
        }
        let s = x.shape().to_vec();
        let u = e.unsqueeze(x, 2)?;
        let copies: Vec<&Tensor> = std::iter::repeat_n(&u, rep).collect();
        let c = e.cat(&copies, 2)?;
        e.reshape(
            &c,
            &[
                s[0] as isize,
                (s[1] * rep) as isize,
                s[2] as isize,
                s[3] as isize,
            ],
        )
    }

    fn attention(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        layer: usize,
        x: &Tensor,
        (mask, cos, sin): (&Tensor, &Tensor, &Tensor),
    ) -> Result<Tensor> {
        let (b, s) = (x.shape()[0] as isize, x.shape()[1] as isize);
        let hd = self.cfg.head_dim as isize;
        let name = format!("model.layers.{layer}.self_attn");
        let bias = self.cfg.attention_bias;
        let q = p.linear(e, &format!("{name}.q_proj"), x, bias)?;
        let k = p.linear(e, &format!("{name}.k_proj"), x, bias)?;
        let v = p.linear(e, &format!("{name}.v_proj"), x, bias)?;
        e.push_module(&name);
        let r = (|| -> Result<Tensor> {
            let heads = |e: &mut Engine, t: &Tensor| -> Result<Tensor> {
                let t = e.view(t, &[b, s, -1, hd])?;
                e.transpose(&t, 1, 2)
            };
            let (q, k, v) = (heads(e, &q)?, heads(e, &k)?, heads(e, &v)?);
            let q = self.rope(e, &q, cos, sin)?;
            let k = self.rope(e, &k, cos, sin)?;
            let k = self.repeat_kv(e, &k)?;
            let v = self.repeat_kv(e, &v)?;
            let kt = e.transpose(&k, 2, 3)?;
            let scores = e.matmul(&q, &kt)?;
            let scores = e.mul_scalar(&scores, (self.cfg.head_dim as f64).powf(-0.5))?;
            let scores = e.add(&scores, mask)?;
            let sf = e.to_dtype(&scores, DType::F32)?;
            let probs = e.softmax(&sf, -1)?;
            let probs = e.to_dtype(&probs, q.dtype())?;
            let ctx = e.matmul(&probs, &v)?;
            let ctx = e.transpose(&ctx, 1, 2)?;
            e.reshape(&ctx, &[b, s, -1])
        })();
        e.pop_module();
        let ctx = r?;
        p.linear(e, &format!("{name}.o_proj"), &ctx, bias)
    }

    fn mlp(&self, e: &mut Engine, p: &ParamAccess<'_>, layer: usize, x: &Tensor) -> Result<Tensor> {
        let name = format!("model.layers.{layer}.mlp");
        let bias = self.cfg.mlp_bias;
        let g = p.linear(e, &format!("{name}.gate_proj"), x, bias)?;
        let g = e.scope(&format!("{name}.act_fn"), |e| e.silu(&g))?;
        let u = p.linear(e, &format!("{name}.up_proj"), x, bias)?;
        let h = e.scope(&name, |e| e.mul(&g, &u))?;
        p.linear(e, &format!("{name}.down_proj"), &h, bias)
    }

    /// The last hidden state (after the final norm) for token ids [batch, seq].
    pub fn hidden(&self, e: &mut Engine, p: &ParamAccess<'_>, ids: &Tensor) -> Result<Tensor> {
        if ids.rank() != 2 || ids.dtype() != DType::I64 {
            return Err(Error::tensor(
                "input_ids",
                format!(
                    "expected int64 [batch, seq], got {} {:?}",
                    ids.dtype(),
                    ids.shape()
                ),
            ));
        }
        let s = ids.shape()[1];
        let emb = p.get(e, "model.embed_tokens.weight")?;
        let mut x = e.scope("model.embed_tokens", |e| {
            e.embedding_padded(&emb, ids, self.cfg.pad_token_id)
        })?;
        let mask = causal_mask(e, s, &x)?;
        let (cos, sin) = self.rotary(s, &x)?;
        for i in 0..self.cfg.num_layers {
            let l = format!("model.layers.{i}");
            let n = self.rms_norm(e, p, &format!("{l}.input_layernorm"), &x)?;
            let a = self.attention(e, p, i, &n, (&mask, &cos, &sin))?;
            x = e.scope(&l, |e| e.add(&x, &a))?;
            let n = self.rms_norm(e, p, &format!("{l}.post_attention_layernorm"), &x)?;
            let m = self.mlp(e, p, i, &n)?;
            x = e.scope(&l, |e| e.add(&x, &m))?;
        }
        self.rms_norm(e, p, "model.norm", &x)
    }
}

/// Loads the weights (f32, f16 or bf16; fp32 masters) from a directory with
/// `model.safetensors` (or a sharded index) or from one file. A saved
/// `lm_head.weight` of a tied model, and rotary buffers, are not parameters.
///
/// Seeded random weights as transformers initialises LLaMA (normal, std 0.02; biases
/// 0; RMSNorm weights 1), for benchmarks.
impl Pretrained for Llama {
    const INIT_KEY: u64 = 0x6c6c_616d;
    const INIT_STD: f64 = 0.02;

    fn param_shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        self.cfg.shapes()
    }

    fn param_total(&self) -> Option<u64> {
        self.cfg.param_count()
    }

    fn tokens(&self) -> (usize, usize) {
        (self.cfg.vocab_size, self.cfg.max_positions.min(64))
    }
}

impl Model for Llama {
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "llama hidden {} intermediate {} layers {} heads {} kv-heads {} head_dim {} vocab {}",
            c.hidden_size,
            c.intermediate_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size
        )
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        refuse_inputs(batch, "llama", false, false)?;
        check_token_batch(batch, self.cfg.vocab_size)?;
        if batch.inputs.shape().get(1).copied().unwrap_or(0) > self.cfg.max_positions {
            return Err(Error::tensor(
                "input_ids",
                format!(
                    "sequences longer than the model's {} positions",
                    self.cfg.max_positions
                ),
            ));
        }
        Ok(())
    }

    fn prepare_batch(&self, batch: Batch) -> Result<Batch> {
        causal_lm_labels(batch)
    }

    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let h = self.hidden(e, p, forward_ids(self, batch)?)?;
        let head = if self.cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let w = p.get(e, head)?;
        causal_lm_output(e, h, &w, &batch.labels)
    }
}
