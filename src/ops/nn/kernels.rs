//! What a backend must provide for layer norm, embedding and dropout: the [`Kernels`]
//! trait, implemented on the host (`cpu::Host`) and on a device (`cuda::Device`); the ops
//! in `mod.rs` reach their kernels only through it.

use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::Result;
use crate::rng::Rng;
use crate::tensor::Tensor;

/// A layer norm's row statistics (mean and 1/√(var + eps)), kept for the backward where
/// the backend computed them.
pub enum Stats {
    /// Host rows of an f32 input.
    F32(Vec<f32>, Vec<f32>),
    /// Host rows of an f64 input.
    F64(Vec<f64>, Vec<f64>),
    /// f32 device tensors.
    Device(Tensor, Tensor),
}

/// A dropout's keep mask as the backend keeps it: drawn on the host, or regenerated on
/// the device from its stream's state.
pub enum Mask {
    /// One flag per element.
    Host(Vec<bool>),
    /// The stream's state and the keep probability.
    Device {
        /// The state of the mask's stream.
        state: u64,
        /// The probability of keeping an element.
        keep: f64,
    },
}

/// The layer-norm, embedding and dropout kernels of one backend.
pub trait Kernels: Sync {
    /// Layer norm of `x` over its last dim (size `d`) with optional weight and bias, the
    /// row statistics in f64, the output rounded once; and the statistics.
    fn layer_norm(
        &self,
        x: &Tensor,
        wb: (Option<&Tensor>, Option<&Tensor>),
        d: usize,
        eps: f64,
    ) -> Result<(Computed, Stats)>;

    /// Its gradients for x, the weight (when given) and the bias (with `has_b`).
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        has_b: bool,
        g: &Tensor,
        stats: &Stats,
        d: usize,
    ) -> Result<Vec<Option<Grad>>>;

    /// Rows of `w` [V, D] at the checked int64 `ids`, shaped `out_shape` (nothing
    /// rounds), and the ids where this backend's backward reads them.
    fn embedding(
        &self,
        w: &Tensor,
        ids: &Tensor,
        out_shape: &[usize],
    ) -> Result<(Computed, Tensor)>;

    /// The weight's gradient [v, d] in `dtype`: rows of `g` added at their ids in f64
    /// (none at `pad`), rounded once.
    fn embedding_backward(
        &self,
        g: &Tensor,
        ids: &Tensor,
        vd: (usize, usize),
        pad: i64,
        dtype: DType,
    ) -> Result<Computed>;

    /// `x · mask · scale`, element `i` kept when the `i+1`-th uniform draw of `rng` is
    /// below `keep`; and the mask as the backward needs it.
    fn dropout(&self, x: &Tensor, rng: Rng, keep: f64, scale: f64) -> Result<(Computed, Mask)>;

    /// Its gradient: `g · mask · scale`, in `dtype`.
    fn dropout_backward(
        &self,
        g: &Tensor,
        mask: &Mask,
        scale: f64,
        dtype: DType,
    ) -> Result<Computed>;
}
