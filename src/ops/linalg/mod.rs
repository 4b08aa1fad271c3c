//! Matrix products: linear (+bias), matmul, bmm. GEMM accumulates in f32 (f64 for the
//! reference dtype) and the result is rounded once to the output dtype.

//!
//! The host kernels are in `cpu.rs` (the gemm crate, f32 accumulation); the device path in
//! `cuda.rs` (cuBLAS).

mod cpu;
pub mod cuda;
mod shape;

pub(crate) use shape::{mm_shape, MmShape};

use super::{expect_float, grad, with_float2, FData};
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

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
    let (slot, sink) = super::device_out(a)?;
    let y = cuda::matmul(&a3, &b3, false, false, sink)?;
    Ok(Computed::pending(y.view_as(&s.out)?, slot))
}

/// Gradients of a device matmul: dA = G·Bᵀ and dB = Aᵀ·G (summed over the batch when B
/// is shared, as one GEMM over the flattened batch).
fn device_matmul_backward(
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    s: &MmShape,
) -> Result<Vec<Option<crate::engine::Grad>>> {
    let (a3, b3) = device_views(a, b, s)?;
    let g3 = g.view_as(&[s.batch, s.m, s.n])?;
    let (slot_a, sink_a) = super::device_out(a)?;
    let ga = cuda::matmul(&g3, &b3, false, true, sink_a)?.view_as(a.shape())?;
    let (slot_b, sink_b) = super::device_out(b)?;
    let gb = if s.b_shared {
        let a2 = a.view_as(&[s.batch * s.m, s.k])?;
        let g2 = g.view_as(&[s.batch * s.m, s.n])?;
        cuda::matmul(&a2, &g2, true, false, sink_b)?
    } else {
        cuda::matmul(&a3, &g3, true, false, sink_b)?
    };
    Ok(vec![
        grad(Computed::pending(ga, slot_a)),
        grad(Computed::pending(gb.view_as(b.shape())?, slot_b)),
    ])
}

/// The two affine ops: their weights' layouts differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Affine {
    /// `linear(x, w, b)`, w [out, in].
    Linear,
    /// `addmm(b, x, w)`, w [in, out].
    Addmm,
}

impl Affine {
    fn op(self) -> &'static str {
        match self {
            Affine::Linear => "linear",
            Affine::Addmm => "addmm",
        }
    }

    fn layout(self) -> &'static str {
        match self {
            Affine::Linear => "[out, in]",
            Affine::Addmm => "[in, out] with a 2-D input",
        }
    }

    /// Names of the recorded inputs (input, weight, bias), as PyTorch names the arguments.
    fn wrt(self) -> &'static [&'static str] {
        match self {
            Affine::Linear => &["input", "weight", "bias"],
            Affine::Addmm => &["mat1", "mat2", "self"],
        }
    }
}

impl Engine {
    /// y = x·wᵀ + b for x [..., in], w [out, in], b [out] (`torch.nn.functional.linear`).
    pub fn linear(&mut self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        self.affine(Affine::Linear, x, w, b)
    }

    /// y = b + x·w for x [m, in], w [in, out], b [out] (`torch.addmm(b, x, w)`, as
    /// transformers' GPT-2 `Conv1D` computes; the weight is used as it is stored).
    pub fn addmm(&mut self, b: &Tensor, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.affine(Affine::Addmm, x, w, Some(b))
    }

