//! Layer 8 of `amprobe::LAYERS`: may use layers 0–7 (`dtype` … `probe`).
//!
//! Models: parameters, batches and the forward pass that ends in a loss.

pub mod bert;
pub mod gpt2;
pub mod hf_config;
pub mod llama;
pub mod masks;
pub mod mlp;
pub mod pretrained;
pub mod t5;
pub mod t5_seq2seq;
pub mod tokens;
pub mod weights;

use crate::amp::mode::Precision;
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One trainable parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Dotted name as Hugging Face / PyTorch writes it (`fc1.weight`).
    pub name: String,
    /// Path of the module owning it (`fc1`).
    pub module: String,
    /// Current value: a leaf tensor that requires a gradient, in the mode's parameter dtype.
    pub value: Tensor,
    /// Normalisation parameters stay fp32 in O2.
    pub norm: bool,
}

impl Param {
    /// A parameter; the module path is the name without its last segment.
    pub fn new(name: &str, value: Tensor, norm: bool) -> Param {
        let module = name
            .rsplit_once('.')
            .map(|(m, _)| m.to_string())
            .unwrap_or_default();
        Param {
            name: name.to_string(),
            module,
            value: value.as_leaf(true),
            norm,
        }
    }
}

/// A model's parameters, in a fixed order.
#[derive(Debug, Clone, Default)]
pub struct ParamStore {
    /// The parameters.
    pub params: Vec<Param>,
}

impl ParamStore {
    /// Looks up a parameter by name.
    pub fn get(&self, name: &str) -> Result<&Param> {
        self.params
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Error::tensor(name, "no such parameter"))
    }

    /// Converts every parameter to `dtype` (rounding once), e.g. for pure low-precision
    /// modes, except those for which `keep` is true.
    pub fn convert(&mut self, dtype: DType, keep: impl Fn(&Param) -> bool) -> Result<()> {
        for p in &mut self.params {
            if p.value.dtype() != dtype && !keep(p) {
                let c = crate::ops::cast::cast(&p.value, dtype)?;
                p.value = c.tensor.as_leaf(true);
            }
        }
        Ok(())
    }
}

/// Hands parameters to a forward pass, applying the precision mode (O2 casts a per-forward
/// low-precision copy of every non-norm parameter; the cast is recorded, so gradients flow
/// back to the fp32 master).
pub struct ParamAccess<'a> {
    store: &'a ParamStore,
    precision: Precision,
}

impl<'a> ParamAccess<'a> {
    /// Access under a precision mode.
    pub fn new(store: &'a ParamStore, precision: Precision) -> Self {
        ParamAccess { store, precision }
    }

    /// The parameter `name` as the forward pass must use it.
    pub fn get(&self, eng: &mut Engine, name: &str) -> Result<Tensor> {
        let p = self.store.get(name)?;
        match self.precision.o2_dtype() {
            Some(d) if !p.norm && !eng.is_kept_fp32(&p.module) => eng.cast_param(&p.value, d),
            _ => Ok(p.value.clone()),
        }
    }

    /// The precision mode.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The `nn.Linear` module `name`: `x · weightᵀ (+ bias)` in its scope.
    pub fn linear(&self, e: &mut Engine, name: &str, x: &Tensor, bias: bool) -> Result<Tensor> {
        let w = self.get(e, &format!("{name}.weight"))?;
        let b = match bias {
            true => Some(self.get(e, &format!("{name}.bias"))?),
            false => None,
        };
        e.scope(name, |e| e.linear(x, &w, b.as_ref()))
    }

    /// The `nn.LayerNorm` module `name` over the last `d` values, in its scope.
    pub fn layer_norm(
        &self,
        e: &mut Engine,
        name: &str,
        x: &Tensor,
        (d, eps): (usize, f64),
    ) -> Result<Tensor> {
        let w = self.get(e, &format!("{name}.weight"))?;
        let b = self.get(e, &format!("{name}.bias"))?;
        e.scope(name, |e| e.layer_norm(x, d, Some(&w), Some(&b), eps))
    }
}

/// One batch: model inputs and integer labels.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Inputs (features or token ids).
    pub inputs: Tensor,
    /// Labels (class ids), int64.
    pub labels: Tensor,
    /// Which input positions are real tokens (1) and which padding (0), int64 [batch, seq].
    pub attention_mask: Option<Tensor>,
    /// Segment ids (BERT's token types), int64 [batch, seq].
    pub token_type_ids: Option<Tensor>,
    /// The decoder's input ids of an encoder–decoder model, int64 [batch, target]; made
    /// from the labels (shifted right) when absent.
    pub decoder_input_ids: Option<Tensor>,
}

impl Batch {
    /// A batch of inputs and labels alone.
    pub fn new(inputs: Tensor, labels: Tensor) -> Batch {
        Batch {
            inputs,
            labels,
            attention_mask: None,
            token_type_ids: None,
            decoder_input_ids: None,
        }
    }

    /// Every tensor of the batch passed through `f` (a copy to a device, for example).
    pub fn try_map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Batch> {
        let opt = |t: &Option<Tensor>| t.as_ref().map(&f).transpose();
        Ok(Batch {
            inputs: f(&self.inputs)?,
            labels: f(&self.labels)?,
            attention_mask: opt(&self.attention_mask)?,
            token_type_ids: opt(&self.token_type_ids)?,
            decoder_input_ids: opt(&self.decoder_input_ids)?,
        })
    }
}

/// What a forward pass returns.
pub struct Output {
    /// Scalar loss.
    pub loss: Tensor,
    /// The logits the loss was computed from.
    pub logits: Tensor,
    /// The model's final hidden state (the encoder output for T5; the logits for the MLP),
    /// for accuracy comparisons between precisions.
    pub hidden: Tensor,
}

/// A model the step engine can train.
pub trait Model: Send + Sync {
    /// Short description (architecture and sizes).
    fn describe(&self) -> String;
    /// Runs the forward pass and the loss.
    fn forward(&self, eng: &mut Engine, params: &ParamAccess<'_>, batch: &Batch) -> Result<Output>;
    /// A copy of the model (for re-running a step under another precision recipe).
    fn clone_model(&self) -> Box<dyn Model>;
    /// Checks a host batch before it is copied to a device, where looking at its values
    /// would cost a read (token ids against the vocabulary, for example).
    fn check_batch(&self, _batch: &Batch) -> Result<()> {
        Ok(())
    }
    /// The micro-batch as the forward pass takes it, made on the host before any copy to a
    /// device (a causal LM shifts its labels here, as transformers' loss does).
    fn prepare_batch(&self, batch: Batch) -> Result<Batch> {
        Ok(batch)
    }
    /// The model's own fp16 switches from transformers' config (name, what it does).
    fn fp16_switches(&self) -> Vec<(&'static str, &'static str)> {
        Vec::new()
    }
    /// Turns switch `name` of [`Model::fp16_switches`] on or off; false when the model has
    /// no such switch.
    fn set_switch(&mut self, _name: &str, _on: bool) -> bool {
        false
    }
    /// Whether switch `name` is on.
    fn switch(&self, _name: &str) -> bool {
        false
    }
    /// Turns transformers' fp16 clamp on or off; false when the model has none.
    fn set_clamp(&mut self, _on: bool) -> bool {
        false
    }
    /// Whether the fp16 clamp is on.
    fn clamp(&self) -> bool {
        false
    }
}
