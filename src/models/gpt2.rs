//! GPT-2 (`GPT2LMHeadModel`) from Hugging Face files (`config.json` + safetensors),
//! mirroring the eager forward of transformers' `modeling_gpt2.py` (5.x) with its casts:
//! token and position embeddings added, LayerNorm before attention and MLP, `Conv1D`
//! projections (`addmm(bias, x, W)` with `W` stored [in, out], computed here as `linear`
//! with `Wᵀ`, one rounding), attention scores `q·kᵀ × scaling` plus the additive causal
//! mask (in the embeddings' dtype, its `finfo.min` above the diagonal: fp32 under autocast,
//! so the masked scores are fp32 there), softmax, `.type(value.dtype)`, and `gelu_new` written out op by op as
//! transformers writes it (`pow` and the ops after it run in fp32 under autocast).
//!
//! transformers' two fp16 switches are honoured from `config.json`:
//! `scale_attn_by_inverse_layer_idx` (scores also divided by layer index + 1) and
//! `reorder_and_upcast_attn` (scores computed in fp32 with autocast off, the scaling folded
//! into the product, as `baddbmm(alpha=scaling)` does).
//!
//! Objective: transformers' `ForCausalLMLoss`: logits (the LM head tied to `wte`) cast to
//! fp32, labels padded with -100 and shifted left by one (done on the host, see
//! [`Model::prepare_batch`]), mean cross-entropy over the labels not ignored.

use super::hf_config::{bool_field, check_size, config_json, prob_field, usize_field};
use super::masks::causal_mask;
use super::pretrained::Pretrained;
use super::tokens::{check_token_batch, forward_ids, refuse_inputs};
use super::weights::Checkpoint;
use super::{Batch, Model, Output, ParamAccess};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::path::Path;

/// Most layers a GPT-2 `config.json` may describe.
pub const MAX_GPT2_LAYERS: usize = 1024;
/// Most parameters a GPT-2 `config.json` may describe (2^36).
pub const MAX_GPT2_PARAMS: u64 = 1 << 36;

/// A GPT-2 architecture, read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Learned positions (the longest sequence).
    pub n_positions: usize,
    /// Hidden width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// MLP width (`n_inner`, default 4 × n_embd).
    pub n_inner: usize,
    /// LayerNorm epsilon.
    pub eps: f64,
    /// Scores scaled by 1/√head_dim.
    pub scale_attn_weights: bool,
    /// Scores also divided by layer index + 1.
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Scores in fp32 with autocast off, scaling folded into the product.
    pub reorder_and_upcast_attn: bool,
    /// Dropout of embeddings, residual branches and attention probabilities.
    pub dropout: (f64, f64, f64),
    /// The MLP's activation (`activation_function`).
    pub activation: Gpt2Activation,
}

/// The GELU formulas transformers' GPT-2 can be configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gpt2Activation {
    /// `gelu_new`: the tanh approximation written out op by op (GPT-2's own).
    GeluNew,
    /// `gelu`: the exact GELU, `x·Φ(x)`, one op.
    Gelu,
    /// `gelu_pytorch_tanh`: the tanh approximation as one op.
    GeluPytorchTanh,
}

