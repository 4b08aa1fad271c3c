//! The additive attention masks of transformers' eager attention: 0 where a position may
//! be attended, the smallest finite value of the mask's dtype where it may not.

use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::Result;
use crate::tensor::Tensor;

/// The smallest finite value of `dtype` (`torch.finfo(dtype).min`), as f32.
fn finfo_min(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -f32::from_bits(0x7f7f_0000),
        _ => f32::MIN,
    }
}

/// transformers' additive causal mask for eager attention, [1, 1, s, s]: 0 on and below the
/// diagonal, the smallest finite value of `like`'s dtype (the embeddings', so fp32 under
/// autocast and fp16 in a pure-fp16 model) above it, on `like`'s device; marked as an
/// additive mask ([`Engine::mark_mask`]).
pub(crate) fn causal_mask(e: &mut Engine, s: usize, like: &Tensor) -> Result<Tensor> {
    let min = finfo_min(like.dtype());
    let mut m = vec![0.0f32; s * s];
    for q in 0..s {
        for k in q + 1..s {
            m[q * s + k] = min;
        }
    }
    let dtype = if like.dtype().is_float() && like.dtype() != DType::F64 {
        like.dtype()
    } else {
        DType::F32
    };
    let t = Tensor::from_f32(m, &[1, 1, s, s], dtype)?;
    let t = match like.device() {
        Some(d) => t.to_device(d)?,
        None => t,
    };
    e.mark_mask(&t);
    Ok(t)
}

/// transformers' eager bidirectional mask [b, 1, 1, s] for an int64 `attention_mask`
/// [b, s] (on the host or the device): 0 where it is 1, the smallest finite value of
/// `like`'s dtype (the embeddings') where it is 0.
pub(crate) fn extended_mask(e: &mut Engine, mask: &Tensor, like: &Tensor) -> Result<Tensor> {
    let (b, s) = (mask.shape()[0], mask.shape()[1]);
    let dtype = like.dtype();
    let min = finfo_min(dtype);
    let scalar = |v: f32| -> Result<Tensor> {
        let t = Tensor::from_f32(vec![v], &[1, 1, 1, 1], dtype)?;
        match like.device() {
            Some(d) => t.to_device(d),
            None => Ok(t),
        }
    };
    let cond = mask.view_as(&[b, 1, 1, s])?;
    let (zero, min) = (scalar(0.0)?, scalar(min)?);
    e.make_mask(|e| e.where_(&cond, &zero, &min))
}
