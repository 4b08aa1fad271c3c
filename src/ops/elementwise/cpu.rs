//! The elementwise kernels on the host: compute in `T` (f32, or f64 for the reference),
//! round once to the output dtype.

use super::{Binary, Unary};
use crate::engine::Computed;
use crate::error::Result;
use crate::ops::{bstrides, for_each_offset, sum_to, Finish, Pattern};

/// Tensors at least this long are computed over rayon's threads (each element on its own,
/// so the result is the same).
const PAR_MIN: usize = 64 * 1024;

/// `f(i)` for every index below `n`, in order, over rayon's threads when `n` is large.
fn map_indexed<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    use rayon::prelude::*;
    if n >= PAR_MIN {
        (0..n)
            .into_par_iter()
            .with_min_len(PAR_MIN / 4)
            .map(f)
            .collect()
    } else {
        (0..n).map(f).collect()
    }
}

pub(super) fn unary<T: Finish>(
    x: &[T],
    op: Unary,
    shape: &[usize],
    dtype: crate::dtype::DType,
) -> Result<Computed> {
    T::finish(map_indexed(x.len(), |i| op.f(x[i])), shape, dtype)
}

pub(super) fn unary_backward<T: Finish>(
    x: &[T],
    y: &[T],
    g: &[T],
    op: Unary,
    shape: &[usize],
    dtype: crate::dtype::DType,
) -> Result<Computed> {
    let n = x.len().min(y.len()).min(g.len());
    T::finish(map_indexed(n, |i| op.df(x[i], y[i], g[i])), shape, dtype)
}

pub(super) fn binary<T: Finish>(
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    out: &[usize],
    op: Binary,
    dtype: crate::dtype::DType,
) -> Result<Computed> {
    let n: usize = out.iter().product();
    if sa == out && sb == out {
        let m = a.len().min(b.len());
        return T::finish(map_indexed(m, |i| op.f(a[i], b[i])), out, dtype);
    }
    let mut res = Vec::with_capacity(n);
    match (sa == out, sb == out) {
        (true, false) if Pattern::of(sb, out) == Pattern::Tile(b.len()) => {
            for rowv in a.chunks_exact(b.len()) {
                res.extend(rowv.iter().zip(b).map(|(&x, &y)| op.f(x, y)));
            }
        }
        (true, false) if matches!(Pattern::of(sb, out), Pattern::Repeat(_)) => {
            let r = n / b.len();
            for (rowv, &y) in a.chunks_exact(r).zip(b) {
                res.extend(rowv.iter().map(|&x| op.f(x, y)));
            }
        }
        (false, true) if Pattern::of(sa, out) == Pattern::Tile(a.len()) => {
            for rowv in b.chunks_exact(a.len()) {
                res.extend(a.iter().zip(rowv).map(|(&x, &y)| op.f(x, y)));
            }
        }
        (false, true) if matches!(Pattern::of(sa, out), Pattern::Repeat(_)) => {
            let r = n / a.len();
            for (rowv, &x) in b.chunks_exact(r).zip(a) {
                res.extend(rowv.iter().map(|&y| op.f(x, y)));
            }
        }
        _ => {
            let (ta, tb) = (bstrides(sa, out), bstrides(sb, out));
            for_each_offset(out, [&ta, &tb], |[i, j]| res.push(op.f(a[i], b[j])));
        }
    }
    T::finish(res, out, dtype)
}

/// Gradient of one operand of a broadcast binary op: `h(a, b, g)` at the full shape,
/// summed down to the operand's shape.
// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn binary_grad<T: Finish>(
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    g: &[T],
    out: &[usize],
    target: &[usize],
    dtype: crate::dtype::DType,
    h: impl Fn(T, T, T) -> T + Sync + Send,
) -> Result<Computed> {
    let n: usize = out.iter().product();
    if sa == out && sb == out {
        let m = a.len().min(b.len()).min(g.len());
        return T::finish(map_indexed(m, |i| h(a[i], b[i], g[i])), target, dtype);
    }
    let mut full = Vec::with_capacity(n);
    let (ta, tb) = (bstrides(sa, out), bstrides(sb, out));
    let tg = crate::tensor::strides(out);
    for_each_offset(out, [&ta, &tb, &tg], |[i, j, k]| {
        full.push(h(a[i], b[j], g[k]))
    });
    sum_to(&full, out, target, dtype)
}
