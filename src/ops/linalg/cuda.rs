//! Matrix products on the device through cuBLAS (f32 accumulation), rounded to the
//! operands' dtype by the cast kernel, which counts over/underflow, or, where nothing
//! counts them ([`Out::silent`]), by cuBLAS as it writes its output in that dtype: the
//! same single rounding to nearest even, without an f32 output and a pass over it.

use crate::device::cuda::blas::Gemm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::cuda::{arg, device_of, output, same_dtype, Out};
use crate::tensor::Tensor;

/// Matrix product of row-major `a` (…×m×k, or k×m with `trans_a`) and `b` (…×k×n, or
/// n×k with `trans_b`): 2-D × 2-D, 3-D × 3-D (same batch) or 3-D × 2-D (shared b).
/// An f32 product is cuBLAS's output as it is (its statistics, if any, come from the
/// arena's own pass); a 16-bit one gathers them in the rounding kernel.
pub fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool, sink: Out) -> Result<Tensor> {
    let dt = same_dtype("matmul", &[a, b])?;
    if dt != DType::F32 && sink.silent(&*device_of("matmul", &[a, b])?)? {
        return product(a, b, trans_a, trans_b, dt);
    }
    let acc = matmul_acc(a, b, trans_a, trans_b)?;
    if dt == DType::F32 {
        return Ok(acc);
    }
    crate::ops::cast::cuda::cast(&acc, dt, sink)
}

/// [`matmul`]'s f32 accumulation, before any rounding to the operands' dtype.
pub fn matmul_acc(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
    product(a, b, trans_a, trans_b, DType::F32)
}

/// The product as cuBLAS writes it: in f32, or rounded once to the operands' dtype `out`.
fn product(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool, out: DType) -> Result<Tensor> {
    same_dtype("matmul", &[a, b])?;
    let dev = device_of("matmul", &[a, b])?;
    let (sa, sb) = (a.shape(), b.shape());
    let mat = |s: &[usize], t: bool| -> Result<(usize, usize, usize)> {
        match s.len() {
            2 if t => Ok((1, s[1], s[0])),
            2 => Ok((1, s[0], s[1])),
            3 if t => Ok((s[0], s[2], s[1])),
            3 => Ok((s[0], s[1], s[2])),
            _ => Err(Error::shape(
                "matmul",
                format!("expected 2-D or 3-D operands, got {s:?}"),
            )),
        }
    };
    let (ba, m, k) = mat(sa, trans_a)?;
    let (bb, k2, n) = mat(sb, trans_b)?;
    if k != k2 || (bb != 1 && bb != ba) || (sb.len() == 3 && sa.len() == 2) {
        return Err(Error::shape(
            "matmul",
            format!("cannot multiply {sa:?} (trans {trans_a}) by {sb:?} (trans {trans_b})"),
        ));
    }
    let g = Gemm {
        m,
        n,
        k,
        trans_a,
        trans_b,
        batch: ba,
        stride_a: m * k,
        stride_b: if sb.len() == 3 { k * n } else { 0 },
    };
    let out_shape: Vec<usize> = if sa.len() == 3 {
        vec![ba, m, n]
    } else {
        vec![m, n]
    };
    let c = output(&dev, &out_shape, out)?;
    let ((ap, kind), (bp, _), (cp, ck)) =
        (arg(a, "matmul")?, arg(b, "matmul")?, arg(&c, "matmul")?);
    // SAFETY: a, b and c are live device buffers of exactly the sizes `g` implies.
    unsafe { dev.blas().gemm(g, kind, ap, bp, cp, ck)? };
    Ok(c)
}

/// `x·wᵀ + b` for x [m, k], w [n, k], b [n] (with `w_t`, `x·w + b` for w [k, n]): the bias
/// added to the f32 accumulation in f32 and the sum rounded once to x's dtype (as the
/// emulator's linear).
pub fn linear(x: &Tensor, w: &Tensor, w_t: bool, b: Option<&Tensor>, sink: Out) -> Result<Tensor> {
    let dt = same_dtype("linear", &[x, w])?;
    if b.is_none() {
        return matmul(x, w, false, !w_t, sink);
    }
    let mut acc = matmul_acc(x, w, false, !w_t)?;
    if let Some(b) = b {
        let b32 = crate::ops::cast::cuda::cast(b, DType::F32, Out::NONE)?;
        // In f32 the sum is the output: its kernel gathers the statistics.
        let final_sum = if dt == DType::F32 { sink } else { Out::NONE };
        acc = crate::ops::elementwise::cuda::binary(
            crate::ops::elementwise::Binary::Add,
            &acc,
            &b32,
            final_sum,
        )?;
    }
    if dt == DType::F32 {
        // f32 results are final as computed (the emulator counts no f32 rounding either).
        return Ok(acc);
    }
    crate::ops::cast::cuda::cast(&acc, dt, sink)
}

/// Gradients of [`linear`] from the output gradient `g` [m, n]: dx = g·w, dw = gᵀ·x (with
/// `w_t`: dx = g·wᵀ, dw = xᵀ·g; each rounded once) and db = Σ g over rows (in f64 in row
/// order, rounded once).
pub fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    w_t: bool,
    g: &Tensor,
    has_b: bool,
    sinks: [Out; 3],
) -> Result<[Option<Tensor>; 3]> {
    let gx = matmul(g, w, false, w_t, sinks[0])?;
    let gw = if w_t {
        matmul(x, g, true, false, sinks[1])?
    } else {
        matmul(g, x, true, false, sinks[1])?
    };
    let gb = if has_b {
        let n = g.shape()[1];
        let like = output(&device_of("linear", &[g])?, &[n], g.dtype())?;
        Some(crate::ops::elementwise::cuda::binary_grad(
            crate::ops::elementwise::Binary::Add,
            g,
            &like,
            g,
            true,
            sinks[2],
        )?)
    } else {
        None
    };
    Ok([Some(gx), Some(gw), gb])
}
