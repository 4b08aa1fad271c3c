//! BERT (`BertForMaskedLM`) from Hugging Face files (`config.json` + safetensors),
//! mirroring the eager forward of transformers' `modeling_bert.py` (5.x) with its casts:
//! word (with `padding_idx`), token-type and absolute position embeddings added in that
//! order, LayerNorm and dropout; post-LN blocks (attention, then `dense → dropout →
//! LayerNorm(h + input)`, the exact-erf GELU MLP likewise); attention scores
//! `q·kᵀ × 1/√head_dim` plus the extended attention mask, softmax, dropout, `·v`.
//!
//! The extended mask is transformers' eager mask: `where(mask, 0, finfo.min)` in the
//! embeddings' dtype (fp32 under autocast, so the masked scores are fp32 there; fp16 in a
//! pure-fp16 model, where a padded score is −65504 plus the score). As transformers does,
//! no mask is added when `attention_mask` marks no padding (or is not given).
//!
//! Objective: the MLM head (`transform`: dense, GELU, LayerNorm; `decoder`: tied to the
//! word embeddings, with the bias `cls.predictions.bias`) and `CrossEntropyLoss` over the
//! labels not -100 (no fp32 upcast of the scores in transformers; autocast runs the loss
//! in fp32).

use super::hf_config::{bool_field, check_size, config_json, prob_field, usize_field};
use super::masks::extended_mask;
use super::pretrained::Pretrained;
use super::tokens::{check_ids, check_token_batch, drop_full_mask, forward_ids};
use super::weights::Checkpoint;
use super::{Batch, Model, Output, ParamAccess};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::path::Path;

/// Most layers a BERT `config.json` may describe.
pub const MAX_BERT_LAYERS: usize = 1024;
/// Most parameters a BERT `config.json` may describe (2^36).
pub const MAX_BERT_PARAMS: u64 = 1 << 36;

/// A BERT architecture, read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Learned positions (the longest sequence).
    pub max_positions: usize,
    /// Token types (segments).
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub eps: f64,
    /// The word embeddings' `padding_idx` (its row gets no gradient), if any.
    pub pad_token_id: Option<i64>,
    /// Dropout of embeddings and residual branches, and of attention probabilities.
    pub dropout: (f64, f64),
}

