//! Losses: cross-entropy (mean, ignore_index) and mean squared error.

use super::{expect_float, grad, with_float, with_float2, FData, Finish};
use crate::amp::policy::Category;
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::{Real, Tensor};

mod cpu;
pub mod cuda;
use cpu::*;

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
