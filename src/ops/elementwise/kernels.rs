//! What a backend must provide for the elementwise family: the [`Kernels`] trait, with
//! one implementation on the host (`cpu::Host`) and one on a device (`cuda::Device`). The
//! ops in `mod.rs` reach their kernels only through it, so a backend that lacks one does
//! not compile.

use super::functions::{Binary, Unary};
use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::tensor::Tensor;

/// An operand of a binary op as its backward keeps it: its shape, and its values where
/// the gradient being computed reads them.
#[derive(Clone, Copy)]
pub struct Side<'a> {
    /// The operand's shape.
    pub shape: &'a [usize],
    /// Its values (None: released, as no needed gradient reads them).
    pub values: Option<&'a Tensor>,
}

/// The elementwise kernels of one backend. Each computes in f32 (f64 for the reference
/// dtype) and rounds once to its output's dtype, counting where it rounds.
pub trait Kernels: Sync {
    /// Whether any value of `x` is infinite, answered now (`Some`) where reading values
    /// costs nothing; `None` where the backend decides it beside the values instead
    /// (`unary`'s `on_inf`).
    fn any_inf(&self, x: &Tensor) -> Result<Option<bool>>;

    /// `y = op(x)` in x's dtype, and what the backward keeps beside x and y (the host's
    /// exact GELU keeps its cdf, a device its inf flag). `on_inf`: the two parameters that
    /// replace the op's own when `x` holds an inf, decided by the backend where the values
    /// are (only a backend whose `any_inf` is `None` accepts them).
    fn unary(
        &self,
        op: Unary,
        x: &Tensor,
        on_inf: Option<(f64, f64)>,
    ) -> Result<(Computed, Option<Tensor>)>;

    /// `dx = f'(x)·g` in `dtype` (the forward input's) from the forward's input, output,
    /// output gradient and what `unary` kept, with the forward's `on_inf`. An input or
    /// output that `op.reads()` does not name may be `g` standing in.
    fn unary_backward(
        &self,
        op: Unary,
        xyg: (&Tensor, &Tensor, &Tensor),
        dtype: DType,
        kept: Option<&Tensor>,
        on_inf: Option<(f64, f64)>,
    ) -> Result<Computed>;

    /// `a op b` broadcast to `out_shape`.
    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out_shape: &[usize]) -> Result<Computed>;

    /// The gradient of the left operand (`wrt_b` false) or the right one from the output
    /// gradient `g` (of shape `out_shape`), summed down to the operand's shape and rounded
    /// to `dtype` (the operands'). The caller passes through the gradients that are `g`
    /// itself.
    fn binary_grad(
        &self,
        op: Binary,
        sides: [Side<'_>; 2],
        g: &Tensor,
        out_shape: &[usize],
        dtype: DType,
        wrt_b: bool,
    ) -> Result<Computed>;
}
