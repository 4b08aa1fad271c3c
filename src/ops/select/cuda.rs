//! Device host code of the select family (kernels in `select.cu`): `where` picks raw
//! element bits, its gradients are summed in f64 in the CPU's row-major order from the
//! CPU's start value, and `masked_fill` counts its fill's underflow and its -inf.

use super::kernels::{Kernels, Truth};
use super::truth::{device_truth, masked_count, truth};
use crate::device::cuda::arena::MASKED_NEG_INF;
use crate::device::cuda::buffer::kind_code;
use crate::dtype::{DType, RoundCounts};
use crate::engine::Computed;
use crate::error::{Error, Result};
use crate::ops::cuda::{
    arg, arg_ptr, device_of, launch, output, pad_shape, pad_strides, same_dtype, MAX_DIMS,
};
use crate::ops::device_counts;
use crate::ops::reduce::cuda::sum_to_init;
use crate::ops::{broadcast_shape, bstrides};
use crate::tensor::{strides, Tensor};
use cudarc::driver::DeviceRepr;

/// The kernels of `select.cu`.
pub const KERNELS: &[&str] = &["amp_where", "amp_where_grad", "amp_masked_fill"];

/// `SEL_KIND_I64` in select.cu: an int64 condition or mask.
const KIND_I64: i32 = 3;

/// `WhereGeometry` in select.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct WhereGeometry {
    shape: [u64; MAX_DIMS],
    sc: [u64; MAX_DIMS],
    sa: [u64; MAX_DIMS],
    sb: [u64; MAX_DIMS],
}

/// `WhereGradGeometry` in select.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct WhereGradGeometry {
    shape: [u64; MAX_DIMS],
    sc: [u64; MAX_DIMS],
    sg: [u64; MAX_DIMS],
    reduced: [u32; MAX_DIMS],
}

/// `MaskGeometry` in select.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MaskGeometry {
    shape: [u64; MAX_DIMS],
    sm: [u64; MAX_DIMS],
}

// SAFETY: plain-old-data with the C layout of the kernels' structs.
unsafe impl DeviceRepr for WhereGeometry {}
// SAFETY: as above.
unsafe impl DeviceRepr for WhereGradGeometry {}
// SAFETY: as above.
unsafe impl DeviceRepr for MaskGeometry {}

/// A condition or mask operand: its address and the kernel's kind code for it.
fn truth_arg(t: &Tensor, op: &str) -> Result<(u64, i32)> {
    let kind = match t.dtype() {
        DType::I64 => KIND_I64,
        d => kind_code(d)?,
    };
    Ok((arg_ptr(t, op)?, kind))
}

/// Bytes of one stored element of `dtype` on the device.
fn elem_bytes(dtype: DType, op: &str) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        DType::I64 => Ok(8),
        DType::F64 => Err(Error::Device(format!("{op}: f64 tensors stay on the host"))),
    }
}

/// `torch.where(c, a, b)` over the broadcast `out_shape`: element bits of `a` where `c` is
/// nonzero (NaN included), of `b` elsewhere.
pub fn where_(c: &Tensor, a: &Tensor, b: &Tensor, out_shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "where";
    let dev = device_of(OP, &[c, a, b])?;
    let dtype = same_dtype(OP, &[a, b])?;
    let geo = WhereGeometry {
        shape: pad_shape(out_shape)?,
        sc: pad_strides(&bstrides(c.shape(), out_shape)),
        sa: pad_strides(&bstrides(a.shape(), out_shape)),
        sb: pad_strides(&bstrides(b.shape(), out_shape)),
    };
    let y = output(&dev, out_shape, dtype)?;
    let ((cp, ck), ap, bp, yp) = (
        truth_arg(c, OP)?,
        arg_ptr(a, OP)?,
        arg_ptr(b, OP)?,
        arg_ptr(&y, OP)?,
    );
    let (bytes, n) = (elem_bytes(dtype, OP)?, y.numel() as u64);
    launch!(
        dev,
        "amp_where",
        n,
        &cp,
        &ck,
        &ap,
        &bp,
        &yp,
        &bytes,
        &n,
        &geo
    );
    Ok(y)
}

/// The gradient of one branch of `where` (`branch`: true for `a`): `g` (shape
/// `out_shape`) where the condition equals `branch`, zero elsewhere, summed down to
/// `target` in f64 and rounded once.
pub fn where_grad(
    c: &Tensor,
    g: &Tensor,
    out_shape: &[usize],
    branch: bool,
    target: &[usize],
    counts: u64,
) -> Result<Tensor> {
    const OP: &str = "where";
    let dev = device_of(OP, &[c, g])?;
    if broadcast_shape(target, out_shape, OP)? != out_shape {
        return Err(Error::shape(
            OP,
            format!("branch shape {target:?} does not broadcast to {out_shape:?}"),
        ));
    }
    let padded = pad_shape(target)?;
    let full = pad_shape(out_shape)?;
    let mut reduced = [0u32; MAX_DIMS];
    let mut n_reduced = 1u64;
    for d in 0..MAX_DIMS {
        if padded[d] != full[d] {
            reduced[d] = 1;
            n_reduced *= full[d];
        }
    }
    let geo = WhereGradGeometry {
        shape: full,
        sc: pad_strides(&bstrides(c.shape(), out_shape)),
        sg: pad_strides(&strides(out_shape)),
        reduced,
    };
    let y = output(&dev, target, g.dtype())?;
    let ((cp, ck), (gp, k), yp) = (truth_arg(c, OP)?, arg(g, OP)?, arg_ptr(&y, OP)?);
    let n_out = y.numel() as u64;
    let br = branch as i32;
    let init = sum_to_init(out_shape, target);
    launch!(
        dev,
        "amp_where_grad",
        n_out,
        &cp,
        &ck,
        &gp,
        &yp,
        &k,
        &n_out,
        &br,
        &geo,
        &n_reduced,
        &init,
        &counts
    );
    Ok(y)
}

