//! What a backend must provide for the matrix products: the [`Kernels`] trait,
//! implemented on the host (`cpu::Host`, the gemm crate) and on a device (`cuda::Device`,
//! cuBLAS); the ops in `mod.rs` reach their kernels only through it.

use super::shape::MmShape;
use crate::engine::{Computed, Grad};
use crate::error::Result;
use crate::tensor::Tensor;

/// An affine op's sizes: rows `m` (every dim of the input but the last), inner `k`,
/// outputs `n`.
pub(crate) type Mkn = (usize, usize, usize);

/// The matrix-product kernels of one backend: f32 accumulation (f64 for the reference
/// dtype), one rounding to the operands' dtype.
pub(crate) trait Kernels: Sync {
    /// `x·wᵀ + b` for w [n, k], or `x·w + b` for w [k, n] when `w_t`, shaped `out_shape`.
    #[allow(clippy::too_many_arguments)]
    fn affine(
        &self,
        op: &'static str,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        w_t: bool,
        mkn: Mkn,
        out_shape: &[usize],
    ) -> Result<Computed>;

    /// The affine op's gradients for x, w and (with `has_b`) b from the output gradient.
    #[allow(clippy::too_many_arguments)]
    fn affine_backward(
        &self,
        op: &'static str,
        x: &Tensor,
        w: &Tensor,
        w_t: bool,
        g: &Tensor,
        mkn: Mkn,
        has_b: bool,
    ) -> Result<Vec<Option<Grad>>>;

    /// The matrix product of `a` and `b` as `s` lays them out.
    fn matmul(&self, op: &'static str, a: &Tensor, b: &Tensor, s: &MmShape) -> Result<Computed>;

    /// Its gradients for `a` and `b` from the output gradient `g`.
    fn matmul_backward(
        &self,
        op: &'static str,
        a: &Tensor,
        b: &Tensor,
        g: &Tensor,
        s: &MmShape,
    ) -> Result<Vec<Option<Grad>>>;
}
