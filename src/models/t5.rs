//! T5 encoder from Hugging Face files (`config.json` + safetensors), mirroring the eager
//! forward of transformers 5.x's `modeling_t5.py` with its casts: the variance of
//! T5LayerNorm in fp32, attention scores plus the position bias out of place (so fp32
//! under autocast) plus the padding mask, the cast of the FFN activations to
//! `wo.weight`'s dtype, and (optionally) the fp16 clamp in T5Block. The blocks' parts are
//! shared with the full model ([`super::t5_seq2seq`]).
//!
//! Training objective: logits = (last hidden state × d_model^-0.5) · shared.weightᵀ, loss =
//! mean cross-entropy over all positions against `labels` (default: the input ids).

use super::hf_config::{check_size, config_json, usize_field};
use super::masks::extended_mask;
use super::pretrained::Pretrained;
use super::tokens::{check_token_batch, drop_full_mask, forward_ids, refuse_inputs};
pub use super::tokens::{inputs_from, load_inputs, synthetic_ids};
use super::weights::Checkpoint;
use super::{Batch, Model, Output, ParamAccess};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use serde::Serialize;
use std::path::Path;

/// Which attention of a T5 block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// The encoder's self-attention (bidirectional buckets).
    Encoder,
    /// The decoder's self-attention (causal buckets).
    Decoder,
    /// The decoder's attention over the encoder output.
    Cross,
}

/// Feed-forward variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FeedForward {
    /// `wi` → ReLU → `wo`.
    Relu,
    /// `wi_0` → GELU (tanh form) times `wi_1` → `wo`.
    GatedGelu,
}

/// The parts of a Hugging Face T5 config the encoder needs.
#[derive(Debug, Clone, Serialize)]
pub struct T5Config {
    /// Hidden size.
    pub d_model: usize,
    /// FFN inner size.
    pub d_ff: usize,
    /// Size of one attention head.
    pub d_kv: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Encoder blocks.
    pub num_layers: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Relative position buckets.
    pub num_buckets: usize,
    /// Largest relative distance with its own bucket range.
    pub max_distance: usize,
    /// T5LayerNorm epsilon.
    pub eps: f64,
    /// FFN variant.
    pub feed_forward: FeedForward,
    /// Dropout probability (training).
    pub dropout: f64,
}

/// Most encoder layers a `config.json` may describe.
pub const MAX_T5_LAYERS: usize = 1024;
/// Most parameters a `config.json` may describe (2^36, five times T5-XXL's).
pub const MAX_T5_PARAMS: u64 = 1 << 36;

impl T5Config {
    /// An encoder of the given widths with transformers' T5 defaults for the rest: 32
    /// relative-position buckets, max distance 128, eps 1e-6, the relu FFN, no dropout.
    pub fn relu(
        d_model: usize,
        d_ff: usize,
        (num_heads, d_kv): (usize, usize),
        num_layers: usize,
        vocab_size: usize,
    ) -> T5Config {
        T5Config {
            d_model,
            d_ff,
            d_kv,
            num_heads,
            num_layers,
            vocab_size,
            num_buckets: 32,
            max_distance: 128,
            eps: 1e-6,
            feed_forward: FeedForward::Relu,
            dropout: 0.0,
        }
    }

