//! The full T5 (`T5ForConditionalGeneration`) from Hugging Face files: the encoder of
//! [`T5Encoder`] and the decoder of transformers 5.x's eager `modeling_t5.py`: per block a
//! causal self-attention (causal relative-position buckets from the first block's
//! `relative_attention_bias`, plus the additive causal mask in the decoder embeddings'
//! dtype), a cross-attention over the encoder output (a zero position bias in the queries'
//! dtype, plus the encoder's padding mask in the encoder output's dtype), the feed-forward,
//! each pre-norm with a residual add and, with `--t5-clamp`, transformers' fp16 clamp after
//! it.
//!
//! Objective: teacher-forced cross-entropy of the decoder's logits against `labels` (-100
//! ignored), the decoder inputs being the labels shifted right (the start token first,
//! -100 replaced by the padding id) unless `decoder_input_ids` are given. The head is
//! `lm_head` when `tie_word_embeddings` is false (T5 v1.1, flan-T5), else the shared
//! embedding; the decoder output is scaled by d_model^-0.5 first when
//! `scale_decoder_outputs` (default: the head is tied) says so.

use super::hf_config::{bool_field, config_json};
use super::masks::{causal_mask, extended_mask};
use super::pretrained::Pretrained;
use super::t5::{lm_output, Attention, T5Config, T5Encoder};
use super::tokens::{check_ids, drop_full_mask, forward_ids};
use super::weights::Checkpoint;
use super::{Batch, Model, Output, ParamAccess};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::path::Path;

/// What the full model adds to a T5 config.
#[derive(Debug, Clone, PartialEq)]
pub struct Seq2SeqConfig {
    /// Decoder blocks (`num_decoder_layers`, default `num_layers`).
    pub num_decoder_layers: usize,
    /// The head is the shared embedding (`tie_word_embeddings`, default true).
    pub tied_head: bool,
    /// The decoder output is scaled by d_model^-0.5 before the head.
    pub scale_decoder_outputs: bool,
    /// The first decoder input (`decoder_start_token_id`, default 0).
    pub decoder_start_token_id: i64,
    /// What -100 labels become in the decoder inputs (`pad_token_id`, default 0).
    pub pad_token_id: i64,
}

impl Seq2SeqConfig {
    /// Reads the decoder's fields of a T5 `config.json` (`path` names it in errors).
    pub fn parse(text: &str, path: &Path, enc: &T5Config) -> Result<Seq2SeqConfig> {
        let v = config_json(text, path, "t5")?;
        let id = |name: &str| -> Result<i64> {
            match v.get(name) {
                None | Some(serde_json::Value::Null) => Ok(0),
                Some(x) => match x.as_i64() {
                    Some(i) if i >= 0 && (i as u64) < enc.vocab_size as u64 => Ok(i),
                    _ => Err(Error::config(
                        format!("{}: {name}", path.display()),
                        format!("{x} is not an id of the vocabulary of {}", enc.vocab_size),
                    )),
                },
            }
        };
        let num_decoder_layers = match v.get("num_decoder_layers") {
            None | Some(serde_json::Value::Null) => enc.num_layers,
            Some(_) => super::hf_config::usize_field(&v, path, "num_decoder_layers")?,
        };
        if num_decoder_layers > super::t5::MAX_T5_LAYERS {
            return Err(Error::config(
                format!("{}: num_decoder_layers", path.display()),
                format!(
                    "{num_decoder_layers} layers; at most {} are supported",
                    super::t5::MAX_T5_LAYERS
                ),
            ));
        }
        let tied_head = bool_field(&v, path, "tie_word_embeddings", true)?;
        Ok(Seq2SeqConfig {
            num_decoder_layers,
            tied_head,
            scale_decoder_outputs: bool_field(&v, path, "scale_decoder_outputs", tied_head)?,
            decoder_start_token_id: id("decoder_start_token_id")?,
            pad_token_id: id("pad_token_id")?,
        })
    }
}

