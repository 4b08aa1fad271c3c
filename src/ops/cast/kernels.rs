//! What a backend must provide for a cast: the [`Kernels`] trait, implemented on the host
//! (`cpu::Host`) and on a device (`cuda::Device`).

use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::tensor::Tensor;

/// The cast kernel of one backend.
pub trait Kernels: Sync {
    /// `x` in dtype `to` (neither int64), rounded once to nearest even, its overflows and
    /// underflows counted.
    fn cast(&self, x: &Tensor, to: DType) -> Result<Computed>;
}