    /// Reads `config.json`; refuses other model types with a message naming the file.
    pub fn load(path: &Path) -> Result<T5Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        T5Config::parse(&text, path)
    }

    /// [`T5Config::load`] of a file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<T5Config> {
        let v = config_json(text, path, "t5")?;
        let ffp = v
            .get("feed_forward_proj")
            .and_then(|x| x.as_str())
            .unwrap_or("relu");
        let feed_forward = match ffp {
            "relu" => FeedForward::Relu,
            "gated-gelu" => FeedForward::GatedGelu,
            other => {
                return Err(Error::config(
                    format!("{}: feed_forward_proj", path.display()),
                    format!("`{other}` is not supported (expected `relu` or `gated-gelu`)"),
                ))
            }
        };
        let num =
            |name: &str, default: f64| v.get(name).and_then(|x| x.as_f64()).unwrap_or(default);
        let cfg = T5Config {
            d_model: usize_field(&v, path, "d_model")?,
            d_ff: usize_field(&v, path, "d_ff")?,
            d_kv: usize_field(&v, path, "d_kv")?,
            num_heads: usize_field(&v, path, "num_heads")?,
            num_layers: usize_field(&v, path, "num_layers")?,
            vocab_size: usize_field(&v, path, "vocab_size")?,
            num_buckets: v
                .get("relative_attention_num_buckets")
                .and_then(|x| x.as_u64())
                .unwrap_or(32) as usize,
            max_distance: v
                .get("relative_attention_max_distance")
                .and_then(|x| x.as_u64())
                .unwrap_or(128) as usize,
            eps: num("layer_norm_epsilon", 1e-6),
            feed_forward,
            dropout: num("dropout_rate", 0.1),
        };
        cfg.check_size(path)?;
        Ok(cfg)
    }

    /// The number of parameters, or `None` when it does not fit a `u64`.
    pub fn param_count(&self) -> Option<u64> {
        let (d, f, inner) = (
            self.d_model as u64,
            self.d_ff as u64,
            (self.num_heads as u64).checked_mul(self.d_kv as u64)?,
        );
        let ff = match self.feed_forward {
            FeedForward::Relu => 2,
            FeedForward::GatedGelu => 3,
        };
        let per_layer = (4 * inner)
            .checked_mul(d)?
            .checked_add((ff * f).checked_mul(d)?)?
            .checked_add(2 * d)?;
        (self.vocab_size as u64)
            .checked_mul(d)?
            .checked_add(per_layer.checked_mul(self.num_layers as u64)?)?
            .checked_add((self.num_buckets as u64).checked_mul(self.num_heads as u64)?)?
            .checked_add(d)
    }

    /// Refuses a configuration that describes more than [`MAX_T5_LAYERS`] layers or more
    /// than [`MAX_T5_PARAMS`] parameters: a `config.json` alone cannot make amprobe set
    /// aside memory beyond any real checkpoint's.
    fn check_size(&self, path: &Path) -> Result<()> {
        check_size(
            path,
            ("num_layers", self.num_layers, MAX_T5_LAYERS),
            self.param_count(),
            MAX_T5_PARAMS,
        )
    }

    /// Parameter names and shapes, in Hugging Face's naming.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (d, f, inner) = (self.d_model, self.d_ff, self.num_heads * self.d_kv);
        let mut v = vec![("shared.weight".to_string(), vec![self.vocab_size, d], false)];
        for i in 0..self.num_layers {
            let a = format!("encoder.block.{i}.layer.0");
            for p in ["q", "k", "v"] {
                v.push((
                    format!("{a}.SelfAttention.{p}.weight"),
                    vec![inner, d],
                    false,
                ));
            }
            v.push((format!("{a}.SelfAttention.o.weight"), vec![d, inner], false));
            if i == 0 {
                v.push((
                    format!("{a}.SelfAttention.relative_attention_bias.weight"),
                    vec![self.num_buckets, self.num_heads],
                    false,
                ));
            }
            v.push((format!("{a}.layer_norm.weight"), vec![d], true));
            let ff = format!("encoder.block.{i}.layer.1");
            match self.feed_forward {
                FeedForward::Relu => {
                    v.push((format!("{ff}.DenseReluDense.wi.weight"), vec![f, d], false))
                }
                FeedForward::GatedGelu => {
                    v.push((
                        format!("{ff}.DenseReluDense.wi_0.weight"),
                        vec![f, d],
                        false,
                    ));
                    v.push((
                        format!("{ff}.DenseReluDense.wi_1.weight"),
                        vec![f, d],
                        false,
                    ));
                }
            }
            v.push((format!("{ff}.DenseReluDense.wo.weight"), vec![d, f], false));
            v.push((format!("{ff}.layer_norm.weight"), vec![d], true));
        }
        v.push(("encoder.final_layer_norm.weight".to_string(), vec![d], true));
        v
    }
}

/// A T5 encoder with the LM objective on the tied embedding.
#[derive(Debug, Clone)]
pub struct T5Encoder {
    /// Architecture.
    pub cfg: T5Config,
    /// transformers' fp16 clamp in T5Block (`--t5-clamp`).
    pub clamp: bool,
    /// Whether dropout is applied.
    pub train: bool,
}

impl T5Encoder {
    /// A model with the clamp off, training mode.
    pub fn new(cfg: T5Config) -> T5Encoder {
        T5Encoder {
            cfg,
            clamp: false,
            train: true,
        }
    }

