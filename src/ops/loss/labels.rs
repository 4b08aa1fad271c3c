//! Class labels: checked against the class count (ignored labels skipped) and counted, on
//! the host, or moved to the device whose kernels read them.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The class count of `x` [..., C] after checking that `t` is int64 labels of shape
/// [...].
pub(super) fn class_count(op: &str, x: &Tensor, t: &Tensor) -> Result<usize> {
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
pub(super) fn class_targets<'a>(
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
pub(super) fn device_targets(
    op: &str,
    x: &Tensor,
    t: &Tensor,
    ignore: Option<i64>,
) -> Result<(usize, Tensor)> {
    let c = class_count(op, x, t)?;
    if crate::ops::on_device(t) {
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

pub(super) fn check_targets(t: &[i64], c: usize, ignore: Option<i64>) -> Result<usize> {
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
