//! Device host code of the loss family (kernels in `loss.cu`): per-row terms in f32, their
//! mean summed in f64 in row order from the CPU's start value and rounded once. The count
//! of labels that are not ignored stays on the device (an int64 tensor of one element the
//! backward reads), so no op waits for the device.

use super::kernels::{ClassKept, Kernels, Valid};
use super::labels::device_targets;
use crate::dtype::DType;
use crate::engine::{Computed, Grad};
use crate::error::{Error, Result};
use crate::ops::cuda::{arg, arg_ptr, device_of, launch, output, same_dtype};
use crate::ops::reduce::cuda::sum_identity;
use crate::ops::{device_counts, device_counts_n, grad};
use crate::tensor::Tensor;

/// The kernels of `loss.cu`.
pub const KERNELS: &[&str] = &[
    "amp_loss_terms",
    "amp_loss_mean",
    "amp_ce_backward",
    "amp_nll_backward",
    "amp_mse",
    "amp_mse_backward",
];

/// The ignored label as the kernels take it: (value, whether there is one).
fn ignore_args(ignore: Option<i64>) -> (i64, i32) {
    (ignore.unwrap_or(0), ignore.is_some() as i32)
}

/// Checks that `t` holds int64 labels.
fn expect_labels(t: &Tensor) -> Result<()> {
    if t.dtype() != DType::I64 {
        return Err(Error::tensor(
            "labels",
            format!("expected int64 labels, got {}", t.dtype()),
        ));
    }
    Ok(())
}

/// The mean loss over the rows of `x` [rows, c] whose label in `t` is not ignored:
/// cross-entropy (`ce`) or NLL of log-probabilities. Returns the scalar loss and the
/// device count of labels not ignored. A label out of range gives a NaN loss (device
/// labels cannot be checked without a read).
fn loss_mean(
    op: &str,
    x: &Tensor,
    t: &Tensor,
    c: usize,
    ignore: Option<i64>,
    ce: bool,
    counts: u64,
) -> Result<(Tensor, Tensor)> {
    let dev = device_of(op, &[x, t])?;
    expect_labels(t)?;
    let rows = t.numel() as u64;
    // One element at least: no rows still gives a (NaN) mean, and no allocation is empty.
    let terms = output(&dev, &[t.numel().max(1)], DType::F32)?;
    let valid = output(&dev, &[1], DType::I64)?;
    let y = output(&dev, &[], x.dtype())?;
    let ((xp, k), tp, sp) = (arg(x, op)?, arg_ptr(t, op)?, arg_ptr(&terms, op)?);
    let (yp, vp) = (arg_ptr(&y, op)?, arg_ptr(&valid, op)?);
    let (ig, has) = ignore_args(ignore);
    let (cc, is_ce, negate) = (c as u64, ce as i32, (!ce) as i32);
    launch!(
        dev,
        "amp_loss_terms",
        rows,
        &xp,
        &k,
        &tp,
        &rows,
        &cc,
        &ig,
        &has,
        &is_ce,
        &sp
    );
    // The CPU starts cross-entropy's total at 0.0 and sums NLL's through Rust's `Sum`.
    let init = if ce { 0.0 } else { sum_identity() };
    launch!(
        dev,
        "amp_loss_mean",
        1,
        &sp,
        &tp,
        &rows,
        &ig,
        &has,
        &negate,
        &init,
        &yp,
        &k,
        &vp,
        &counts
    );
    Ok((y, valid))
}

/// Mean cross-entropy of logits `x` (rows of `c` classes) at labels `t`, and the device
/// count of labels not ignored (for [`cross_entropy_backward`]).
pub fn cross_entropy(
    x: &Tensor,
    t: &Tensor,
    c: usize,
    ignore: Option<i64>,
    counts: u64,
) -> Result<(Tensor, Tensor)> {
    loss_mean("cross_entropy_loss", x, t, c, ignore, true, counts)
}