impl BertConfig {
    /// Reads `config.json`; refuses other model types with a message naming the file.
    pub fn load(path: &Path) -> Result<BertConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        BertConfig::parse(&text, path)
    }

    /// [`BertConfig::load`] of a file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<BertConfig> {
        let v = config_json(text, path, "bert")?;
        let at = path.display();
        let text_field = |name: &str, default: &str, want: &str| -> Result<()> {
            let got = v.get(name).and_then(|x| x.as_str()).unwrap_or(default);
            if got != want {
                return Err(Error::config(
                    format!("{at}: {name}"),
                    format!("`{got}` is not supported (expected `{want}`)"),
                ));
            }
            Ok(())
        };
        text_field("hidden_act", "gelu", "gelu")?;
        text_field("position_embedding_type", "absolute", "absolute")?;
        for name in ["is_decoder", "add_cross_attention"] {
            if bool_field(&v, path, name, false)? {
                return Err(Error::config(
                    format!("{at}: {name}"),
                    "a decoder BERT is not supported (BertForMaskedLM is an encoder)",
                ));
            }
        }
        let hidden_size = usize_field(&v, path, "hidden_size")?;
        let num_heads = usize_field(&v, path, "num_attention_heads")?;
        if hidden_size % num_heads != 0 {
            return Err(Error::config(
                format!("{at}: num_attention_heads"),
                format!("{num_heads} heads do not divide hidden_size {hidden_size}"),
            ));
        }
        let vocab_size = usize_field(&v, path, "vocab_size")?;
        let pad_token_id = match v.get("pad_token_id") {
            None => Some(0),
            Some(serde_json::Value::Null) => None,
            Some(x) => match x.as_i64() {
                Some(p) if p >= 0 && (p as u64) < vocab_size as u64 => Some(p),
                _ => {
                    return Err(Error::config(
                        format!("{at}: pad_token_id"),
                        format!("{x} is not an id of the vocabulary of {vocab_size}"),
                    ))
                }
            },
        };
        let cfg = BertConfig {
            vocab_size,
            hidden_size,
            num_layers: usize_field(&v, path, "num_hidden_layers")?,
            num_heads,
            intermediate_size: usize_field(&v, path, "intermediate_size")?,
            max_positions: usize_field(&v, path, "max_position_embeddings")?,
            type_vocab_size: match v.get("type_vocab_size") {
                None | Some(serde_json::Value::Null) => 2,
                Some(_) => usize_field(&v, path, "type_vocab_size")?,
            },
            eps: v
                .get("layer_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-12),
            pad_token_id,
            dropout: (
                prob_field(&v, path, "hidden_dropout_prob", 0.1)?,
                prob_field(&v, path, "attention_probs_dropout_prob", 0.1)?,
            ),
        };
        cfg.check_size(path)?;
        Ok(cfg)
    }

    /// The number of parameters, or `None` when it does not fit a `u64`.
    pub fn param_count(&self) -> Option<u64> {
        let (d, f) = (self.hidden_size as u64, self.intermediate_size as u64);
        let attn = (4 * d).checked_mul(d)?.checked_add(4 * d)?;
        let mlp = (2 * d).checked_mul(f)?.checked_add(f + d)?;
        let per_layer = attn.checked_add(mlp)?.checked_add(4 * d)?;
        let rows = (self.vocab_size as u64)
            .checked_add(self.max_positions as u64)?
            .checked_add(self.type_vocab_size as u64)?;
        rows.checked_mul(d)?
            .checked_add(2 * d)?
            .checked_add(per_layer.checked_mul(self.num_layers as u64)?)?
            .checked_add(d.checked_mul(d)?.checked_add(3 * d)?)?
            .checked_add(self.vocab_size as u64)
    }

    fn check_size(&self, path: &Path) -> Result<()> {
        check_size(
            path,
            ("num_hidden_layers", self.num_layers, MAX_BERT_LAYERS),
            self.param_count(),
            MAX_BERT_PARAMS,
        )
    }

    /// Parameter names (transformers' `BertForMaskedLM`), shapes, and whether each is a
    /// LayerNorm parameter.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let mut v = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, norm: bool| v.push((name, shape, norm));
        let emb = "bert.embeddings";
        push(
            format!("{emb}.word_embeddings.weight"),
            vec![self.vocab_size, d],
            false,
        );
        push(
            format!("{emb}.position_embeddings.weight"),
            vec![self.max_positions, d],
            false,
        );
        push(
            format!("{emb}.token_type_embeddings.weight"),
            vec![self.type_vocab_size, d],
            false,
        );
        push(format!("{emb}.LayerNorm.weight"), vec![d], true);
        push(format!("{emb}.LayerNorm.bias"), vec![d], true);
        for i in 0..self.num_layers {
            let l = format!("bert.encoder.layer.{i}");
            for m in ["query", "key", "value"] {
                push(format!("{l}.attention.self.{m}.weight"), vec![d, d], false);
                push(format!("{l}.attention.self.{m}.bias"), vec![d], false);
            }
            push(
                format!("{l}.attention.output.dense.weight"),
                vec![d, d],
                false,
            );
            push(format!("{l}.attention.output.dense.bias"), vec![d], false);
            push(
                format!("{l}.attention.output.LayerNorm.weight"),
                vec![d],
                true,
            );
            push(
                format!("{l}.attention.output.LayerNorm.bias"),
                vec![d],
                true,
            );
            push(format!("{l}.intermediate.dense.weight"), vec![f, d], false);
            push(format!("{l}.intermediate.dense.bias"), vec![f], false);
            push(format!("{l}.output.dense.weight"), vec![d, f], false);
            push(format!("{l}.output.dense.bias"), vec![d], false);
            push(format!("{l}.output.LayerNorm.weight"), vec![d], true);
            push(format!("{l}.output.LayerNorm.bias"), vec![d], true);
        }
        push("cls.predictions.bias".into(), vec![self.vocab_size], false);
        let t = "cls.predictions.transform";
        push(format!("{t}.dense.weight"), vec![d, d], false);
        push(format!("{t}.dense.bias"), vec![d], false);
        push(format!("{t}.LayerNorm.weight"), vec![d], true);
        push(format!("{t}.LayerNorm.bias"), vec![d], true);
        v
    }
}

