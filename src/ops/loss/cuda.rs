//! Device host code of the loss family (kernels in `loss.cu`).

/// The kernels of `loss.cu`.
pub const KERNELS: &[&str] = &[];