/// Mean negative log-likelihood of log-probabilities `x` at labels `t`, and the device
/// count of labels not ignored (for [`nll_backward`]).
pub fn nll(
    x: &Tensor,
    t: &Tensor,
    c: usize,
    ignore: Option<i64>,
    counts: u64,
) -> Result<(Tensor, Tensor)> {
    loss_mean("nll_loss", x, t, c, ignore, false, counts)
}

/// The cross-entropy gradient: (softmax − onehot)·g/valid per row, zero for ignored rows.
pub fn cross_entropy_backward(
    x: &Tensor,
    t: &Tensor,
    g: &Tensor,
    valid: &Tensor,
    c: usize,
    ignore: Option<i64>,
    counts: u64,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy_loss";
    let dev = device_of(OP, &[x, t, g, valid])?;
    same_dtype(OP, &[x, g])?;
    let dx = output(&dev, x.shape(), x.dtype())?;
    let ((xp, k), tp, gp, vp, dp) = (
        arg(x, OP)?,
        arg_ptr(t, OP)?,
        arg_ptr(g, OP)?,
        arg_ptr(valid, OP)?,
        arg_ptr(&dx, OP)?,
    );
    let (rows, cc) = (t.numel() as u64, c as u64);
    let (ig, has) = ignore_args(ignore);
    launch!(
        dev,
        "amp_ce_backward",
        rows,
        &xp,
        &tp,
        &gp,
        &vp,
        &dp,
        &k,
        &rows,
        &cc,
        &ig,
        &has,
        &counts
    );
    Ok(dx)
}

/// The NLL gradient: −g/valid at each row's label, zero elsewhere, as `shape` in `dtype`.
#[allow(clippy::too_many_arguments)]
pub fn nll_backward(
    t: &Tensor,
    g: &Tensor,
    valid: &Tensor,
    shape: &[usize],
    dtype: DType,
    c: usize,
    ignore: Option<i64>,
    counts: u64,
) -> Result<Tensor> {
    const OP: &str = "nll_loss";
    let dev = device_of(OP, &[t, g, valid])?;
    if g.dtype() != dtype {
        return Err(Error::shape(
            OP,
            format!("gradient is {}, the input {dtype}", g.dtype()),
        ));
    }
    let dx = output(&dev, shape, dtype)?;
    let (tp, (gp, k), vp, dp) = (
        arg_ptr(t, OP)?,
        arg(g, OP)?,
        arg_ptr(valid, OP)?,
        arg_ptr(&dx, OP)?,
    );
    let (n, cc) = (dx.numel() as u64, c as u64);
    let (ig, has) = ignore_args(ignore);
    launch!(
        dev,
        "amp_nll_backward",
        n,
        &tp,
        &gp,
        &vp,
        &dp,
        &k,
        &n,
        &cc,
        &ig,
        &has,
        &counts
    );
    Ok(dx)
}

/// Mean squared error of `a` against `b` (same shape): Σ (a − b)² in f64 in element order
/// from Rust's `Sum` start, as the CPU sums.
pub fn mse(a: &Tensor, b: &Tensor, counts: u64) -> Result<Tensor> {
    const OP: &str = "mse_loss";
    let dev = device_of(OP, &[a, b])?;
    let dtype = same_dtype(OP, &[a, b])?;
    let y = output(&dev, &[], dtype)?;
    let ((ap, k), bp, yp) = (arg(a, OP)?, arg_ptr(b, OP)?, arg_ptr(&y, OP)?);
    let (n, init) = (a.numel() as u64, sum_identity());
    launch!(dev, "amp_mse", 1, &ap, &bp, &k, &n, &init, &yp, &counts);
    Ok(y)
}

