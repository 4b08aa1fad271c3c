//! Matrix products: linear (+bias), matmul, bmm. GEMM accumulates in f32 (f64 for the
//! reference dtype) and the result is rounded once to the output dtype.

//!
//! The host kernels are in `cpu.rs` (the gemm crate, f32 accumulation, or on request the
//! fixed-order kernels of `fixed_order.rs`: see `host_gemm.rs`; bf16 operands by the CPU's
//! bf16 dot products where they are exact, `bf16_dot.rs`); the device path in
//! `cuda.rs` (cuBLAS).

mod bf16_dot;
mod cpu;
pub mod cuda;
mod fixed_order;
pub mod host_gemm;
mod kernels;
mod mat;
mod shape;

pub(crate) use kernels::Kernels;
pub(crate) use shape::mm_shape;

use super::expect_float;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The matrix-product kernels of the backend that holds `t`.
pub(crate) fn kernels(t: &Tensor) -> &'static dyn Kernels {
    if super::on_device(t) {
        &cuda::Device
    } else {
        &cpu::Host
    }
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
        let w_t = kind == Affine::Addmm;
        let kern = kernels(x);
        let out = kern.affine(op, x, w, b, w_t, (m, k, n), &out_shape)?;
        let (xt, wt, has_b) = (x.clone(), w.clone(), b.is_some());
        let bw = Box::new(move |g: &Tensor| {
            kern.affine_backward(op, &xt, &wt, w_t, g, (m, k, n), has_b)
        });
        let refs: Vec<&Tensor> = ins.iter().collect();
        self.record(
            op,
            &refs,
            kind.wrt(),
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.affine(kind, &r[0], &r[1], r.get(2))),
        )
    }

    fn matmul_op(&mut self, op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, op, "left operand")?;
        expect_float(b, op, "right operand")?;
        let ins = self.prepare(op, &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        let s = mm_shape(a.shape(), b.shape(), op)?;
        let k = kernels(a);
        let out = k.matmul(op, a, b, &s)?;
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| k.matmul_backward(op, &at, &bt, g, &s));
        self.record(
            op,
            &[a, b],
            &["self", "other"],
            out,
            Some(bw),
            Box::new(move |e: &mut Engine, r: &[Tensor]| e.matmul_op(op, &r[0], &r[1])),
        )
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