/// `T5ForConditionalGeneration`: encoder, decoder, LM head and the seq2seq loss.
#[derive(Debug, Clone)]
pub struct T5Seq2Seq {
    /// The encoder (its config, clamp and training flag are the whole model's).
    pub enc: T5Encoder,
    /// The decoder's settings.
    pub dec: Seq2SeqConfig,
}

impl T5Seq2Seq {
    /// Reads `config.json`.
    pub fn load_config(path: &Path) -> Result<T5Seq2Seq> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        T5Seq2Seq::parse_config(&text, path)
    }

    /// [`T5Seq2Seq::load_config`] of a file's text; `path` names it in errors.
    pub fn parse_config(text: &str, path: &Path) -> Result<T5Seq2Seq> {
        let cfg = T5Config::parse(text, path)?;
        let dec = Seq2SeqConfig::parse(text, path, &cfg)?;
        let m = T5Seq2Seq {
            enc: T5Encoder::new(cfg),
            dec,
        };
        let max = super::t5::MAX_T5_PARAMS;
        match m.param_count() {
            Some(n) if n <= max => Ok(m),
            n => Err(Error::config(
                path.display().to_string(),
                format!(
                    "the model it describes has {} parameters; at most {max} are supported",
                    n.map_or("more than 2^64".to_string(), |n| n.to_string())
                ),
            )),
        }
    }

    /// The number of parameters, or `None` when it does not fit a `u64`.
    pub fn param_count(&self) -> Option<u64> {
        let c = &self.enc.cfg;
        let (d, f, inner) = (
            c.d_model as u64,
            c.d_ff as u64,
            (c.num_heads as u64).checked_mul(c.d_kv as u64)?,
        );
        let ff = match c.feed_forward {
            super::t5::FeedForward::Relu => 2,
            super::t5::FeedForward::GatedGelu => 3,
        };
        let per_layer = (8 * inner)
            .checked_mul(d)?
            .checked_add((ff * f).checked_mul(d)?)?
            .checked_add(3 * d)?;
        let head = if self.dec.tied_head {
            0
        } else {
            (c.vocab_size as u64).checked_mul(d)?
        };
        self.enc
            .cfg
            .param_count()?
            .checked_add(per_layer.checked_mul(self.dec.num_decoder_layers as u64)?)?
            .checked_add((c.num_buckets as u64).checked_mul(c.num_heads as u64)?)?
            .checked_add(d)?
            .checked_add(head)
    }

    /// Parameter names (transformers' `T5ForConditionalGeneration`), shapes, and whether
    /// each is a norm weight.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        let c = &self.enc.cfg;
        let (d, f, inner) = (c.d_model, c.d_ff, c.num_heads * c.d_kv);
        let mut v = self.enc.cfg.shapes();
        let mut push = |name: String, shape: Vec<usize>, norm: bool| v.push((name, shape, norm));
        for i in 0..self.dec.num_decoder_layers {
            let blk = format!("decoder.block.{i}");
            for (layer, attn) in [(0, "SelfAttention"), (1, "EncDecAttention")] {
                let a = format!("{blk}.layer.{layer}.{attn}");
                for p in ["q", "k", "v"] {
                    push(format!("{a}.{p}.weight"), vec![inner, d], false);
                }
                push(format!("{a}.o.weight"), vec![d, inner], false);
                if i == 0 && layer == 0 {
                    push(
                        format!("{a}.relative_attention_bias.weight"),
                        vec![c.num_buckets, c.num_heads],
                        false,
                    );
                }
                push(
                    format!("{blk}.layer.{layer}.layer_norm.weight"),
                    vec![d],
                    true,
                );
            }
            let ff = format!("{blk}.layer.2");
            match c.feed_forward {
                super::t5::FeedForward::Relu => {
                    push(format!("{ff}.DenseReluDense.wi.weight"), vec![f, d], false)
                }
                super::t5::FeedForward::GatedGelu => {
                    push(
                        format!("{ff}.DenseReluDense.wi_0.weight"),
                        vec![f, d],
                        false,
                    );
                    push(
                        format!("{ff}.DenseReluDense.wi_1.weight"),
                        vec![f, d],
                        false,
                    );
                }
            }
            push(format!("{ff}.DenseReluDense.wo.weight"), vec![d, f], false);
            push(format!("{ff}.layer_norm.weight"), vec![d], true);
        }
        push("decoder.final_layer_norm.weight".into(), vec![d], true);
        if !self.dec.tied_head {
            push("lm_head.weight".into(), vec![c.vocab_size, d], false);
        }
        v
    }

    /// The decoder's last hidden state for decoder inputs [batch, target] over the encoder
    /// output `enc` [batch, seq, d_model] and the encoder's attention mask.
    pub fn decode(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        ids: &Tensor,
        enc: &Tensor,
        enc_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let m = &self.enc;
        let shared = p.get(e, "shared.weight")?;
        let mut x = e.scope("decoder.embed_tokens", |e| e.embedding(&shared, ids))?;
        x = e.scope("decoder", |e| {
            e.scope("dropout", |e| e.dropout(&x, m.cfg.dropout, m.train, 0))
        })?;
        let causal = causal_mask(e, ids.shape()[1], &x)?;
        let cross_mask = match enc_mask {
            Some(mk) => Some(e.scope("decoder", |e| extended_mask(e, mk, enc))?),
            None => None,
        };
        let (mut self_bias, mut cross_bias) = (None, None);
        for i in 0..self.dec.num_decoder_layers {
            let blk = format!("decoder.block.{i}");
            for (layer, kind) in [(0, Attention::Decoder), (1, Attention::Cross)] {
                let a = format!("{blk}.layer.{layer}");
                let n = e.scope(&format!("{a}.layer_norm"), |e| {
                    m.layer_norm(e, p, &format!("{a}.layer_norm"), &x)
                })?;
                let att = match kind {
                    Attention::Cross => m.attention(
                        e,
                        p,
                        (&a, kind),
                        (&n, Some(enc)),
                        cross_mask.as_ref(),
                        &mut cross_bias,
                    )?,
                    _ => {
                        m.attention(e, p, (&a, kind), (&n, None), Some(&causal), &mut self_bias)?
                    }
                };
                x = e.scope(&a, |e| {
                    let att = e.scope("dropout", |e| {
                        e.dropout(&att, m.cfg.dropout, m.train, 3 + layer as u64)
                    })?;
                    e.add(&x, &att)
                })?;
                x = e.scope(&blk, |e| m.clamp(e, x))?;
            }
            let ff = format!("{blk}.layer.2");
            let n = e.scope(&format!("{ff}.layer_norm"), |e| {
                m.layer_norm(e, p, &format!("{ff}.layer_norm"), &x)
            })?;
            let y = m.feed_forward(e, p, &ff, &n)?;
            x = e.scope(&ff, |e| {
                let y = e.scope("dropout", |e| e.dropout(&y, m.cfg.dropout, m.train, 5))?;
                e.add(&x, &y)
            })?;
            x = e.scope(&blk, |e| m.clamp(e, x))?;
        }
        let x = e.scope("decoder.final_layer_norm", |e| {
            m.layer_norm(e, p, "decoder.final_layer_norm", &x)
        })?;
        e.scope("decoder", |e| {
            e.scope("dropout", |e| e.dropout(&x, m.cfg.dropout, m.train, 6))
        })
    }
}

