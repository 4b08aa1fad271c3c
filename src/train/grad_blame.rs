//! Blame for the optimizer phase of a blamed step (unscale, clipping, the optimizer's
//! update): each parameter's gradient as the run holds it and its all-f64 shadow from the
//! blamed backward, both carried through each op by the op's formula in f64. Layer 9
//! (train).

use crate::engine::blame::{blame, relative_error};
use crate::engine::observer::Blame;
use crate::error::Result;
use crate::models::Param;
use crate::optim::clip::NormType;
use crate::tensor::Tensor;

/// A gradient op of the optimizer phase, as blame computes it in f64.
#[derive(Debug, Clone, Copy)]
pub(super) enum GradOp {
    /// `scaler.unscale_`: every gradient divided by the loss scale.
    Unscale {
        /// The scale the gradients are divided by (1 with the scaler off).
        scale: f64,
    },
    /// `clip_grad_norm_`: every gradient times `min(max_norm / (total + 1e-6), 1)`.
    Clip {
        /// The largest total norm kept.
        max_norm: f64,
        /// How the total norm is taken.
        norm: NormType,
    },
}

impl GradOp {
    /// The op's name in the trace.
    pub(super) fn name(self) -> &'static str {
        match self {
            GradOp::Unscale { .. } => "unscale",
            GradOp::Clip { .. } => "clip_grad_norm",
        }
    }

    /// The op on every gradient at once, in f64.
    fn apply(self, grads: &[Option<Vec<f64>>]) -> Vec<Option<Vec<f64>>> {
        let factor = match self {
            GradOp::Unscale { scale } => 1.0 / scale,
            GradOp::Clip { max_norm, norm } => {
                let values = grads.iter().flatten().flatten();
                let total = match norm {
                    NormType::L2 => values.map(|x| x * x).sum::<f64>().sqrt(),
                    // (a NaN is the largest, as torch's max propagates it)
                    NormType::Inf => values.fold(0.0f64, |m, x| {
                        if x.is_nan() || m.is_nan() {
                            f64::NAN
                        } else {
                            m.max(x.abs())
                        }
                    }),
                };
                (max_norm / (total + 1e-6)).min(1.0)
            }
        };
        grads
            .iter()
            .map(|g| g.as_ref().map(|v| v.iter().map(|x| x * factor).collect()))
            .collect()
    }
}

/// Each parameter's gradient between the optimizer phase's ops of a blamed step: as the
/// last op left it (widened: the next op's own input) and its all-f64 shadow.
pub(super) struct GradBlame {
    shapes: Vec<Vec<usize>>,
    own: Vec<Option<Vec<f64>>>,
    shadow: Vec<Option<Vec<f64>>>,
}

/// A tensor's values widened to f64 (read back from a device).
fn values(t: &Option<Tensor>) -> Result<Option<Vec<f64>>> {
    t.as_ref().map(Tensor::to_f64_vec).transpose()
}

impl GradBlame {
    /// From the step's gradients after its backward and their shadows; `None` when a
    /// gradient has no shadow (an op the backward did not blame made it), as a norm over
    /// all of them could then not be shadowed.
    pub(super) fn new(
        grads: &[Option<Tensor>],
        shadows: &[Option<Tensor>],
    ) -> Result<Option<Self>> {
        if grads
            .iter()
            .zip(shadows)
            .any(|(g, s)| g.is_some() && s.is_none())
        {
            return Ok(None);
        }
        let mut own = Vec::with_capacity(grads.len());
        let mut shadow = Vec::with_capacity(grads.len());
        let mut shapes = Vec::with_capacity(grads.len());
        for (g, s) in grads.iter().zip(shadows) {
            own.push(values(g)?);
            shadow.push(if g.is_some() { values(s)? } else { None });
            shapes.push(g.as_ref().map_or_else(Vec::new, |t| t.shape().to_vec()));
        }
        Ok(Some(GradBlame {
            shapes,
            own,
            shadow,
        }))
    }

    /// The blame of each parameter's gradient after `op`, whose results the run holds in
    /// `after`; the gradients and shadows move on past the op.
    pub(super) fn advance(
        &mut self,
        op: GradOp,
        after: &[Option<Tensor>],
    ) -> Result<Vec<Option<Blame>>> {
        let exact = op.apply(&self.own);
        let shadow = op.apply(&self.shadow);
        let mut blames = Vec::with_capacity(after.len());
        for (i, out) in after.iter().enumerate() {
            let b = match (out, &self.own[i], &exact[i], &self.shadow[i], &shadow[i]) {
                (Some(out), Some(own), Some(exact), Some(before), Some(shadow)) => {
                    let shape = &self.shapes[i];
                    let t = |v: &Vec<f64>| Tensor::from_f64(v.clone(), shape);
                    let input = relative_error(&t(own)?, &t(before)?)?;
                    Some(blame(out, &t(exact)?, &t(shadow)?, input)?)
                }
                _ => None,
            };
            blames.push(b);
        }
        self.own = after.iter().map(values).collect::<Result<_>>()?;
        self.shadow = shadow;
        Ok(blames)
    }
}

/// What blaming the optimizer step takes before it: per parameter, the value the step
/// gives in f64 from the run's gradient and from the gradient's shadow, and the
/// gradient's error against the shadow.
pub(super) struct StepBlame(Vec<Option<ExactUpdate>>);

/// One parameter's exact new value from the run's gradient and from its shadow, and the
/// gradient's error.
type ExactUpdate = (Vec<f64>, Vec<f64>, f64);

/// The optimizer's update in f64: parameter name, value and gradient to the new value
/// (`None` where the state does not fit).
pub(super) type ExactStep<'a> = &'a dyn Fn(&str, &[f64], &[f64]) -> Result<Option<Vec<f64>>>;

impl GradBlame {
    /// Before the optimizer steps `params`: their exact new values, by `exact` (name,
    /// value, gradient), the optimizer's update in f64.
    pub(super) fn before_step(&self, exact: ExactStep<'_>, params: &[Param]) -> Result<StepBlame> {
        let mut out = Vec::with_capacity(params.len());
        for (i, Param { name, value, .. }) in params.iter().enumerate() {
            let (Some(own), Some(shadow)) = (&self.own[i], &self.shadow[i]) else {
                out.push(None);
                continue;
            };
            let p = value.to_f64_vec()?;
            let shape = value.shape();
            let input = relative_error(
                &Tensor::from_f64(own.clone(), shape)?,
                &Tensor::from_f64(shadow.clone(), shape)?,
            )?;
            out.push(
                exact(name, &p, own)?
                    .zip(exact(name, &p, shadow)?)
                    .map(|(e, s)| (e, s, input)),
            );
        }
        Ok(StepBlame(out))
    }
}

impl StepBlame {
    /// The blame of parameter `i`'s update from `old` to `new`: the change the run made
    /// against the exact change from its own gradient and from the gradient's shadow (a
    /// change, not a value, so that an update lost to the parameter's rounding shows).
    pub(super) fn of(&self, i: usize, old: &Tensor, new: &Tensor) -> Result<Option<Blame>> {
        let Some(Some((exact, shadow, input))) = self.0.get(i) else {
            return Ok(None);
        };
        let p = old.to_f64_vec()?;
        let change = |v: &[f64]| -> Result<Tensor> {
            Tensor::from_f64(v.iter().zip(&p).map(|(x, p)| x - p).collect(), old.shape())
        };
        let made = change(&new.to_f64_vec()?)?;
        Ok(Some(blame(
            &made,
            &change(exact)?,
            &change(shadow)?,
            *input,
        )?))
    }
}
