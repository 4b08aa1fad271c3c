//! The loss kernels on the host: log-sum-exp, cross-entropy, NLL and MSE with their
//! gradients.

use super::*;

/// Row-wise log-sum-exp, computed in T with the sum accumulated in f64.
pub(super) fn lse<T: Real>(row: &[T]) -> T {
    let m = row.iter().fold(
        T::neg_infinity(),
        |a, &b| if b > a || b.is_nan() { b } else { a },
    );
    if !m.is_finite() {
        return m;
    }
    let s: f64 = row.iter().map(|&v| (v - m).exp().f64()).sum();
    m + T::of(s).ln()
}

pub(super) fn ce_fwd<T: Finish>(
    x: &[T],
    t: &[i64],
    c: usize,
    ignore: Option<i64>,
    valid: usize,
    dtype: crate::DType,
) -> Result<Computed> {
    let mut total = 0f64;
    for (row, &y) in x.chunks(c).zip(t) {
        if Some(y) == ignore {
            continue;
        }
        total += (lse(row) - row[y as usize]).f64();
    }
    T::finish_acc(vec![total / valid as f64], &[], dtype)
}

// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn ce_bwd<T: Finish>(
    x: &[T],
    t: &[i64],
    g: T,
    c: usize,
    ignore: Option<i64>,
    valid: usize,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let scale = g / T::of(valid as f64);
    let mut out = vec![T::zero(); x.len()];
    for ((row, o), &y) in x.chunks(c).zip(out.chunks_mut(c)).zip(t) {
        if Some(y) == ignore {
            continue;
        }
        let l = lse(row);
        for (j, (v, oo)) in row.iter().zip(o.iter_mut()).enumerate() {
            let p = (*v - l).exp();
            let onehot = if j == y as usize { T::one() } else { T::zero() };
            *oo = (p - onehot) * scale;
        }
    }
    T::finish(out, shape, dtype)
}

pub(super) fn mse_fwd<T: Finish>(a: &[T], b: &[T], dtype: crate::DType) -> Result<Computed> {
    let s: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = x - y;
            (d * d).f64()
        })
        .sum();
    T::finish_acc(vec![s / a.len() as f64], &[], dtype)
}

pub(super) fn mse_bwd<T: Finish>(
    a: &[T],
    b: &[T],
    g: T,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<(Computed, Computed)> {
    let k = T::of(2.0) * g / T::of(a.len() as f64);
    let ga: Vec<T> = a.iter().zip(b).map(|(&x, &y)| (x - y) * k).collect();
    let gb: Vec<T> = ga.iter().map(|&v| -v).collect();
    Ok((T::finish(ga, shape, dtype)?, T::finish(gb, shape, dtype)?))
}

pub(super) fn nll_fwd<T: Finish>(
    lp: &[T],
    t: &[i64],
    c: usize,
    ignore: Option<i64>,
    valid: usize,
    dtype: crate::DType,
) -> Result<Computed> {
    let total: f64 = lp
        .chunks(c)
        .zip(t)
        .filter(|(_, &y)| Some(y) != ignore)
        .map(|(row, &y)| -row[y as usize].f64())
        .sum();
    T::finish_acc(vec![total / valid as f64], &[], dtype)
}

// A kernel takes its operands, their shapes and the output dtype explicitly.
#[allow(clippy::too_many_arguments)]
pub(super) fn nll_bwd<T: Finish>(
    n: usize,
    t: &[i64],
    g: T,
    c: usize,
    ignore: Option<i64>,
    valid: usize,
    shape: &[usize],
    dtype: crate::DType,
) -> Result<Computed> {
    let mut out = vec![T::zero(); n];
    let v = -g / T::of(valid as f64);
    for (o, &y) in out.chunks_mut(c).zip(t) {
        if Some(y) != ignore {
            o[y as usize] = v;
        }
    }
    T::finish(out, shape, dtype)
}