/// transformers' `_shift_right`: the start token, then the labels but the last, -100
/// replaced by the padding id.
pub fn shift_right(labels: &Tensor, start: i64, pad: i64) -> Result<Tensor> {
    let shape = labels.shape().to_vec();
    if labels.dtype() != DType::I64 || shape.len() != 2 {
        return Err(Error::tensor(
            "labels",
            format!(
                "expected int64 [batch, target], got {} {shape:?}",
                labels.dtype()
            ),
        ));
    }
    let (rows, t) = (shape[0], shape[1]);
    let l = labels.i64s()?;
    let mut out = Vec::with_capacity(rows * t);
    for r in 0..rows {
        if t > 0 {
            out.push(start);
            out.extend(
                l[r * t..(r + 1) * t - 1]
                    .iter()
                    .map(|&x| if x == -100 { pad } else { x }),
            );
        }
    }
    Tensor::from_i64(out, &shape)
}

/// Loads the weights (f32, f16 or bf16; fp32 masters) from a directory with
/// `model.safetensors` (or a sharded index) or from one file; the embedding may be
/// saved as `shared.weight` or as either stack's `embed_tokens.weight`.
///
/// Seeded random weights (normal, std 0.05; norms at 1), for benchmarks.
impl Pretrained for T5Seq2Seq {
    const INIT_KEY: u64 = 0x7535_7332;
    const INIT_STD: f64 = 0.05;

