//! Losses: cross-entropy (mean, ignore_index) and mean squared error.

use super::{expect_float, grad, with_float, with_float2, FData};
use crate::amp::policy::Category;
use crate::engine::{Computed, Engine};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

mod cpu;
pub mod cuda;
use cpu::*;

/// The class count of `x` [..., C] after checking that `t` is int64 labels of shape
/// [...].
fn class_count(op: &str, x: &Tensor, t: &Tensor) -> Result<usize> {
    if t.dtype() != crate::DType::I64 {
        return Err(Error::tensor(
            "labels",
            format!("expected int64 labels, got {}", t.dtype()),
        ));
    }
    if x.rank() == 0 {
        return Err(Error::shape(op, "input must have a class dimension"));
    }
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
    Ok(x.shape()[x.rank() - 1])
}

/// Class count, labels and number of non-ignored labels, after checking shapes and range.
fn class_targets<'a>(
    op: &str,
    x: &Tensor,
    t: &'a Tensor,
    ignore: Option<i64>,
) -> Result<(usize, &'a [i64], usize)> {
    let c = class_count(op, x, t)?;
    let ti = t.i64s()?;
    Ok((c, ti, check_targets(ti, c, ignore)?))
}

/// Labels on the device of `x`: device labels as they are (a label out of range gives a
/// NaN loss there, as they cannot be checked without a read; the trainer's models check
/// theirs on the host first, [`check_labels`]), host labels checked as on the CPU and
/// uploaded.
fn device_targets(
    op: &str,
    x: &Tensor,
    t: &Tensor,
    ignore: Option<i64>,
) -> Result<(usize, Tensor)> {
    let c = class_count(op, x, t)?;
    if t.storage().is_device() {
        return Ok((c, t.clone()));
    }
    check_targets(t.i64s()?, c, ignore)?;
    Ok((c, t.to_device(&x.cuda(op)?.dev)?))
}

/// Checks class labels on the host as the losses do: each in `0..classes` unless it is
/// `ignore`. Models call it before labels go to a device, where the loss kernels cannot
/// raise this error.
pub fn check_labels(labels: &Tensor, classes: usize, ignore: Option<i64>) -> Result<()> {
    check_targets(labels.i64s()?, classes, ignore).map(|_| ())
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
        if x.storage().is_device() {
            return self.nll_loss_device(x, t, ignore_index);
        }
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
        if x.storage().is_device() {
            return self.cross_entropy_device(x, t, ignore_index);
        }
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
        if a.storage().is_device() || b.storage().is_device() {
            return self.mse_loss_device(a, b);
        }
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

/// The device paths: the same ops on device tensors, their counts pending in arena slots.
impl Engine {
    fn nll_loss_device(&mut self, x: &Tensor, t: &Tensor, ignore: Option<i64>) -> Result<Tensor> {
        const OP: &str = "nll_loss";
        let (c, td) = device_targets(OP, x, t, ignore)?;
        let (slot, counts) = super::device_counts(x)?;
        let (y, valid) = cuda::nll(x, &td, c, ignore, counts)?;
        let out = Computed::pending(y, slot);
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let bw = Box::new(move |g: &Tensor| {
            let (slot, counts) = super::device_counts(g)?;
            let dx = cuda::nll_backward(&td, g, &valid, &shape, dtype, c, ignore, counts)?;
            Ok(vec![grad(Computed::pending(dx, slot)), None])
        });
        self.record(OP, &[x, t], &["input", "target"], out, Some(bw))
    }

    fn cross_entropy_device(
        &mut self,
        x: &Tensor,
        t: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_loss";
        let (c, td) = device_targets(OP, x, t, ignore)?;
        let (slot, counts) = super::device_counts(x)?;
        let (y, valid) = cuda::cross_entropy(x, &td, c, ignore, counts)?;
        let out = Computed::pending(y, slot);
        let xt = x.clone();
        let bw = Box::new(move |g: &Tensor| {
            let (slot, counts) = super::device_counts(g)?;
            let dx = cuda::cross_entropy_backward(&xt, &td, g, &valid, c, ignore, counts)?;
            Ok(vec![grad(Computed::pending(dx, slot)), None])
        });
        self.record(OP, &[x, t], &["input", "target"], out, Some(bw))
    }

    fn mse_loss_device(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "mse_loss";
        let (slot, counts) = super::device_counts(a)?;
        let out = Computed::pending(cuda::mse(a, b, counts)?, slot);
        let (at, bt) = (a.clone(), b.clone());
        let bw = Box::new(move |g: &Tensor| {
            let taken = super::device_counts_n(g, 2)?;
            let ((sa, ca), (sb, cb)) = (taken[0], taken[1]);
            let (ga, gb) = cuda::mse_backward(&at, &bt, g, ca, cb)?;
            Ok(vec![
                grad(Computed::pending(ga, sa)),
                grad(Computed::pending(gb, sb)),
            ])
        });
        self.record(OP, &[a, b], &["input", "target"], out, Some(bw))
    }
}