/// `x` with `v` (exact in `x`'s dtype) where the mask, broadcast to `x`, is set. Each
/// masked element counts one underflow into `counts` when `fill_underflowed` (the fill
/// value rounded to zero on the host); a -inf fill counts the masked elements into the
/// word at `neg_inf` when it is not 0.
pub fn masked_fill(
    x: &Tensor,
    m: &Tensor,
    v: f32,
    fill_underflowed: bool,
    counts: u64,
    neg_inf: u64,
) -> Result<Tensor> {
    const OP: &str = "masked_fill";
    let dev = device_of(OP, &[x, m])?;
    let geo = MaskGeometry {
        shape: pad_shape(x.shape())?,
        sm: pad_strides(&bstrides(m.shape(), x.shape())),
    };
    let y = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), (mp, mk), yp) = (arg(x, OP)?, truth_arg(m, OP)?, arg_ptr(&y, OP)?);
    let (n, under) = (y.numel() as u64, fill_underflowed as i32);
    launch!(
        dev,
        "amp_masked_fill",
        n,
        &xp,
        &mp,
        &mk,
        &yp,
        &k,
        &n,
        &geo,
        &v,
        &under,
        &counts,
        &neg_inf
    );
    Ok(y)
}

/// The device address of the masked -inf word of arena slot `slot` on `x`'s device.
pub fn masked_neg_inf_word(x: &Tensor, slot: u32) -> Result<u64> {
    let dev = x.cuda("masked_fill")?.dev.clone();
    dev.with_arena(|a| Ok(a.word_ptr(&dev, slot, MASKED_NEG_INF)))
}

/// The device's selection kernels.
pub struct Device;

/// The device condition of a forward that ran here.
fn device_cond<'a>(t: &'a Truth, op: &str) -> Result<&'a Tensor> {
    match t {
        Truth::Device(c) => Ok(c),
        Truth::Host(..) => Err(Error::Device(format!(
            "{op} backward: the forward's condition is on the host"
        ))),
    }
}

impl Kernels for Device {
    fn where_(
        &self,
        cond: &Tensor,
        a: &Tensor,
        b: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Truth)> {
        let c = device_truth(cond, a, "where")?;
        let out = where_(&c, a, b, out_shape)?;
        // Values are picked, not rounded: nothing to count (the probe takes a slot).
        Ok((Computed::new(out, RoundCounts::default()), Truth::Device(c)))
    }

    fn where_grad(
        &self,
        c: &Truth,
        g: &Tensor,
        out_shape: &[usize],
        on: bool,
        target: &[usize],
        _dtype: DType,
    ) -> Result<Computed> {
        let c = device_cond(c, "where")?;
        let (slot, counts) = device_counts(g)?;
        let r = where_grad(c, g, out_shape, on, target, counts)?;
        Ok(Computed::pending(r, slot))
    }

    fn masked_fill(
        &self,
        x: &Tensor,
        mask: &Tensor,
        value: f64,
        v: f64,
        fill_underflowed: bool,
    ) -> Result<(Computed, Truth)> {
        const OP: &str = "masked_fill";
        // A host mask is counted here; a device mask's -inf count stays on the device
        // (the kernel counts it into the op's slot, resolved with the step's read).
        let host_masked = match crate::ops::on_device(mask) {
            true => None,
            false => Some(masked_count(&truth(mask, OP)?, mask.shape(), x.shape())),
        };
        let m = device_truth(mask, x, OP)?;
        let (slot, counts) = device_counts(x)?;
        let neg_inf = value == f64::NEG_INFINITY;
        let word = match (neg_inf, host_masked) {
            (true, None) => masked_neg_inf_word(x, slot)?,
            _ => 0,
        };
        let y = masked_fill(x, &m, v as f32, fill_underflowed, counts, word)?;
        let mut out = Computed::pending(y, slot);
        if neg_inf {
            out.masked_neg_inf = host_masked.unwrap_or(0);
        }
        Ok((out, Truth::Device(m)))
    }

    fn masked_fill_backward(&self, g: &Tensor, m: &Truth, _dtype: DType) -> Result<Computed> {
        let m = device_cond(m, "masked_fill")?;
        let (slot, counts) = device_counts(g)?;
        let r = masked_fill(g, m, 0.0, false, counts, 0)?;
        Ok(Computed::pending(r, slot))
    }
}
