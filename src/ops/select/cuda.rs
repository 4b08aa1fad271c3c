//! Device host code of the select family (kernels in `select.cu`).

/// The kernels of `select.cu`.
pub const KERNELS: &[&str] = &[];
