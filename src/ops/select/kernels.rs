//! What a backend must provide for `where` and `masked_fill`: the [`Kernels`] trait,
//! implemented on the host (`cpu::Host`) and on a device (`cuda::Device`); the ops in
//! `mod.rs` reach their kernels only through it.

use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::tensor::Tensor;

/// A condition or mask as the backend that ran the forward keeps it for the backward.
pub enum Truth {
    /// Truth values on the host, with the strides that broadcast them to the output.
    Host(Vec<bool>, Vec<usize>),
    /// A device tensor (nonzero is true).
    Device(Tensor),
}

/// The selection kernels of one backend: values are picked, not computed; only a fill
/// value is ever rounded.
pub trait Kernels: Sync {
    /// `a` where `cond` is nonzero (NaN included), else `b`, broadcast to `out_shape`;
    /// and the condition as the backward reads it.
    fn where_(
        &self,
        cond: &Tensor,
        a: &Tensor,
        b: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Truth)>;

    /// The gradient of one branch (`on`: the one taken where the condition holds) from
    /// the output gradient, summed to `target`'s shape in `dtype`.
    fn where_grad(
        &self,
        c: &Truth,
        g: &Tensor,
        out_shape: &[usize],
        on: bool,
        target: &[usize],
        dtype: DType,
    ) -> Result<Computed>;

    /// `x` with `v` (the fill `value` rounded to x's dtype) where `mask`, broadcast, is
    /// set; the fill's underflows counted (`fill_underflowed`), a `-inf` fill's positions
    /// reported as intentional; and the mask as the backward reads it.
    fn masked_fill(
        &self,
        x: &Tensor,
        mask: &Tensor,
        value: f64,
        v: f64,
        fill_underflowed: bool,
    ) -> Result<(Computed, Truth)>;

    /// Its gradient: `g` with zeros where masked, in `dtype`.
    fn masked_fill_backward(&self, g: &Tensor, m: &Truth, dtype: DType) -> Result<Computed>;
}
