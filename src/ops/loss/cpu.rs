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
    let s: f64 = row.iter().map(|&v| (v - m).exp_op().f64()).sum();
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
    use rayon::prelude::*;
    // Each row's loss alone (over rayon's threads for large inputs), then summed in row order.
    let row_loss =
        |(row, &y): (&[T], &i64)| (Some(y) != ignore).then(|| (lse(row) - row[y as usize]).f64());
    let losses: Vec<Option<f64>> = if x.len() >= crate::ops::PAR_MIN && c > 0 {
        x.par_chunks(c).zip(t.par_iter()).map(row_loss).collect()
    } else {
        x.chunks(c.max(1)).zip(t).map(row_loss).collect()
    };
    let mut total = 0f64;
    for l in losses.into_iter().flatten() {
        total += l;
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
    use rayon::prelude::*;
    let mut out = vec![T::zero(); x.len()];
    let row_grad = |((row, o), &y): ((&[T], &mut [T]), &i64)| {
        if Some(y) == ignore {
            return;
        }
        let l = lse(row);
        for (j, (v, oo)) in row.iter().zip(o.iter_mut()).enumerate() {
            let p = (*v - l).exp_op();
            let onehot = if j == y as usize { T::one() } else { T::zero() };
            *oo = (p - onehot) * scale;
        }
    };
    if x.len() >= crate::ops::PAR_MIN && c > 0 {
        x.par_chunks(c)
            .zip(out.par_chunks_mut(c))
            .zip(t.par_iter())
            .for_each(row_grad);
    } else if c > 0 {
        x.chunks(c).zip(out.chunks_mut(c)).zip(t).for_each(row_grad);
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