    /// Relative position buckets [q, k] as transformers computes them (the logarithmic
    /// part in f32, truncated): bidirectional (the encoder: half the buckets for keys
    /// after the query) or causal (the decoder: all buckets for keys at or before it).
    pub fn buckets(&self, q_len: usize, k_len: usize, bidirectional: bool) -> Vec<i64> {
        let mut nb = self.cfg.num_buckets as i64;
        if bidirectional {
            nb /= 2;
        }
        let max_exact = nb / 2;
        let mut out = Vec::with_capacity(q_len * k_len);
        for q in 0..q_len as i64 {
            for k in 0..k_len as i64 {
                let rel = k - q;
                let (mut b, r) = if bidirectional {
                    (if rel > 0 { nb } else { 0 }, rel.abs())
                } else {
                    (0, (-rel).max(0))
                };
                if r < max_exact {
                    b += r;
                } else {
                    let f = (r as f32 / max_exact as f32).ln()
                        / (self.cfg.max_distance as f32 / max_exact as f32).ln()
                        * (nb - max_exact) as f32;
                    b += (max_exact + f as i64).min(nb - 1);
                }
                out.push(b);
            }
        }
        out
    }

    fn dropout(&self, e: &mut Engine, x: &Tensor, salt: u64) -> Result<Tensor> {
        e.scope("dropout", |e| {
            e.dropout(x, self.cfg.dropout, self.train, salt)
        })
    }

    /// T5LayerNorm: RMS norm with the variance in fp32, output cast to the weight's dtype
    /// when that is fp16/bf16 (and, in O2, back to the low dtype).
    pub(crate) fn layer_norm(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        prefix: &str,
        x: &Tensor,
    ) -> Result<Tensor> {
        let w = p.get(e, &format!("{prefix}.weight"))?;
        let xf = e.to_dtype(x, DType::F32)?;
        let sq = e.pow(&xf, 2.0)?;
        let var = e.mean(&sq, &[-1], true)?;
        let ve = e.add_scalar(&var, self.cfg.eps)?;
        let r = e.rsqrt(&ve)?;
        let mut h = e.mul(x, &r)?;
        if w.dtype().is_low_precision() {
            h = e.to_dtype(&h, w.dtype())?;
        }
        let mut out = e.mul(&w, &h)?;
        if let Some(d) = p.precision().o2_dtype() {
            out = e.to_dtype(&out, d)?;
        }
        Ok(out)
    }

    /// One attention of layer `a` (`encoder.block.0.layer.0`, ...), as transformers 5.x's
    /// eager T5Attention: scores `q·kᵀ` (no scaling), plus the position bias (out of place,
    /// so under autocast the sum is fp32), plus the additive `mask` if any, softmax, dropout,
    /// `·v`, `o`. Self-attention takes its bias from `relative_attention_bias` (the first
    /// block's, then `bias` as set there; bidirectional buckets in the encoder, causal in the
    /// decoder); cross-attention attends over `kv` with a zero bias in the queries' dtype.
    pub(crate) fn attention(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        (a, kind): (&str, Attention),
        (x, kv): (&Tensor, Option<&Tensor>),
        mask: Option<&Tensor>,
        bias: &mut Option<Tensor>,
    ) -> Result<Tensor> {
        let (b, s) = (x.shape()[0], x.shape()[1]);
        let src = kv.unwrap_or(x);
        let t = src.shape()[1];
        let (h, dk) = (self.cfg.num_heads as isize, self.cfg.d_kv as isize);
        let sa = match kind {
            Attention::Cross => format!("{a}.EncDecAttention"),
            _ => format!("{a}.SelfAttention"),
        };
        let proj = |e: &mut Engine, name: &str, from: &Tensor| -> Result<Tensor> {
            let w = p.get(e, &format!("{sa}.{name}.weight"))?;
            let y = e.scope(name, |e| e.linear(from, &w, None))?;
            let y = e.view(&y, &[b as isize, from.shape()[1] as isize, h, dk])?;
            e.transpose(&y, 1, 2)
        };
        e.push_module(&sa);
        let r = (|| -> Result<Tensor> {
            let q = proj(e, "q", x)?;
            let k = proj(e, "k", src)?;
            let v = proj(e, "v", src)?;
            let kt = e.transpose(&k, 2, 3)?;
            let scores = e.matmul(&q, &kt)?;
            if bias.is_none() {
                *bias = Some(match kind {
                    Attention::Cross => {
                        let z = vec![0.0f32; self.cfg.num_heads * s * t];
                        let z = Tensor::from_f32(z, &[1, self.cfg.num_heads, s, t], q.dtype())?;
                        match q.device() {
                            Some(d) => z.to_device(d)?,
                            None => z,
                        }
                    }
                    _ => {
                        let w = p.get(e, &format!("{sa}.relative_attention_bias.weight"))?;
                        let bidirectional = kind == Attention::Encoder;
                        let ids = Tensor::from_i64(self.buckets(s, t, bidirectional), &[s, t])?;
                        let vals = e.scope("relative_attention_bias", |e| e.embedding(&w, &ids))?;
                        let vals = e.permute(&vals, &[2, 0, 1])?;
                        e.unsqueeze(&vals, 0)?
                    }
                });
            }
            let pb = bias.as_ref().expect("set above");
            let mut scores = e.add(&scores, pb)?;
            if let Some(m) = mask {
                scores = e.add(&scores, m)?;
            }
            let attn = e.softmax(&scores, -1)?;
            let attn = e.scope("dropout", |e| {
                e.dropout(&attn, self.cfg.dropout, self.train, 1)
            })?;
            let ctx = e.matmul(&attn, &v)?;
            let ctx = e.transpose(&ctx, 1, 2)?;
            let ctx = e.reshape(&ctx, &[b as isize, s as isize, h * dk])?;
            let wo = p.get(e, &format!("{sa}.o.weight"))?;
            e.scope("o", |e| e.linear(&ctx, &wo, None))
        })();
        e.pop_module();
        r
    }

