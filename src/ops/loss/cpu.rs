//! The loss kernels on the host: log-sum-exp, cross-entropy, NLL and MSE with their
//! gradients.

use super::kernels::{ClassKept, Kernels, Valid};
use super::labels::class_targets;
use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::{fdata, grad, with_float, with_float2, FData, Finish};
use crate::tensor::{Real, Tensor};

/// Row-wise log-sum-exp, computed in T with the sum accumulated in f64 in row order.
pub(super) fn lse<T: Real>(row: &[T]) -> T {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<T: Real>(row: &[T]) -> T {
            lse_in(row)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU was just checked to have AVX2.
            return unsafe { avx2(row) };
        }
    }
    lse_in(row)
}

/// The largest value of a row, or its last NaN (-inf for an empty row).
#[inline(always)]
fn row_max<T: Real>(row: &[T]) -> T {
    row.iter().fold(
        T::neg_infinity(),
        |a, &b| if b > a || b.is_nan() { b } else { a },
    )
}

/// Exponentials [`lse_in`] computes at a time, before adding them in order.
const LSE_BLOCK: usize = 64;

/// [`lse`]'s body. The exponentials of a block are computed first, in a loop of their own
/// that the compiler vectorizes, and then added one by one: the same terms in the same
/// order as adding each as it is computed.
#[inline(always)]
fn lse_in<T: Real>(row: &[T]) -> T {
    let m = row_max(row);
    if !m.is_finite() {
        return m;
    }
    let mut s = 0f64;
    let mut e = [0f64; LSE_BLOCK];
    for block in row.chunks(LSE_BLOCK) {
        let e = &mut e[..block.len()];
        for (ei, &v) in e.iter_mut().zip(block) {
            *ei = (v - m).exp_op().f64();
        }
        for &ei in e.iter() {
            s += ei;
        }
    }
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
        ce_grad_row(row, o, y as usize, scale);
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

/// One row of the cross-entropy gradient, `(softmax(row) - onehot(y)) * scale`, into `o`
/// (a copy for AVX2 where the CPU has it, as [`lse`]).
fn ce_grad_row<T: Real>(row: &[T], o: &mut [T], y: usize, scale: T) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<T: Real>(row: &[T], o: &mut [T], y: usize, scale: T) {
            ce_grad_row_in(row, o, y, scale)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU was just checked to have AVX2.
            return unsafe { avx2(row, o, y, scale) };
        }
    }
    ce_grad_row_in(row, o, y, scale)
}

