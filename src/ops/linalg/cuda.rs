//! Matrix products on the device through cuBLAS (f32 accumulation), rounded to the
//! operands' dtype by the cast kernel, which counts over/underflow, or, where nothing
//! counts them ([`Out::silent`]), by cuBLAS as it writes its output in that dtype: the
//! same single rounding to nearest even, without an f32 output and a pass over it.

use super::kernels::{Kernels, Mkn};
use super::shape::MmShape;
use crate::device::cuda::blas::Gemm;
use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::cuda::{arg, device_of, output, same_dtype, Out};
use crate::ops::grad;
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

/// The operands of a device GEMM: `a` as [batch, m, k] (or [m, k]), `b` as [k, n] when
/// shared or [batch, k, n].
fn device_views(a: &Tensor, b: &Tensor, s: &MmShape) -> Result<(Tensor, Tensor)> {
    let a3 = a.view_as(&[s.batch, s.m, s.k])?;
    let b3 = if s.b_shared {
        b.view_as(&[s.k, s.n])?
    } else {
        b.view_as(&[s.batch, s.k, s.n])?
    };
    Ok((a3, b3))
}

/// Forward matmul on the device (cuBLAS, rounded once by the cast kernel).
fn device_matmul(a: &Tensor, b: &Tensor, s: &MmShape) -> Result<Computed> {
    let (a3, b3) = device_views(a, b, s)?;
    let (slot, sink) = crate::ops::device_out(a)?;
    let y = matmul(&a3, &b3, false, false, sink)?;
    Ok(Computed::pending(y.view_as(&s.out)?, slot))
}

/// Gradients of a device matmul: dA = G·Bᵀ and dB = Aᵀ·G (summed over the batch when B
/// is shared, as one GEMM over the flattened batch).
fn device_matmul_backward(
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    s: &MmShape,
) -> Result<Vec<Option<Grad>>> {
    let (a3, b3) = device_views(a, b, s)?;
    let g3 = g.view_as(&[s.batch, s.m, s.n])?;
    let (slot_a, sink_a) = crate::ops::device_out(a)?;
    let ga = matmul(&g3, &b3, false, true, sink_a)?.view_as(a.shape())?;
    let (slot_b, sink_b) = crate::ops::device_out(b)?;
    let gb = if s.b_shared {
        let a2 = a.view_as(&[s.batch * s.m, s.k])?;
        let g2 = g.view_as(&[s.batch * s.m, s.n])?;
        matmul(&a2, &g2, true, false, sink_b)?
    } else {
        matmul(&a3, &g3, true, false, sink_b)?
    };
    Ok(vec![
        grad(Computed::pending(ga, slot_a)),
        grad(Computed::pending(gb.view_as(b.shape())?, slot_b)),
    ])
}

/// The device's matrix-product kernels (cuBLAS).
pub struct Device;

impl Kernels for Device {
    fn affine(
        &self,
        _op: &'static str,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        w_t: bool,
        (m, k, _): Mkn,
        out_shape: &[usize],
    ) -> Result<Computed> {
        let x2 = x.view_as(&[m, k])?;
        let (slot, sink) = crate::ops::device_out(x)?;
        let y = linear(&x2, w, w_t, b, sink)?.view_as(out_shape)?;
        Ok(Computed::pending(y, slot))
    }

    fn affine_backward(
        &self,
        _op: &'static str,
        x: &Tensor,
        w: &Tensor,
        w_t: bool,
        g: &Tensor,
        (m, k, n): Mkn,
        has_b: bool,
    ) -> Result<Vec<Option<Grad>>> {
        let x2 = x.view_as(&[m, k])?;
        let g2 = g.view_as(&[m, n])?;
        let mut slots = [0u32; 3];
        let mut sinks = [Out::NONE; 3];
        let taken = crate::ops::device_counts_n(&x2, if has_b { 3 } else { 2 })?;
        for (i, (s, c)) in taken.into_iter().enumerate() {
            (slots[i], sinks[i]) = (s, Out::new(s, c));
        }
        let [gx, gw, gb] = linear_backward(&x2, w, w_t, &g2, has_b, sinks)?;
        let gx = gx.map(|t| t.view_as(x.shape())).transpose()?;
        Ok([gx, gw, gb]
            .into_iter()
            .zip(slots)
            .map(|(t, s)| t.and_then(|t| grad(Computed::pending(t, s))))
            .collect())
    }

    fn matmul(&self, _op: &'static str, a: &Tensor, b: &Tensor, s: &MmShape) -> Result<Computed> {
        device_matmul(a, b, s)
    }

    fn matmul_backward(
        &self,
        _op: &'static str,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        s: &MmShape,
    ) -> Result<Vec<Option<Grad>>> {
        device_matmul_backward(a, b, g, s)
    }
}