impl Gpt2Config {
    /// Reads `config.json`; refuses other model types with a message naming the file.
    pub fn load(path: &Path) -> Result<Gpt2Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Gpt2Config::parse(&text, path)
    }

    /// [`Gpt2Config::load`] of a file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Gpt2Config> {
        let v = config_json(text, path, "gpt2")?;
        let at = path.display();
        let act = v
            .get("activation_function")
            .and_then(|x| x.as_str())
            .unwrap_or("gelu_new");
        let activation = match act {
            "gelu_new" => Gpt2Activation::GeluNew,
            "gelu" => Gpt2Activation::Gelu,
            "gelu_pytorch_tanh" => Gpt2Activation::GeluPytorchTanh,
            _ => {
                return Err(Error::config(
                    format!("{at}: activation_function"),
                    format!(
                        "`{act}` is not supported (expected `gelu_new`, `gelu` or \
                         `gelu_pytorch_tanh`)"
                    ),
                ))
            }
        };
        let flag = |name: &str, default: bool| bool_field(&v, path, name, default);
        let prob = |name: &str| prob_field(&v, path, name, 0.1);
        let n_embd = usize_field(&v, path, "n_embd")?;
        let n_head = usize_field(&v, path, "n_head")?;
        if n_embd % n_head != 0 {
            return Err(Error::config(
                format!("{at}: n_head"),
                format!("{n_head} heads do not divide n_embd {n_embd}"),
            ));
        }
        let n_inner = match v.get("n_inner") {
            None | Some(serde_json::Value::Null) => n_embd
                .checked_mul(4)
                .ok_or_else(|| Error::config(format!("{at}: n_embd"), "too large"))?,
            Some(_) => usize_field(&v, path, "n_inner")?,
        };
        let cfg = Gpt2Config {
            vocab_size: usize_field(&v, path, "vocab_size")?,
            n_positions: usize_field(&v, path, "n_positions")?,
            n_embd,
            n_layer: usize_field(&v, path, "n_layer")?,
            n_head,
            n_inner,
            eps: v
                .get("layer_norm_epsilon")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-5),
            scale_attn_weights: flag("scale_attn_weights", true)?,
            scale_attn_by_inverse_layer_idx: flag("scale_attn_by_inverse_layer_idx", false)?,
            reorder_and_upcast_attn: flag("reorder_and_upcast_attn", false)?,
            dropout: (
                prob("embd_pdrop")?,
                prob("resid_pdrop")?,
                prob("attn_pdrop")?,
            ),
            activation,
        };
        cfg.check_size(path)?;
        Ok(cfg)
    }

    /// The number of parameters, or `None` when it does not fit a `u64`.
    pub fn param_count(&self) -> Option<u64> {
        let (d, f) = (self.n_embd as u64, self.n_inner as u64);
        let attn = (3 * d).checked_mul(d)?.checked_add(3 * d)?;
        let proj = d.checked_mul(d)?.checked_add(d)?;
        let mlp = (2 * d).checked_mul(f)?.checked_add(f + d)?;
        let per_layer = attn
            .checked_add(proj)?
            .checked_add(mlp)?
            .checked_add(4 * d)?;
        (self.vocab_size as u64)
            .checked_add(self.n_positions as u64)?
            .checked_mul(d)?
            .checked_add(per_layer.checked_mul(self.n_layer as u64)?)?
            .checked_add(2 * d)
    }

    fn check_size(&self, path: &Path) -> Result<()> {
        check_size(
            path,
            ("n_layer", self.n_layer, MAX_GPT2_LAYERS),
            self.param_count(),
            MAX_GPT2_PARAMS,
        )
    }

    /// Parameter names (transformers' `GPT2LMHeadModel`), shapes, and whether each is a
    /// LayerNorm parameter.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (d, f) = (self.n_embd, self.n_inner);
        let mut v = vec![
            (
                "transformer.wte.weight".to_string(),
                vec![self.vocab_size, d],
                false,
            ),
            (
                "transformer.wpe.weight".to_string(),
                vec![self.n_positions, d],
                false,
            ),
        ];
        for i in 0..self.n_layer {
            let h = format!("transformer.h.{i}");
            let mut push = |name: &str, shape: Vec<usize>, norm: bool| {
                v.push((format!("{h}.{name}"), shape, norm));
            };
            push("ln_1.weight", vec![d], true);
            push("ln_1.bias", vec![d], true);
            push("attn.c_attn.weight", vec![d, 3 * d], false);
            push("attn.c_attn.bias", vec![3 * d], false);
            push("attn.c_proj.weight", vec![d, d], false);
            push("attn.c_proj.bias", vec![d], false);
            push("ln_2.weight", vec![d], true);
            push("ln_2.bias", vec![d], true);
            push("mlp.c_fc.weight", vec![d, f], false);
            push("mlp.c_fc.bias", vec![f], false);
            push("mlp.c_proj.weight", vec![f, d], false);
            push("mlp.c_proj.bias", vec![d], false);
        }
        v.push(("transformer.ln_f.weight".to_string(), vec![d], true));
        v.push(("transformer.ln_f.bias".to_string(), vec![d], true));
        v
    }
}