    pub(crate) fn feed_forward(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        ff: &str,
        x: &Tensor,
    ) -> Result<Tensor> {
        let d = format!("{ff}.DenseReluDense");
        e.push_module(&d);
        let r = (|| -> Result<Tensor> {
            let mut hidden = match self.cfg.feed_forward {
                FeedForward::Relu => {
                    let wi = p.get(e, &format!("{d}.wi.weight"))?;
                    let a = e.scope("wi", |e| e.linear(x, &wi, None))?;
                    e.scope("act", |e| e.relu(&a))?
                }
                FeedForward::GatedGelu => {
                    let w0 = p.get(e, &format!("{d}.wi_0.weight"))?;
                    let w1 = p.get(e, &format!("{d}.wi_1.weight"))?;
                    let g = e.scope("wi_0", |e| e.linear(x, &w0, None))?;
                    let g = e.scope("act", |e| e.gelu(&g, true))?;
                    let l = e.scope("wi_1", |e| e.linear(x, &w1, None))?;
                    e.mul(&g, &l)?
                }
            };
            hidden = self.dropout(e, &hidden, 2)?;
            let wo = p.get(e, &format!("{d}.wo.weight"))?;
            if hidden.dtype() != wo.dtype() {
                hidden = e.to_dtype(&hidden, wo.dtype())?;
            }
            e.scope("wo", |e| e.linear(&hidden, &wo, None))
        })();
        e.pop_module();
        r
    }

    /// transformers' T5Block clamp: for fp16 hidden states, clamp to ±(65504 − 1000) when
    /// any value is infinite, else to ±65504.
    pub(crate) fn clamp(&self, e: &mut Engine, x: Tensor) -> Result<Tensor> {
        if !self.clamp || x.dtype() != DType::F16 {
            return Ok(x);
        }
        e.clamp_on_inf(&x, 65504.0, 65504.0 - 1000.0)
    }