/// The mean squared error gradients: (a − b)·(2g/n) for `a`, its negation for `b`, each
/// rounding counted into its own counters.
pub fn mse_backward(
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    counts_a: u64,
    counts_b: u64,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "mse_loss";
    let dev = device_of(OP, &[a, b, g])?;
    let dtype = same_dtype(OP, &[a, b, g])?;
    let ga = output(&dev, a.shape(), dtype)?;
    let gb = output(&dev, a.shape(), dtype)?;
    let ((ap, k), bp, gp) = (arg(a, OP)?, arg_ptr(b, OP)?, arg_ptr(g, OP)?);
    let (gap, gbp) = (arg_ptr(&ga, OP)?, arg_ptr(&gb, OP)?);
    let n = a.numel() as u64;
    launch!(
        dev,
        "amp_mse_backward",
        n,
        &ap,
        &bp,
        &gp,
        &gap,
        &gbp,
        &k,
        &n,
        &counts_a,
        &counts_b
    );
    Ok((ga, gb))
}

/// The device's loss kernels.
pub struct Device;

/// The device count of a forward that ran here.
fn device_valid<'a>(kept: &'a ClassKept, op: &str) -> Result<&'a Tensor> {
    match &kept.valid {
        Valid::Device(v) => Ok(v),
        Valid::Host(_) => Err(Error::Device(format!(
            "{op} backward: the forward counted its labels on the host"
        ))),
    }
}

impl Kernels for Device {
    fn nll(&self, x: &Tensor, t: &Tensor, ignore: Option<i64>) -> Result<(Computed, ClassKept)> {
        const OP: &str = "nll_loss";
        let (c, td) = device_targets(OP, x, t, ignore)?;
        let (slot, counts) = device_counts(x)?;
        let (y, valid) = nll(x, &td, c, ignore, counts)?;
        let kept = ClassKept {
            classes: c,
            labels: td,
            valid: Valid::Device(valid),
        };
        Ok((Computed::pending(y, slot), kept))
    }

    fn nll_backward(
        &self,
        shape: &[usize],
        dtype: DType,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed> {
        let valid = device_valid(kept, "nll_loss")?;
        let (slot, counts) = device_counts(g)?;
        let dx = nll_backward(
            &kept.labels,
            g,
            valid,
            shape,
            dtype,
            kept.classes,
            ignore,
            counts,
        )?;
        Ok(Computed::pending(dx, slot))
    }

    fn cross_entropy(
        &self,
        x: &Tensor,
        t: &Tensor,
        ignore: Option<i64>,
    ) -> Result<(Computed, ClassKept)> {
        const OP: &str = "cross_entropy_loss";
        let (c, td) = device_targets(OP, x, t, ignore)?;
        let (slot, counts) = device_counts(x)?;
        let (y, valid) = cross_entropy(x, &td, c, ignore, counts)?;
        let kept = ClassKept {
            classes: c,
            labels: td,
            valid: Valid::Device(valid),
        };
        Ok((Computed::pending(y, slot), kept))
    }

    fn cross_entropy_backward(
        &self,
        x: &Tensor,
        kept: &ClassKept,
        g: &Tensor,
        ignore: Option<i64>,
    ) -> Result<Computed> {
        let valid = device_valid(kept, "cross_entropy_loss")?;
        let (slot, counts) = device_counts(g)?;
        let dx = cross_entropy_backward(x, &kept.labels, g, valid, kept.classes, ignore, counts)?;
        Ok(Computed::pending(dx, slot))
    }

    fn mse(&self, a: &Tensor, b: &Tensor) -> Result<Computed> {
        let (slot, counts) = device_counts(a)?;
        Ok(Computed::pending(mse(a, b, counts)?, slot))
    }

    fn mse_backward(&self, a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Vec<Option<Grad>>> {
        let taken = device_counts_n(g, 2)?;
        let ((sa, ca), (sb, cb)) = (taken[0], taken[1]);
        let (ga, gb) = mse_backward(a, b, g, ca, cb)?;
        Ok(vec![
            grad(Computed::pending(ga, sa)),
            grad(Computed::pending(gb, sb)),
        ])
    }
}
