//! What a backend must provide for the losses: the [`Kernels`] trait, implemented on the
//! host (`cpu::Host`) and on a device (`cuda::Device`); the ops in `mod.rs` reach their
//! kernels only through it.

use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::Result;
use crate::tensor::Tensor;

/// How many labels a class loss counts (its mean's divisor): known on the host at once,
/// counted into device memory by a device's forward.
pub enum Valid {
    /// Counted on the host.
    Host(usize),
    /// A device scalar written by the forward kernel.
    Device(Tensor),
}

/// What a class loss's forward keeps for its backward.
pub struct ClassKept {
    /// The number of classes (the input's last dim).
    pub classes: usize,
    /// The labels, where the backend's kernels read them.
    pub labels: Tensor,
    /// How many labels count.
    pub valid: Valid,
}

/// The loss kernels of one backend: means accumulated in f64, one rounding.
pub trait Kernels: Sync {
    /// Mean negative log-likelihood of log-probabilities `x` [..., C] at int64 labels `t`
    /// (labels equal to `ignore` skipped; the others checked to be in 0..C).
    fn nll(&self, x: &Tensor, t: &Tensor, ignore: Option<i64>) -> Result<(Computed, ClassKept)>;

    /// Its gradient for `x` (of `shape` and `dtype`) from the output gradient `g`.
    fn nll_backward(
        &self,
        shape: &[usize],
        dtype: DType,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed>;

    /// Mean cross-entropy of logits `x` [..., C] at labels `t`, as [`Kernels::nll`].
    fn cross_entropy(
        &self,
        x: &Tensor,
        t: &Tensor,
        ignore: Option<i64>,
    ) -> Result<(Computed, ClassKept)>;

    /// Its gradient for `x` from the output gradient `g`.
    fn cross_entropy_backward(
        &self,
        x: &Tensor,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed>;

    /// Mean squared error of `a` and `b` (of one shape).
    fn mse(&self, a: &Tensor, b: &Tensor) -> Result<Computed>;

    /// Its gradients for `a` and `b` from the output gradient `g`.
    fn mse_backward(&self, a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Vec<Option<Grad>>>;
}
