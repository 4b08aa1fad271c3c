//! The host's view of a GEMM operand, shared by its two kernel choices.

/// A strided matrix operand: data, row stride, column stride.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}
