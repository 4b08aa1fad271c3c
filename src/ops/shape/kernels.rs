//! What a backend must provide for the shape ops: the [`Kernels`] trait, implemented on
//! the host (`cpu::Host`) and on a device (`cuda::Device`); the ops in `mod.rs` reach
//! their kernels only through it. Values move; nothing rounds.

use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// The strided copies of one backend. Each returns its output and, on a device, the arena
/// slot where the copy gathered the output's statistics.
pub trait Kernels: Sync {
    /// A new contiguous tensor of `out_shape` and `dtype` whose element at index i is
    /// `x[base + Σ i·src]`.
    fn gather_strided(
        &self,
        op: &'static str,
        x: &Tensor,
        out_shape: &[usize],
        route: (&[usize], usize),
        dtype: DType,
    ) -> Result<(Tensor, Option<u32>)>;

    /// The gradient of [`Kernels::gather_strided`]: a tensor of `in_shape` holding `g`
    /// (of `out_shape`) where the copy read, zero elsewhere unless the route was `onto`
    /// (it read every element).
    fn scatter_strided(
        &self,
        op: &'static str,
        g: &Tensor,
        shapes: (&[usize], &[usize]),
        route: (&[usize], usize),
        onto: bool,
        dtype: DType,
    ) -> Result<(Tensor, Option<u32>)>;

    /// The inputs of `cat` placed at element offsets `offs` of a tensor of `out_shape`
    /// (strides `os`), in the first input's dtype.
    fn cat(
        &self,
        ins: &[Tensor],
        out_shape: &[usize],
        os: &[usize],
        offs: &[usize],
    ) -> Result<Tensor>;
}
