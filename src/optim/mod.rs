//! Layer 7 of `amprobe::LAYERS`: may use layers 0–6 (`dtype` … `ops`).
//!
//! Optimizers (SGD, Adam, AdamW) and gradient-norm clipping with PyTorch's numerics.
//!
//! The engine owns the tensors; an optimizer sees each parameter as a [`ParamSlot`]: its
//! name, its values as an `f32` slice, its gradient (if any) and its dtype. State (momentum
//! buffers, Adam moments, step counts) is held in `f32` slices and keyed by parameter name,
//! so the order of the slots may change from one step to the next.
//!
//! The rules below were checked against torch 2.15.0 on an x86-64 CPU (AVX-512, MKL) over
//! 20 steps of 1037-element tensors: SGD bit for bit; Adam, AdamW and AMSGrad bit for bit up
//! to the `sqrt` noted below; clipping bit for bit except where PyTorch's own f32 sum of
//! squares is an ulp off (see [`clip`]). The tests carry small golden tables from that run.
//!
//! # Numerics
//!
//! Each update follows the op order of PyTorch's single-tensor (`foreach=False`,
//! `fused=False`) path on a Linux x86-64 CPU build, op by op, each op rounded to `f32`:
//!
//! * `a.add_(b, alpha=s)` is one fused multiply-add, `fma(b, s, a)`. ATen's CPU `add` kernel
//!   (`ufunc/add.h`) evaluates its vectorized lanes with `vec::fmadd(other, alpha, self)`,
//!   which is `_mm256_fmadd_ps`/`_mm512_fmadd_ps` on AVX2/AVX-512, and the scalar tail
//!   `self + alpha * other` is contracted to an FMA by GCC, which builds the official wheels.
//!   With `alpha == 1` the FMA is an ordinary correctly rounded addition.
//! * `a.lerp_(b, w)` is `fma(w, b - a, a)` for `|w| < 0.5`, else `fma(w - 1, b - a, b)`
//!   (ATen's `lerp_vec`).
//! * `a.addcmul_(b, c, value=s)` is `fma(s * b, c, a)`: ATen writes `a + s * b * c`, and GCC
//!   contracts the last multiply with the add.
//! * `a.addcdiv_(b, c, value=s)` is `a + (s * b) / c`, three roundings (no multiply-add to
//!   fuse).
//! * Python-float hyper-parameters and the scalars derived from them (`1 - beta1`,
//!   `lr / bias_correction1`, `1 - lr * weight_decay`, ...) are computed in `f64`, as Python
//!   does, and converted to `f32` once where they meet a tensor.
//! * `sqrt` is the correctly rounded IEEE square root. PyTorch's x86 builds with MKL compute
//!   `torch.sqrt` on f32 tensors with MKL VML (`vmsSqrt`, HA mode), which is faithfully but not
//!   correctly rounded: about a fifth of its results are one ulp away (measured on torch
//!   2.15.0, AVX-512). Builds without MKL, fp16/bf16 tensors, and CUDA use the correctly
//!   rounded root. So Adam's moments match PyTorch bit for bit, and parameters match up to
//!   that ulp in the denominator; SGD and the clipping coefficient have no `sqrt` in the
//!   update and match bit for bit.
//!
//! Low-precision parameters (fp16/bf16, pure low-precision training without master
//! weights) are handled per [`StatePrecision`]: by default in `f32` arithmetic with `f32`
//! state, the new value rounded once to the parameter's dtype with
//! [`crate::dtype::round_slice`]; with [`StatePrecision::Param`] the way PyTorch itself does it
//! for a `.half()` model (state in the parameter's dtype, every op rounded). In that mode
//! PyTorch's own fp16/bf16 `add(alpha)` kernel is not uniform: elements in whole vector
//! blocks compute `fma(other, alpha, self)` in f32 and round once, while the scalar remainder
//! of each block run (the last `n % 64` elements for fp16 on AVX-512, with a split per thread
//! for large tensors) rounds `alpha * other` to the dtype before adding. The vectorized form
//! is used for every element here, so tail elements can differ by an ulp.

pub mod adam;
pub mod clip;
pub mod cuda;
pub mod sgd;
mod update;

#[cfg(test)]
pub(crate) mod harness;

use serde::{Deserialize, Serialize};

use crate::Result;

pub use adam::{Adam, AdamConfig, AdamWConfig};
pub use clip::{clip_grad_norm, ClipOutcome, GradSlot, NormType};
pub use sgd::{Sgd, SgdConfig};
pub use update::{Optimizer, ParamSlot, StateBefore, StatePrecision};

/// Which optimizer to build, with its hyper-parameters. Deserializes from a table with a
/// `kind` of `sgd`, `adam` or `adamw`; omitted fields take PyTorch's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`.
    #[serde(rename = "sgd")]
    Sgd(SgdConfig),
    /// `torch.optim.Adam` (L2 weight decay added to the gradient unless `decoupled`).
    #[serde(rename = "adam")]
    Adam(AdamConfig),
    /// `torch.optim.AdamW` (decoupled weight decay, default 0.01).
    #[serde(rename = "adamw")]
    AdamW(AdamWConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::AdamW(AdamWConfig::default())
    }
}

/// Builds the optimizer a config describes, after checking its hyper-parameters the way
/// PyTorch's constructors do.
pub fn build_optimizer(cfg: &OptimizerConfig) -> Result<Box<dyn Optimizer>> {
    Ok(match cfg {
        OptimizerConfig::Sgd(c) => Box::new(Sgd::new(c.clone())?),
        OptimizerConfig::Adam(c) => Box::new(Adam::new(c.clone())?),
        OptimizerConfig::AdamW(c) => Box::new(Adam::new(AdamConfig::from(c.clone()))?),
    })
}

#[cfg(test)]
mod tests;
