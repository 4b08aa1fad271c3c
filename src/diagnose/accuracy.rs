//! The accuracy cost of a recipe against an fp32 re-run of the same step.
//!
//! Definitions (computed in f64, over every micro-batch `m` of the step):
//! - loss: `max_m |L_m − R_m| / |R_m|`, with `L` the recipe's unscaled loss and `R` the fp32
//!   loss (`|L_m − R_m|` when `R_m` is 0);
//! - final hidden state: `max_m ‖H_m − G_m‖∞ / ‖G_m‖∞`, the largest elementwise difference
//!   relative to the largest magnitude of the fp32 hidden state `G` (`‖H_m − G_m‖∞` when
//!   `G_m` is all zeros). Relative to the tensor's scale, not elementwise, so values near
//!   zero do not blow it up.
//!
//! Either is `inf` when the recipe's value is not finite.

use crate::error::{Error, Result};
use crate::train::StepOutput;
use serde::{Deserialize, Serialize};

/// Relative errors of a recipe against fp32.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// Largest relative error of the loss over the micro-batches.
    pub loss_rel_err: f64,
    /// Largest ∞-norm relative error of the final hidden state over the micro-batches.
    pub hidden_rel_err: f64,
}

fn rel(diff: f64, reference: f64) -> f64 {
    if reference == 0.0 {
        diff
    } else {
        diff / reference
    }
}

/// The relative error of `got` against `reference`, micro-batch by micro-batch.
pub fn compare(got: &[StepOutput], reference: &[StepOutput]) -> Result<Accuracy> {
    if got.len() != reference.len() || got.is_empty() {
        return Err(Error::Invalid(format!(
            "accuracy: {} micro-batch outputs against {} in the fp32 reference (expected the same, at least one)",
            got.len(),
            reference.len()
        )));
    }
    let mut loss = 0f64;
    let mut hidden = 0f64;
    for (g, r) in got.iter().zip(reference) {
        let e = if g.loss.is_finite() {
            rel((g.loss - r.loss).abs(), r.loss.abs())
        } else {
            f64::INFINITY
        };
        loss = loss.max(e);
        if g.hidden.shape() != r.hidden.shape() {
            return Err(Error::shape(
                "accuracy",
                format!(
                    "final hidden state has shape {:?}, the fp32 reference {:?}",
                    g.hidden.shape(),
                    r.hidden.shape()
                ),
            ));
        }
        let (a, b) = (g.hidden.to_f64_vec()?, r.hidden.to_f64_vec()?);
        let mut diff = 0f64;
        let mut norm = 0f64;
        for (x, y) in a.iter().zip(&b) {
            diff = diff.max(if x.is_finite() {
                (x - y).abs()
            } else {
                f64::INFINITY
            });
            norm = norm.max(y.abs());
        }
        hidden = hidden.max(rel(diff, norm));
    }
    Ok(Accuracy {
        loss_rel_err: loss,
        hidden_rel_err: hidden,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::tensor::Tensor;

    fn out(loss: f64, h: &[f32]) -> StepOutput {
        StepOutput {
            loss,
            hidden: Tensor::from_f32(h.to_vec(), &[h.len()], DType::F32).unwrap(),
        }
    }

    #[test]
    fn relative_errors_by_hand() {
        let r = [out(2.0, &[4.0, -0.001, 0.0]), out(0.0, &[0.0, 0.0, 0.0])];
        let g = [
            out(2.002, &[4.0, -0.002, 0.5]),
            out(0.25, &[0.0, 0.125, 0.0]),
        ];
        let a = compare(&g, &r).unwrap();
        // Loss: max(0.002 / 2, |0.25 − 0| (reference 0)) = 0.25.
        assert!((a.loss_rel_err - 0.25).abs() < 1e-15);
        // Hidden: max(0.5 / 4, 0.125 (reference all zero)) = 0.125.
        assert_eq!(a.hidden_rel_err, 0.125);
        let a = compare(&g[..1], &r[..1]).unwrap();
        assert!((a.loss_rel_err - 0.001).abs() < 1e-12);
        assert_eq!(a.hidden_rel_err, 0.5 / 4.0);
        let bad = [out(f64::NAN, &[f32::INFINITY, 0.0, 0.0])];
        let a = compare(&bad, &r[..1]).unwrap();
        assert_eq!(
            (a.loss_rel_err, a.hidden_rel_err),
            (f64::INFINITY, f64::INFINITY)
        );
        assert!(compare(&g, &r[..1]).is_err());
        assert!(compare(&[out(1.0, &[1.0])], &r[..1]).is_err());
    }
}