/// [`ce_grad_row`]'s body: every element as `p * scale` (`p - 0` is `p`), then the target's
/// as `(p - 1) * scale` (none when `y` is out of the row).
#[inline(always)]
fn ce_grad_row_in<T: Real>(row: &[T], o: &mut [T], y: usize, scale: T) {
    let l = lse_in(row);
    for (v, oo) in row.iter().zip(o.iter_mut()) {
        *oo = (*v - l).exp_op() * scale;
    }
    if let (Some(&v), Some(oo)) = (row.get(y), o.get_mut(y)) {
        *oo = ((v - l).exp_op() - T::one()) * scale;
    }
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

/// The host's loss kernels.
pub(super) struct Host;

/// The host count of a forward that ran here.
fn host_valid(kept: &ClassKept, op: &str) -> Result<usize> {
    match kept.valid {
        Valid::Host(v) => Ok(v),
        Valid::Device(_) => Err(Error::Device(format!(
            "{op} backward: the forward counted its labels on a device"
        ))),
    }
}

impl Kernels for Host {
    fn nll(&self, x: &Tensor, t: &Tensor, ignore: Option<i64>) -> Result<(Computed, ClassKept)> {
        let (c, ti, valid) = class_targets("nll_loss", x, t, ignore)?;
        let dtype = x.dtype();
        let out = with_float!(x, "nll_loss", |d| nll_fwd(d, ti, c, ignore, valid, dtype))?;
        let kept = ClassKept {
            classes: c,
            labels: t.clone(),
            valid: Valid::Host(valid),
        };
        Ok((out, kept))
    }

    fn nll_backward(
        &self,
        shape: &[usize],
        dtype: DType,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed> {
        let (valid, c) = (host_valid(kept, "nll_loss")?, kept.classes);
        let ti = kept.labels.i64s()?;
        let n = crate::tensor::numel(shape);
        match fdata(g, "nll_loss")? {
            FData::F32(g) => nll_bwd(n, ti, g[0], c, ignore, valid, shape, dtype),
            FData::F64(g) => nll_bwd(n, ti, g[0], c, ignore, valid, shape, dtype),
        }
    }

    fn cross_entropy(
        &self,
        x: &Tensor,
        t: &Tensor,
        ignore: Option<i64>,
    ) -> Result<(Computed, ClassKept)> {
        const OP: &str = "cross_entropy_loss";
        let (c, ti, valid) = class_targets(OP, x, t, ignore)?;
        let dtype = x.dtype();
        let out = with_float!(x, OP, |d| ce_fwd(d, ti, c, ignore, valid, dtype))?;
        let kept = ClassKept {
            classes: c,
            labels: t.clone(),
            valid: Valid::Host(valid),
        };
        Ok((out, kept))
    }

    fn cross_entropy_backward(
        &self,
        x: &Tensor,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed> {
        const OP: &str = "cross_entropy_loss";
        let (valid, c, dtype) = (host_valid(kept, OP)?, kept.classes, x.dtype());
        let ti = kept.labels.i64s()?;
        match (fdata(x, OP)?, fdata(g, OP)?) {
            (FData::F32(xd), FData::F32(g)) => {
                ce_bwd(xd, ti, g[0], c, ignore, valid, x.shape(), dtype)
            }
            (FData::F64(xd), FData::F64(g)) => {
                ce_bwd(xd, ti, g[0], c, ignore, valid, x.shape(), dtype)
            }
            _ => Err(Error::shape(OP, "gradient dtype differs from logits")),
        }
    }

    fn mse(&self, a: &Tensor, b: &Tensor) -> Result<Computed> {
        let dtype = a.dtype();
        with_float2!(a, b, "mse_loss", |x, y| mse_fwd(x, y, dtype))
    }

    fn mse_backward(&self, a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Vec<Option<Grad>>> {
        let dtype = a.dtype();
        let (ga, gb) = match (
            fdata(a, "mse_loss")?,
            fdata(b, "mse_loss")?,
            fdata(g, "mse_loss")?,
        ) {
            (FData::F32(x), FData::F32(y), FData::F32(g)) => mse_bwd(x, y, g[0], a.shape(), dtype)?,
            (FData::F64(x), FData::F64(y), FData::F64(g)) => mse_bwd(x, y, g[0], a.shape(), dtype)?,
            _ => {
                return Err(Error::shape(
                    "mse_loss",
                    "gradient dtype differs from inputs",
                ))
            }
        };
        Ok(vec![grad(ga), grad(gb)])
    }
}

#[cfg(test)]
mod tests {
    use super::lse;
    use crate::tensor::Real;

    /// The log-sum-exp of a row as one loop: each exponential added as it is computed.
    fn one_loop<T: Real>(row: &[T]) -> T {
        let m = super::row_max(row);
        if !m.is_finite() {
            return m;
        }
        let mut s = 0f64;
        for &v in row {
            s += (v - m).exp_op().f64();
        }
        m + T::of(s).ln()
    }

    #[test]
    fn cross_entropy_gradient_rows_are_the_one_loops_bit_for_bit() {
        let mut next = crate::rng::Rng::new(11);
        for n in [1, 5, 64, 129, 512] {
            for round in 0..10 {
                let mut row: Vec<f32> = (0..n)
                    .map(|_| (next.uniform() * 60.0 - 30.0) as f32)
                    .collect();
                if round == 3 {
                    row[n / 2] = f32::NAN;
                }
                let y = (round * 7) % (n + 1); // n: out of the row, no target
                let scale = 0.25f32 / (round + 1) as f32;
                let mut got = vec![0f32; n];
                super::ce_grad_row(&row, &mut got, y, scale);
                let l = one_loop(&row);
                for (j, (&v, g)) in row.iter().zip(&got).enumerate() {
                    let onehot = if j == y { 1.0 } else { 0.0 };
                    let want = ((v - l).exp_op() - onehot) * scale;
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "n = {n}, round {round}, j = {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn log_sum_exp_by_blocks_is_the_one_loops_bit_for_bit() {
        let mut next = crate::rng::Rng::new(7);
        // Lengths around the block; values spread over ±120 so that some exponentials
        // underflow, with -inf and NaN rows too.
        for n in [1, 2, 63, 64, 65, 127, 128, 129, 512, 1000] {
            for round in 0..20 {
                let mut row: Vec<f32> = (0..n)
                    .map(|_| (next.uniform() * 240.0 - 120.0) as f32 / (1 + round % 5) as f32)
                    .collect();
                match round {
                    3 => row[n / 2] = f32::NEG_INFINITY,
                    4 => row[n - 1] = f32::NAN,
                    5 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    6 => row[0] = f32::INFINITY,
                    _ => {}
                }
                let (a, b) = (lse(&row), one_loop(&row));
                assert_eq!(a.to_bits(), b.to_bits(), "n = {n}, round {round}");
                let wide: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
                let (a, b) = (lse(&wide), one_loop(&wide));
                assert_eq!(a.to_bits(), b.to_bits(), "f64, n = {n}, round {round}");
            }
        }
    }
}
