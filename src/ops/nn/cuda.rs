//! Device host code of the nn family (kernels in `nn.cu`).

/// The kernels of `nn.cu`.
pub const KERNELS: &[&str] = &[];