    fn param_shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        self.shapes()
    }

    fn param_total(&self) -> Option<u64> {
        self.param_count()
    }

    fn canonical_names(&self, mut all: Checkpoint) -> Checkpoint {
        for alias in ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] {
            if !all.contains_key("shared.weight") {
                if let Some(t) = all.remove(alias) {
                    all.insert("shared.weight".into(), t);
                }
            }
        }
        all
    }

    fn tokens(&self) -> (usize, usize) {
        (self.enc.cfg.vocab_size, 64)
    }
}

impl Model for T5Seq2Seq {
    fn describe(&self) -> String {
        let c = &self.enc.cfg;
        format!(
            "t5 d_model {} d_ff {} layers {} + {} heads {} d_kv {} vocab {} ({:?}, {} head{})",
            c.d_model,
            c.d_ff,
            c.num_layers,
            self.dec.num_decoder_layers,
            c.num_heads,
            c.d_kv,
            c.vocab_size,
            c.feed_forward,
            if self.dec.tied_head { "tied" } else { "untied" },
            if self.enc.clamp { ", fp16 clamp" } else { "" }
        )
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn set_clamp(&mut self, on: bool) -> bool {
        self.enc.clamp = on;
        true
    }

    fn clamp(&self) -> bool {
        self.enc.clamp
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        let v = self.enc.cfg.vocab_size;
        check_ids("input_ids", &batch.inputs, v)?;
        if batch.token_type_ids.is_some() {
            return Err(Error::tensor("token_type_ids", "t5 takes no token types"));
        }
        crate::ops::loss::check_labels(&batch.labels, v, Some(-100))?;
        if let Some(d) = &batch.decoder_input_ids {
            check_ids("decoder_input_ids", d, v)?;
        }
        Ok(())
    }

    /// Decoder inputs from the labels (shifted right) unless given, and an attention mask
    /// that marks no padding dropped.
    fn prepare_batch(&self, mut batch: Batch) -> Result<Batch> {
        if batch.decoder_input_ids.is_none() {
            batch.decoder_input_ids = Some(shift_right(
                &batch.labels,
                self.dec.decoder_start_token_id,
                self.dec.pad_token_id,
            )?);
        }
        drop_full_mask(batch)
    }

    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let ids = forward_ids(self, batch)?;
        let dec_ids = batch.decoder_input_ids.as_ref().ok_or_else(|| {
            Error::tensor(
                "decoder_input_ids",
                "missing (made from the labels when the batch is prepared)",
            )
        })?;
        let mask = batch.attention_mask.as_ref();
        let enc = self.enc.encode(e, p, ids, mask)?;
        let h = self.decode(e, p, dec_ids, &enc, mask)?;
        let w = if self.dec.tied_head {
            p.get(e, "shared.weight")?
        } else {
            p.get(e, "lm_head.weight")?
        };
        let scale = self
            .dec
            .scale_decoder_outputs
            .then(|| (self.enc.cfg.d_model as f64).powf(-0.5));
        lm_output(e, p, h, (&w, scale), &batch.labels)
    }
}