    /// The encoder's last hidden state for token ids [batch, seq] and their attention mask
    /// (int64 [batch, seq], 0 for padding), if any.
    pub fn encode(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        ids: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
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
        let shared = p.get(e, "shared.weight")?;
        let mut x = e.scope("encoder.embed_tokens", |e| e.embedding(&shared, ids))?;
        x = e.scope("encoder", |e| self.dropout(e, &x, 0))?;
        let mask = match mask {
            Some(m) => Some(e.scope("encoder", |e| extended_mask(e, m, &x))?),
            None => None,
        };
        let mut bias = None;
        for i in 0..self.cfg.num_layers {
            let blk = format!("encoder.block.{i}");
            let a = format!("{blk}.layer.0");
            let n = e.scope(&format!("{a}.layer_norm"), |e| {
                self.layer_norm(e, p, &format!("{a}.layer_norm"), &x)
            })?;
            let att = self.attention(
                e,
                p,
                (&a, Attention::Encoder),
                (&n, None),
                mask.as_ref(),
                &mut bias,
            )?;
            x = e.scope(&a, |e| {
                let att = self.dropout(e, &att, 3)?;
                e.add(&x, &att)
            })?;
            x = e.scope(&blk, |e| self.clamp(e, x))?;
            let ff = format!("{blk}.layer.1");
            let n = e.scope(&format!("{ff}.layer_norm"), |e| {
                self.layer_norm(e, p, &format!("{ff}.layer_norm"), &x)
            })?;
            let y = self.feed_forward(e, p, &ff, &n)?;
            x = e.scope(&ff, |e| {
                let y = self.dropout(e, &y, 4)?;
                e.add(&x, &y)
            })?;
            x = e.scope(&blk, |e| self.clamp(e, x))?;
        }
        let x = e.scope("encoder.final_layer_norm", |e| {
            self.layer_norm(e, p, "encoder.final_layer_norm", &x)
        })?;
        e.scope("encoder", |e| self.dropout(e, &x, 5))
    }
}

/// Loads the weights (f32, f16 or bf16 tensors; fp32 masters either way) from a
/// directory with `model.safetensors` (or a sharded index) or from one file.
///
/// Seeded random weights (normal, std 0.05; norms at 1), for benchmarks.
impl Pretrained for T5Encoder {
    const INIT_KEY: u64 = 0x75;
    const INIT_STD: f64 = 0.05;

    fn param_shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        self.cfg.shapes()
    }

    fn param_total(&self) -> Option<u64> {
        self.cfg.param_count()
    }

    fn canonical_names(&self, mut all: Checkpoint) -> Checkpoint {
        if !all.contains_key("shared.weight") {
            if let Some(t) = all.remove("encoder.embed_tokens.weight") {
                all.insert("shared.weight".into(), t);
            }
        }
        all
    }

    fn tokens(&self) -> (usize, usize) {
        (self.cfg.vocab_size, 128)
    }
}

impl Model for T5Encoder {
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "t5-encoder d_model {} d_ff {} layers {} heads {} d_kv {} vocab {} ({:?}{})",
            c.d_model,
            c.d_ff,
            c.num_layers,
            c.num_heads,
            c.d_kv,
            c.vocab_size,
            c.feed_forward,
            if self.clamp { ", fp16 clamp" } else { "" }
        )
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn set_clamp(&mut self, on: bool) -> bool {
        self.clamp = on;
        true
    }

    fn clamp(&self) -> bool {
        self.clamp
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        refuse_inputs(batch, "t5-encoder", true, false)?;
        check_token_batch(batch, self.cfg.vocab_size)
    }

    /// An attention mask that marks no padding is dropped, as transformers' eager mask is
    /// skipped then.
    fn prepare_batch(&self, batch: Batch) -> Result<Batch> {
        drop_full_mask(batch)
    }

    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let ids = forward_ids(self, batch)?;
        let h = self.encode(e, p, ids, batch.attention_mask.as_ref())?;
        let shared = p.get(e, "shared.weight")?;
        let scale = Some((self.cfg.d_model as f64).powf(-0.5));
        lm_output(e, p, h, (&shared, scale), &batch.labels)
    }
}

/// T5's head and loss: the hidden state `h` (times `scale` when given) through the head
/// weight, the logits cast to fp32 in O2 modes, mean cross-entropy over the labels not -100.
pub(crate) fn lm_output(
    e: &mut Engine,
    p: &ParamAccess<'_>,
    h: Tensor,
    (w, scale): (&Tensor, Option<f64>),
    labels: &Tensor,
) -> Result<Output> {
    let logits = e.scope("lm_head", |e| {
        let hs = match scale {
            Some(s) => e.mul_scalar(&h, s)?,
            None => h.clone(),
        };
        e.linear(&hs, w, None)
    })?;
    let logits = if p.precision().o2_dtype().is_some() {
        e.to_dtype(&logits, DType::F32)?
    } else {
        logits
    };
    let loss = e.scope("loss", |e| e.cross_entropy(&logits, labels, Some(-100)))?;
    Ok(Output {
        loss,
        logits,
        hidden: h,
    })
}