/// BERT with its masked-LM head.
#[derive(Debug, Clone)]
pub struct Bert {
    /// Architecture.
    pub cfg: BertConfig,
    /// Whether dropout is applied.
    pub train: bool,
}

impl Bert {
    /// A model in training mode.
    pub fn new(cfg: BertConfig) -> Bert {
        Bert { cfg, train: true }
    }

    /// LayerNorm's width and epsilon.
    fn norm(&self) -> (usize, f64) {
        (self.cfg.hidden_size, self.cfg.eps)
    }

    /// `dense → dropout → LayerNorm(h + input)` of `BertSelfOutput` / `BertOutput`.
    fn add_norm(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        name: &str,
        h: &Tensor,
        input: &Tensor,
    ) -> Result<Tensor> {
        let h = p.linear(e, &format!("{name}.dense"), h, true)?;
        let h = e.scope(name, |e| {
            let h = e.scope("dropout", |e| {
                e.dropout(&h, self.cfg.dropout.0, self.train, 0)
            })?;
            e.add(&h, input)
        })?;
        p.layer_norm(e, &format!("{name}.LayerNorm"), &h, self.norm())
    }

    fn self_attention(
        &self,
        e: &mut Engine,
        p: &ParamAccess<'_>,
        name: &str,
        x: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, s, d) = (x.shape()[0], x.shape()[1], self.cfg.hidden_size);
        let hd = d / self.cfg.num_heads;
        let heads = |e: &mut Engine, m: &str| -> Result<Tensor> {
            let t = p.linear(e, &format!("{name}.{m}"), x, true)?;
            e.scope(name, |e| {
                let t = e.view(&t, &[b as isize, s as isize, -1, hd as isize])?;
                e.transpose(&t, 1, 2)
            })
        };
        let (q, k, v) = (heads(e, "query")?, heads(e, "key")?, heads(e, "value")?);
        e.scope(name, |e| {
            let kt = e.transpose(&k, 2, 3)?;
            let scores = e.matmul(&q, &kt)?;
            let mut scores = e.mul_scalar(&scores, (hd as f64).powf(-0.5))?;
            if let Some(m) = mask {
                scores = e.add(&scores, m)?;
            }
            let probs = e.softmax(&scores, -1)?;
            let probs = e.dropout(&probs, self.cfg.dropout.1, self.train, 1)?;
            let ctx = e.matmul(&probs, &v)?;
            let ctx = e.transpose(&ctx, 1, 2)?;
            e.reshape(&ctx, &[b as isize, s as isize, -1])
        })
    }

    /// The last hidden state of the encoder for a batch.
    pub fn hidden(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Tensor> {
        let ids = forward_ids(self, batch)?;
        if ids.rank() != 2 {
            return Err(Error::tensor(
                "input_ids",
                format!("expected [batch, seq], got {:?}", ids.shape()),
            ));
        }
        let (b, s) = (ids.shape()[0], ids.shape()[1]);
        if s > self.cfg.max_positions {
            return Err(Error::tensor(
                "input_ids",
                format!(
                    "a sequence of {s} is longer than the model's {} positions",
                    self.cfg.max_positions
                ),
            ));
        }
        let emb = "bert.embeddings";
        let we = p.get(e, &format!("{emb}.word_embeddings.weight"))?;
        let te = p.get(e, &format!("{emb}.token_type_embeddings.weight"))?;
        let pe = p.get(e, &format!("{emb}.position_embeddings.weight"))?;
        // transformers' default token types: its all-zeros buffer.
        let types = match &batch.token_type_ids {
            Some(t) => t.clone(),
            None => Tensor::from_i64(vec![0; b * s], &[b, s])?,
        };
        let positions = Tensor::from_i64((0..s as i64).collect(), &[1, s])?;
        let x = e.scope(emb, |e| {
            let w = e.scope("word_embeddings", |e| {
                e.embedding_padded(&we, ids, self.cfg.pad_token_id)
            })?;
            let t = e.scope("token_type_embeddings", |e| e.embedding(&te, &types))?;
            let x = e.add(&w, &t)?;
            let pos = e.scope("position_embeddings", |e| e.embedding(&pe, &positions))?;
            e.add(&x, &pos)
        })?;
        let x = p.layer_norm(e, &format!("{emb}.LayerNorm"), &x, self.norm())?;
        let mut x = e.scope(emb, |e| {
            e.scope("dropout", |e| {
                e.dropout(&x, self.cfg.dropout.0, self.train, 0)
            })
        })?;
        let mask = match &batch.attention_mask {
            Some(m) => Some(e.scope("bert", |e| extended_mask(e, m, &x))?),
            None => None,
        };
        for i in 0..self.cfg.num_layers {
            let l = format!("bert.encoder.layer.{i}");
            let a = self.self_attention(e, p, &format!("{l}.attention.self"), &x, mask.as_ref())?;
            let a = self.add_norm(e, p, &format!("{l}.attention.output"), &a, &x)?;
            let h = p.linear(e, &format!("{l}.intermediate.dense"), &a, true)?;
            let h = e.scope(&format!("{l}.intermediate.intermediate_act_fn"), |e| {
                e.gelu(&h, false)
            })?;
            x = self.add_norm(e, p, &format!("{l}.output"), &h, &a)?;
        }
        Ok(x)
    }
}

