//! Losses: cross-entropy (mean, ignore_index) and mean squared error.

use super::{expect_float, grad, with_float, with_float2, FData, Finish};
use crate::amp::policy::Category;
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::{Real, Tensor};

/// Class count, labels and number of non-ignored labels, after checking shapes and range.
fn class_targets<'a>(
    op: &str,
    x: &Tensor,
    t: &'a Tensor,
    ignore: Option<i64>,
) -> Result<(usize, &'a [i64], usize)> {
    let ti = t.i64s().map_err(|_| {
        Error::tensor(
            "labels",
            format!("expected int64 labels, got {}", t.dtype()),
        )
    })?;
    if x.rank() == 0 {
        return Err(Error::shape(op, "input must have a class dimension"));
    }
    let c = x.shape()[x.rank() - 1];
    if x.shape()[..x.rank() - 1] != *t.shape() {
        return Err(Error::shape(
            op,
            format!(
                "labels shape {:?} does not match input {:?} without the class dim",
                t.shape(),
                x.shape()
            ),
        ));
    }
    Ok((c, ti, check_targets(ti, c, ignore)?))
}

fn check_targets(t: &[i64], c: usize, ignore: Option<i64>) -> Result<usize> {
    let mut valid = 0;
    for (i, &y) in t.iter().enumerate() {
        if Some(y) == ignore {
            continue;
        }
        if y < 0 || y as usize >= c {
            return Err(Error::tensor(
                "labels",
                format!(
                    "label {y} at position {i} is out of range for {c} classes (expected 0..{c})"
                ),
            ));
        }
        valid += 1;
    }
    Ok(valid)
}

/// Row-wise log-sum-exp, computed in T with the sum accumulated in f64.
fn lse<T: Real>(row: &[T]) -> T {
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

fn ce_fwd<T: Finish>(
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
fn ce_bwd<T: Finish>(
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

fn mse_fwd<T: Finish>(a: &[T], b: &[T], dtype: crate::DType) -> Result<Computed> {
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

fn mse_bwd<T: Finish>(
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

fn nll_fwd<T: Finish>(
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
fn nll_bwd<T: Finish>(
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

impl Engine {
    /// Mean negative log-likelihood of log-probabilities `lp` [..., C] at integer `targets`
    /// (`torch.nn.functional.nll_loss`).
    pub fn nll_loss(
        &mut self,
        lp: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        expect_float(lp, "nll_loss", "log-probabilities")?;
        let ins = self.prepare("nll_loss", &[lp, targets])?;
        let (x, t) = (&ins[0], &ins[1]);
        let (c, ti, valid) = class_targets("nll_loss", x, t, ignore_index)?;
        let dtype = x.dtype();
        let out = with_float!(x, "nll_loss", |d| nll_fwd(
            d,
            ti,
            c,
            ignore_index,
            valid,
            dtype
        ))?;
        let (xt, tt) = (x.clone(), t.clone());
        let bw = Box::new(move |g: &Tensor| {
            let ti = tt.i64s()?;
            let r = match super::fdata(g, "nll_loss")? {
                FData::F32(g) => nll_bwd(
                    xt.numel(),
                    ti,
                    g[0],
                    c,
                    ignore_index,
                    valid,
                    xt.shape(),
                    dtype,
                )?,
                FData::F64(g) => nll_bwd(
                    xt.numel(),
                    ti,
                    g[0],
                    c,
                    ignore_index,
                    valid,
                    xt.shape(),
                    dtype,
                )?,
            };
            Ok(vec![grad(r), None])
        });
        self.record("nll_loss", &[x, t], &["input", "target"], out, Some(bw))
    }

    /// Mean cross-entropy of `logits` [..., C] against integer `targets` [...], skipping
    /// positions equal to `ignore_index` (`torch.nn.functional.cross_entropy`).
    pub fn cross_entropy(
        &mut self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        expect_float(logits, "cross_entropy_loss", "logits")?;
        if self.autocast_category("cross_entropy_loss") == Some(Category::Passthrough) {
            // CUDA autocast has no cross_entropy kernel: PyTorch's decomposition runs,
            // log_softmax with the logits' dtype passed explicitly (autocast keeps it),
            // then nll_loss from the fp32 list.
            let lp = self.autocast_off(|e| e.log_softmax(logits, -1))?;
            return self.nll_loss(&lp, targets, ignore_index);
        }
        let ins = self.prepare("cross_entropy_loss", &[logits, targets])?;
        let (x, t) = (&ins[0], &ins[1]);
        let (c, ti, valid) = class_targets("cross_entropy_loss", x, t, ignore_index)?;
        let dtype = x.dtype();
        let out = with_float!(x, "cross_entropy_loss", |d| ce_fwd(
            d,
            ti,
            c,
            ignore_index,
            valid,
            dtype
        ))?;
        let (xt, tt) = (x.clone(), t.clone());
        let bw = Box::new(move |g: &Tensor| {
            let ti = tt.i64s()?;
            let r = match (
                super::fdata(&xt, "cross_entropy_loss")?,
                super::fdata(g, "cross_entropy_loss")?,
            ) {
                (FData::F32(x), FData::F32(g)) => {
                    ce_bwd(x, ti, g[0], c, ignore_index, valid, xt.shape(), dtype)?
                }
                (FData::F64(x), FData::F64(g)) => {
                    ce_bwd(x, ti, g[0], c, ignore_index, valid, xt.shape(), dtype)?
                }
                _ => {
                    return Err(Error::shape(
                        "cross_entropy_loss",
                        "gradient dtype differs from logits",
                    ))
                }
            };
            Ok(vec![grad(r), None])
        });
        self.record(
            "cross_entropy_loss",
            &[x, t],
            &["input", "target"],
            out,
            Some(bw),
        )
    }

    /// Mean squared error of `a` against `b` (same shape).
    pub fn mse_loss(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        expect_float(a, "mse_loss", "input")?;
        expect_float(b, "mse_loss", "target")?;
        let ins = self.prepare("mse_loss", &[a, b])?;
        let (a, b) = (&ins[0], &ins[1]);
        if a.shape() != b.shape() {
            return Err(Error::shape(
                "mse_loss",
                format!(
                    "input {:?} and target {:?} differ in shape",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let dtype = a.dtype();
        let out = with_float2!(a, b, "mse_loss", |x, y| mse_fwd(x, y, dtype))?;
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| {
            let (ga, gb) = match (
                super::fdata(&at, "mse_loss")?,
                super::fdata(&bt, "mse_loss")?,
                super::fdata(g, "mse_loss")?,
            ) {
                (FData::F32(x), FData::F32(y), FData::F32(g)) => {
                    mse_bwd(x, y, g[0], at.shape(), dtype)?
                }
                (FData::F64(x), FData::F64(y), FData::F64(g)) => {
                    mse_bwd(x, y, g[0], at.shape(), dtype)?
                }
                _ => {
                    return Err(Error::shape(
                        "mse_loss",
                        "gradient dtype differs from inputs",
                    ))
                }
            };
            Ok(vec![grad(ga), grad(gb)])
        });
        self.record("mse_loss", &[a, b], &["input", "target"], out, Some(bw))
    }
}