/// GPT-2 with its tied LM head and the causal LM loss.
#[derive(Debug, Clone)]
pub struct Gpt2 {
    /// Architecture.
    pub cfg: Gpt2Config,
    /// Whether dropout is applied.
    pub train: bool,
}

impl Gpt2 {
    /// A model in training mode.
    pub fn new(cfg: Gpt2Config) -> Gpt2 {
        Gpt2 { cfg, train: true }
    }

    fn dropout(&self, e: &mut Engine, x: &Tensor, p: f64, salt: u64) -> Result<Tensor> {
        e.scope("dropout", |e| e.dropout(x, p, self.train, salt))
    }

    /// `Conv1D`: `addmm(bias, x.view(-1, in), W).view(..., out)` with `W` [in, out].
    fn conv1d(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        name: &str,
        x: &Tensor,
    ) -> Result<Tensor> {
        let w = p.get(e, &format!("{name}.weight"))?;
        let b = p.get(e, &format!("{name}.bias"))?;
        e.scope(name, |e| {
            let nx = x.shape()[x.rank() - 1] as isize;
            let mut size_out: Vec<isize> = x.shape().iter().map(|&d| d as isize).collect();
            *size_out.last_mut().expect("rank >= 1") = w.shape()[1] as isize;
            let x2 = e.view(x, &[-1, nx])?;
            let y = e.addmm(&b, &x2, &w)?;
            e.view(&y, &size_out)
        })
    }

    fn attention(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        layer: usize,
        x: &Tensor,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (b, s, d) = (x.shape()[0], x.shape()[1], self.cfg.n_embd);
        let (h, hd) = (self.cfg.n_head, self.cfg.n_embd / self.cfg.n_head);
        let name = format!("transformer.h.{layer}.attn");
        let qkv = self.conv1d(e, p, &format!("{name}.c_attn"), x)?;
        e.push_module(&name);
        let r = (|| -> Result<Tensor> {
            let heads = |e: &mut Engine, i: usize| -> Result<Tensor> {
                let t = e.slice(&qkv, 2, (i * d) as isize, ((i + 1) * d) as isize)?;
                let t = e.view(&t, &[b as isize, s as isize, h as isize, hd as isize])?;
                e.transpose(&t, 1, 2)
            };
            let (q, k, v) = (heads(e, 0)?, heads(e, 1)?, heads(e, 2)?);
            let mut scaling = 1.0f64;
            if self.cfg.scale_attn_weights {
                scaling = (hd as f64).powf(-0.5);
            }
            if self.cfg.scale_attn_by_inverse_layer_idx {
                scaling /= (layer + 1) as f64;
            }
            let kt = e.transpose(&k, 3, 2)?;
            let scores = if self.cfg.reorder_and_upcast_attn {
                e.autocast_off(|e| {
                    let qf = e.to_dtype(&q, DType::F32)?;
                    let kf = e.to_dtype(&kt, DType::F32)?;
                    let prod = e.matmul(&qf, &kf)?;
                    e.mul_scalar(&prod, scaling)
                })?
            } else {
                let prod = e.matmul(&q, &kt)?;
                e.mul_scalar(&prod, scaling)?
            };
            let scores = e.add(&scores, mask)?;
            let probs = e.softmax(&scores, -1)?;
            let probs = e.to_dtype(&probs, v.dtype())?;
            let probs = e.scope("attn_dropout", |e| {
                e.dropout(&probs, self.cfg.dropout.2, self.train, 1)
            })?;
            let ctx = e.matmul(&probs, &v)?;
            let ctx = e.transpose(&ctx, 1, 2)?;
            e.reshape(&ctx, &[b as isize, s as isize, d as isize])
        })();
        e.pop_module();
        let ctx = r?;
        let out = self.conv1d(e, p, &format!("{name}.c_proj"), &ctx)?;
        e.scope(&name, |e| {
            e.scope("resid_dropout", |e| {
                e.dropout(&out, self.cfg.dropout.1, self.train, 2)
            })
        })
    }

