//! What a backend must provide for the reductions: the [`Kernels`] trait, implemented on
//! the host (`cpu::Host`) and on a device (`cuda::Device`); the ops in `mod.rs` reach
//! their kernels only through it.

use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::tensor::Tensor;

/// Where the gradient of max goes, as the backend that ran the forward keeps it: flat
/// offsets on the host, an int64 tensor on a device.
pub enum MaxIdx {
    /// Flat offsets into the input, one per output element.
    Host(Vec<usize>),
    /// The same offsets in device memory.
    Device(Tensor),
}

/// A one-dim op's lines: (elements before the dim, its size, elements after).
pub type Lines = (usize, usize, usize);

/// The reduction and softmax kernels of one backend: sums in f64, exponentials in f32
/// (f64 for the reference dtype), one rounding to the output's dtype.
pub trait Kernels: Sync {
    /// The sum of `x` down to `kept` (its shape with the reduced dims 1), divided by `div`
    /// when given (a mean), shaped `out_shape`.
    fn sum(
        &self,
        op: &'static str,
        x: &Tensor,
        kept: &[usize],
        div: Option<f64>,
        out_shape: &[usize],
    ) -> Result<Computed>;

    /// A sum's gradient: `g` (the values of shape `kept`) spread over `full`, divided by
    /// `div` when given, in `dtype`.
    fn sum_backward(
        &self,
        op: &'static str,
        g: &Tensor,
        kept_full: (&[usize], &[usize]),
        div: Option<f64>,
        dtype: DType,
    ) -> Result<Computed>;

    /// The maximum of each line (a NaN is maximal), shaped `out_shape`, and where each is.
    fn argmax(&self, x: &Tensor, lines: Lines, out_shape: &[usize]) -> Result<(Tensor, MaxIdx)>;

    /// max's gradient: `g` put where `idx` says, zeros elsewhere, shaped `in_shape` in
    /// `dtype` (nothing rounds).
    fn argmax_backward(
        &self,
        g: &Tensor,
        idx: &MaxIdx,
        lines: Lines,
        in_shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor>;

    /// Softmax (or log-softmax when `log`) along the lines.
    fn softmax(&self, op: &'static str, x: &Tensor, lines: Lines, log: bool) -> Result<Computed>;

    /// Its gradient from its output `y` and the output gradient `g`, in `dtype`.
    fn softmax_backward(
        &self,
        op: &'static str,
        y: &Tensor,
        g: &Tensor,
        lines: Lines,
        log: bool,
        dtype: DType,
    ) -> Result<Computed>;
}