    fn affine(
        &mut self,
        kind: Affine,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
    ) -> Result<Tensor> {
        let op = kind.op();
        expect_float(x, op, "input")?;
        let mut raw = vec![x, w];
        raw.extend(b);
        let ins = self.prepare(op, &raw)?;
        let (x, w) = (&ins[0], &ins[1]);
        let b = ins.get(2);
        let rank_ok = match kind {
            Affine::Linear => x.rank() > 0,
            Affine::Addmm => x.rank() == 2,
        };
        if w.rank() != 2 || !rank_ok {
            return Err(Error::shape(
                op,
                format!(
                    "weight must be {}, got {:?}; input {:?}",
                    kind.layout(),
                    w.shape(),
                    x.shape()
                ),
            ));
        }
        let (n, k) = match kind {
            Affine::Linear => (w.shape()[0], w.shape()[1]),
            Affine::Addmm => (w.shape()[1], w.shape()[0]),
        };
        if x.shape()[x.rank() - 1] != k {
            return Err(Error::shape(
                op,
                format!(
                    "input {:?} does not end in {k} (weight {:?})",
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        if let Some(b) = b {
            if b.shape() != [n] {
                return Err(Error::shape(
                    op,
                    format!("bias must be [{n}], got {:?}", b.shape()),
                ));
            }
        }
        let m = x.numel() / k.max(1);
        let mut out_shape = x.shape().to_vec();
        *out_shape.last_mut().expect("rank >= 1") = n;
        let dtype = x.dtype();
        let w_t = kind == Affine::Addmm;
        if x.storage().is_device() {
            return self.device_affine(kind, x, w, b, m, k, out_shape, &ins);
        }
        let out = match (
            super::fdata(x, op)?,
            super::fdata(w, op)?,
            b.map(|t| super::fdata(t, op)).transpose()?,
        ) {
            (FData::F32(xd), FData::F32(wd), Some(FData::F32(bd))) => {
                cpu::linear_fwd(xd, wd, w_t, Some(bd), m, k, n, &out_shape, dtype)?
            }
            (FData::F32(xd), FData::F32(wd), None) => {
                cpu::linear_fwd(xd, wd, w_t, None, m, k, n, &out_shape, dtype)?
            }
            (FData::F64(xd), FData::F64(wd), Some(FData::F64(bd))) => {
                cpu::linear_fwd(xd, wd, w_t, Some(bd), m, k, n, &out_shape, dtype)?
            }
            (FData::F64(xd), FData::F64(wd), None) => {
                cpu::linear_fwd(xd, wd, w_t, None, m, k, n, &out_shape, dtype)?
            }
            _ => return Err(Error::shape(op, "operands have different dtypes")),
        };
        let (xt, wt, has_b) = (x.clone(), w.clone(), b.is_some());
        let bw = Box::new(move |g: &Tensor| {
            let shapes = (xt.shape(), wt.shape());
            match (
                super::fdata(&xt, op)?,
                super::fdata(&wt, op)?,
                super::fdata(g, op)?,
            ) {
                (FData::F32(x), FData::F32(w), FData::F32(g)) => {
                    cpu::linear_bwd(x, w, w_t, g, (m, k, n), shapes, has_b, dtype)
                }
                (FData::F64(x), FData::F64(w), FData::F64(g)) => {
                    cpu::linear_bwd(x, w, w_t, g, (m, k, n), shapes, has_b, dtype)
                }
                _ => Err(Error::shape(op, "gradient dtype differs from inputs")),
            }
        });
        let refs: Vec<&Tensor> = ins.iter().collect();
        self.record(op, &refs, kind.wrt(), out, Some(bw))
    }

    /// [`Engine::linear`] and [`Engine::addmm`] on the device: cuBLAS, the bias added in
    /// f32, one rounding.
    #[allow(clippy::too_many_arguments)]
    fn device_affine(
        &mut self,
        kind: Affine,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        m: usize,
        k: usize,
        out_shape: Vec<usize>,
        ins: &[Tensor],
    ) -> Result<Tensor> {
        let w_t = kind == Affine::Addmm;
        let x2 = x.view_as(&[m, k])?;
        let (slot, sink) = super::device_out(x)?;
        let y = cuda::linear(&x2, w, w_t, b, sink)?.view_as(&out_shape)?;
        let out = Computed::pending(y, slot);
        let n = out_shape[out_shape.len() - 1];
        let (xt, wt, has_b) = (x2, w.clone(), b.is_some());
        let x_shape = x.shape().to_vec();
        let bw = Box::new(move |g: &Tensor| {
            let g2 = g.view_as(&[m, n])?;
            let mut slots = [0u32; 3];
            let mut sinks = [super::cuda::Out::NONE; 3];
            let taken = super::device_counts_n(&xt, if has_b { 3 } else { 2 })?;
            for (i, (s, c)) in taken.into_iter().enumerate() {
                (slots[i], sinks[i]) = (s, super::cuda::Out::new(s, c));
            }
            let [gx, gw, gb] = cuda::linear_backward(&xt, &wt, w_t, &g2, has_b, sinks)?;
            let gx = gx.map(|t| t.view_as(&x_shape)).transpose()?;
            Ok([gx, gw, gb]
                .into_iter()
                .zip(slots)
                .map(|(t, s)| t.and_then(|t| grad(Computed::pending(t, s))))
                .collect())
        });
        let refs: Vec<&Tensor> = ins.iter().collect();
        self.record(kind.op(), &refs, kind.wrt(), out, Some(bw))
    }

    fn matmul_op(&mut self, op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, op, "left operand")?;
        expect_float(b, op, "right operand")?;
        let ins = self.prepare(op, &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let s = mm_shape(a.shape(), b.shape(), op)?;
        let dtype = a.dtype();
        if a.storage().is_device() {
            let out = device_matmul(a, b, &s)?;
            let (at, bt) = (a.clone(), b.clone());
            let bw = Box::new(move |g: &Tensor| device_matmul_backward(&at, &bt, g, &s));
            return self.record(op, &[a, b], &["self", "other"], out, Some(bw));
        }
        let out = with_float2!(a, b, op, |x, y| cpu::matmul_fwd(x, y, &s, dtype))?;
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| {
            let (ga, gb) = match (
                super::fdata(&at, op)?,
                super::fdata(&bt, op)?,
                super::fdata(g, op)?,
            ) {
                (FData::F32(x), FData::F32(y), FData::F32(gg)) => {
                    cpu::matmul_bwd(x, y, gg, &s, at.shape(), bt.shape(), dtype)?
                }
                (FData::F64(x), FData::F64(y), FData::F64(gg)) => {
                    cpu::matmul_bwd(x, y, gg, &s, at.shape(), bt.shape(), dtype)?
                }
                _ => return Err(Error::shape(op, "gradient dtype differs from inputs")),
            };
            Ok(vec![grad(ga), grad(gb)])
        });
        self.record(op, &[a, b], &["self", "other"], out, Some(bw))
    }

    /// Matrix product of a [..., m, k] and b [..., k, n] (same batch dims) or b [k, n].
    pub fn matmul(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.matmul_op("matmul", a, b)
    }

    /// Batched matrix product of a [B, m, k] and b [B, k, n].
    pub fn bmm(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if a.rank() != 3 || b.rank() != 3 {
            return Err(Error::shape(
                "bmm",
                format!(
                    "needs rank-3 operands, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        self.matmul_op("bmm", a, b)
    }
}