    /// transformers' `NewGELUActivation`, op by op:
    /// `0.5 * x * (1 + tanh(√(2/π) * (x + 0.044715 * x³)))`.
    fn gelu_new(&self, e: &mut Engine, x: &Tensor) -> Result<Tensor> {
        let half = e.mul_scalar(x, 0.5)?;
        let cube = e.pow(x, 3.0)?;
        let c = e.mul_scalar(&cube, 0.044715)?;
        let inner = e.add(x, &c)?;
        let inner = e.mul_scalar(&inner, (2.0 / std::f64::consts::PI).sqrt())?;
        let t = e.tanh(&inner)?;
        let t = e.add_scalar(&t, 1.0)?;
        e.mul(&half, &t)
    }

    fn mlp(&self, e: &mut Engine, p: &ParamAccess<'_>, layer: usize, x: &Tensor) -> Result<Tensor> {
        let name = format!("transformer.h.{layer}.mlp");
        let h = self.conv1d(e, p, &format!("{name}.c_fc"), x)?;
        let h = e.scope(&format!("{name}.act"), |e| match self.cfg.activation {
            Gpt2Activation::GeluNew => self.gelu_new(e, &h),
            Gpt2Activation::Gelu => e.gelu(&h, false),
            Gpt2Activation::GeluPytorchTanh => e.gelu(&h, true),
        })?;
        let h = self.conv1d(e, p, &format!("{name}.c_proj"), &h)?;
        e.scope(&name, |e| self.dropout(e, &h, self.cfg.dropout.1, 3))
    }

    /// The last hidden state (after `ln_f`) for token ids [batch, seq].
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
        if s > self.cfg.n_positions {
            return Err(Error::tensor(
                "input_ids",
                format!(
                    "a sequence of {s} is longer than the model's {} positions",
                    self.cfg.n_positions
                ),
            ));
        }
        let wte = p.get(e, "transformer.wte.weight")?;
        let wpe = p.get(e, "transformer.wpe.weight")?;
        let positions = Tensor::from_i64((0..s as i64).collect(), &[1, s])?;
        let tok = e.scope("transformer.wte", |e| e.embedding(&wte, ids))?;
        let pos = e.scope("transformer.wpe", |e| e.embedding(&wpe, &positions))?;
        let mut x = e.scope("transformer", |e| {
            let x = e.add(&tok, &pos)?;
            e.scope("drop", |e| e.dropout(&x, self.cfg.dropout.0, self.train, 0))
        })?;
        let mask = causal_mask(e, s, &x)?;
        for i in 0..self.cfg.n_layer {
            let blk = format!("transformer.h.{i}");
            let n = p.layer_norm(
                e,
                &format!("{blk}.ln_1"),
                &x,
                (self.cfg.n_embd, self.cfg.eps),
            )?;
            let a = self.attention(e, p, i, &n, &mask)?;
            x = e.scope(&blk, |e| e.add(&a, &x))?;
            let n = p.layer_norm(
                e,
                &format!("{blk}.ln_2"),
                &x,
                (self.cfg.n_embd, self.cfg.eps),
            )?;
            let m = self.mlp(e, p, i, &n)?;
            x = e.scope(&blk, |e| e.add(&x, &m))?;
        }
        p.layer_norm(e, "transformer.ln_f", &x, (self.cfg.n_embd, self.cfg.eps))
    }
}

/// Labels as transformers' `ForCausalLMLoss` uses them: padded with -100 on the right and
/// shifted left by one, so position t is scored against token t + 1.
pub(crate) fn causal_lm_labels(batch: Batch) -> Result<Batch> {
    let shape = batch.labels.shape().to_vec();
    if batch.labels.dtype() != DType::I64 || shape.len() != 2 {
        return Err(Error::tensor(
            "labels",
            format!(
                "expected int64 [batch, seq], got {} {shape:?}",
                batch.labels.dtype()
            ),
        ));
    }
    let (rows, s) = (shape[0], shape[1]);
    if s == 0 {
        return Err(Error::tensor(
            "labels",
            "a sequence needs at least one token",
        ));
    }
    let l = batch.labels.i64s()?;
    let mut shifted = Vec::with_capacity(rows * s);
    for r in 0..rows {
        shifted.extend_from_slice(&l[r * s + 1..(r + 1) * s]);
        shifted.push(-100);
    }
    Ok(Batch {
        labels: Tensor::from_i64(shifted, &shape)?,
        ..batch
    })
}