/// Loads the weights (f32, f16 or bf16; fp32 masters) from a directory with
/// `model.safetensors` (or a sharded index) or from one file. Names may lack the
/// `bert.` prefix (a bare `BertModel`), and old checkpoints' LayerNorm `gamma` / `beta`
/// are read as `weight` / `bias`; the tied decoder (`cls.predictions.decoder.*`), the
/// pooler and the next-sentence head are not parameters of the MLM model.
///
/// Seeded random weights as transformers initialises BERT (normal, std 0.02; biases
/// 0; LayerNorm weights 1), for benchmarks.
impl Pretrained for Bert {
    const INIT_KEY: u64 = 0x6265_7274;
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
                let k = match k.strip_suffix(".gamma") {
                    Some(s) => format!("{s}.weight"),
                    None => match k.strip_suffix(".beta") {
                        Some(s) => format!("{s}.bias"),
                        None => k,
                    },
                };
                if k.starts_with("bert.") || k.starts_with("cls.") {
                    (k, t)
                } else {
                    (format!("bert.{k}"), t)
                }
            })
            .collect()
    }

    fn tokens(&self) -> (usize, usize) {
        (self.cfg.vocab_size, self.cfg.max_positions.min(64))
    }
}

impl Model for Bert {
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!(
            "bert hidden {} intermediate {} layers {} heads {} vocab {} positions {} types {}",
            c.hidden_size,
            c.intermediate_size,
            c.num_layers,
            c.num_heads,
            c.vocab_size,
            c.max_positions,
            c.type_vocab_size
        )
    }

    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }

    fn check_batch(&self, batch: &Batch) -> Result<()> {
        check_token_batch(batch, self.cfg.vocab_size)?;
        if let Some(t) = &batch.token_type_ids {
            check_ids("token_type_ids", t, self.cfg.type_vocab_size)?;
        }
        if batch.decoder_input_ids.is_some() {
            return Err(Error::tensor("decoder_input_ids", "bert has no decoder"));
        }
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

    /// An attention mask that marks no padding is dropped, as transformers' eager mask
    /// is skipped then.
    fn prepare_batch(&self, batch: Batch) -> Result<Batch> {
        drop_full_mask(batch)
    }

    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, batch: &Batch) -> Result<Output> {
        let h = self.hidden(e, p, batch)?;
        let t = "cls.predictions.transform";
        let y = p.linear(e, &format!("{t}.dense"), &h, true)?;
        let y = e.scope(&format!("{t}.transform_act_fn"), |e| e.gelu(&y, false))?;
        let y = p.layer_norm(e, &format!("{t}.LayerNorm"), &y, self.norm())?;
        let w = p.get(e, "bert.embeddings.word_embeddings.weight")?;
        let bias = p.get(e, "cls.predictions.bias")?;
        let logits = e.scope("cls.predictions.decoder", |e| e.linear(&y, &w, Some(&bias)))?;
        let loss = e.scope("loss", |e| {
            e.cross_entropy(&logits, &batch.labels, Some(-100))
        })?;
        Ok(Output {
            loss,
            logits,
            hidden: h,
        })
    }
}
