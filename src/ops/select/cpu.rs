//! The `where` and `masked_fill` kernels on the host.

use crate::dtype::DType;
use crate::engine::Computed;
use crate::error::Result;
use crate::ops::{for_each_offset, sum_to, Finish};
use crate::tensor::{numel, strides};
use std::sync::Arc;

/// Picks `a` where `c` is true and `b` elsewhere, over the broadcast `out` shape.
pub(super) fn pick<T: Copy>(
    c: &[bool],
    a: &[T],
    b: &[T],
    strides: [&[usize]; 3],
    out: &[usize],
) -> Arc<Vec<T>> {
    let mut v = Vec::with_capacity(numel(out));
    for_each_offset(out, strides, |[i, j, k]| {
        v.push(if c[i] { a[j] } else { b[k] })
    });
    Arc::new(v)
}

/// The gradient of one branch of `where`: `g` where the condition equals `branch`, zero
/// elsewhere, summed down to the branch's shape in f64 and rounded once.
pub(super) fn where_grad<T: Finish>(
    c: &[bool],
    cs: &[usize],
    g: &[T],
    out: &[usize],
    branch: bool,
    target: &[usize],
    dtype: DType,
) -> Result<Computed> {
    let mut full = Vec::with_capacity(g.len());
    for_each_offset(out, [cs, &strides(out)], |[i, k]| {
        full.push(if c[i] == branch { g[k] } else { T::zero() })
    });
    sum_to(&full, out, target, dtype)
}

/// `x` with `v` written where the broadcast mask is true (`v` is exact in the dtype).
pub(super) fn fill<T: Finish>(
    x: &[T],
    m: &[bool],
    ms: &[usize],
    v: f64,
    shape: &[usize],
    dtype: DType,
) -> Result<Computed> {
    let mut y = Vec::with_capacity(x.len());
    let v = T::of(v);
    for_each_offset(shape, [ms, &strides(shape)], |[i, k]| {
        y.push(if m[i] { v } else { x[k] })
    });
    T::finish(y, shape, dtype)
}