/// The LM head (`h · wᵀ`) and transformers' `ForCausalLMLoss` on labels already shifted
/// ([`causal_lm_labels`]): the logits cast to fp32, mean cross-entropy ignoring -100.
pub(crate) fn causal_lm_output(
    e: &mut Engine,
    h: Tensor,
    w: &Tensor,
    labels: &Tensor,
) -> Result<Output> {
    let logits = e.scope("lm_head", |e| e.linear(&h, w, None))?;
    let loss = e.scope("loss", |e| {
        let lf = e.to_dtype(&logits, DType::F32)?;
        e.cross_entropy(&lf, labels, Some(-100))
    })?;
    Ok(Output {
        loss,
        logits,
        hidden: h,
    })
}

/// Loads the weights (f32, f16 or bf16; fp32 masters) from a directory with
/// `model.safetensors` (or a sharded index) or from one file. Names may carry
/// transformers' `transformer.` prefix or not (the original checkpoints have none);
/// the causal-mask buffers of old checkpoints (`attn.bias`, `attn.masked_bias`) and a
/// saved `lm_head.weight` (tied to `wte`) are not parameters.
///
/// Seeded random weights as transformers initialises GPT-2 (normal, std 0.02; biases
/// 0; LayerNorm weights 1), for benchmarks.
impl Pretrained for Gpt2 {
    const INIT_KEY: u64 = 0x6770_7432;
    const INIT_STD: f64 = 0.02;

    fn param_shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        self.cfg.shapes()
    }

    fn param_total(&self) -> Option<u64> {
        self.cfg.param_count()
    }

    fn canonical_names(&self, all: Checkpoint) -> Checkpoint {
        all.into_iter()
            .map(|(k, t)| {
                if k.starts_with("transformer.") || k.starts_with("lm_head.") {
                    (k, t)
                } else {
                    (format!("transformer.{k}"), t)
                }
            })
            .collect()
    }

    fn tokens(&self) -> (usize, usize) {
        (self.cfg.vocab_size, self.cfg.n_positions.min(64))
    }
}

impl Model for Gpt2 {
    fn describe(&self) -> String {
        let c = &self.cfg;
        let mut s = format!(
            "gpt2 n_embd {} n_inner {} layers {} heads {} vocab {} positions {}",
            c.n_embd, c.n_inner, c.n_layer, c.n_head, c.vocab_size, c.n_positions
        );
        if c.scale_attn_by_inverse_layer_idx {
            s.push_str(", scale_attn_by_inverse_layer_idx");
        }
        if c.reorder_and_upcast_attn {
            s.push_str(", reorder_and_upcast_attn");
        }
        s
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn fp16_switches(&self) -> Vec<(&'static str, &'static str)> {
        vec![
            (
                "reorder_and_upcast_attn",
                "attention scores in fp32 with autocast off, the scaling folded into the product",
            ),
            (
                "scale_attn_by_inverse_layer_idx",
                "attention scores also divided by the layer index + 1",
            ),
        ]
    }

    fn set_switch(&mut self, name: &str, on: bool) -> bool {
        match name {
            "reorder_and_upcast_attn" => self.cfg.reorder_and_upcast_attn = on,
            "scale_attn_by_inverse_layer_idx" => self.cfg.scale_attn_by_inverse_layer_idx = on,
            _ => return false,
        }
        true
    }

    fn switch(&self, name: &str) -> bool {
        match name {
            "reorder_and_upcast_attn" => self.cfg.reorder_and_upcast_attn,
            "scale_attn_by_inverse_layer_idx" => self.cfg.scale_attn_by_inverse_layer_idx,
            _ => false,
        }
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        refuse_inputs(batch, "gpt2", false, false)?;
        check_token_batch(batch, self.cfg.vocab_size)
    }

    /// Labels as `ForCausalLMLoss` uses them ([`causal_lm_labels`]).
    fn prepare_batch(&self, batch: Batch) -> Result<Batch> {
        causal_lm_labels(batch)
    }

    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let h = self.hidden(e, p, forward_ids(self, batch)?)?;
        let wte = p.get(e, "transformer.wte.weight")?;
        causal_lm_output(e, h, &wte, &batch.labels)
    }
}
