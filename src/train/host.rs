//! The host's part in a step ([`StepSide`]): tensors in host memory, each value read as
//! soon as a phase needs it (the loss for the record, the scaler's inf check before the
//! optimizer step). Layer 9 (train); uses the trainer's state and `grads`.

use super::grads::{ParamRef, StepGrads};
use super::phases::StepSide;
use super::trainer::{divisor, StepOutput, StepState, Trainer};
use crate::amp::scaler::{StepDecision, UpdateOutcome};
use crate::dtype::DType;
use crate::engine::FiniteChecks;
use crate::error::{Error, Result};
use crate::models::Output as ForwardOutput;
use crate::tensor::Tensor;
use crate::trace::record::StepRecord;

/// What the host's phases of one step hand on.
#[derive(Default)]
pub(super) struct HostStep {
    /// Set for the whole step: a step that only checks its outputs for non-finite values
    /// has the ops check them as they write them, where they can, instead of the probe
    /// reading them again.
    checks: Option<FiniteChecks>,
    grads: Option<StepGrads>,
    decision: Option<StepDecision>,
    update: Option<UpdateOutcome>,
}

impl HostStep {
    fn grads(&mut self) -> Result<&mut StepGrads> {
        self.grads
            .as_mut()
            .ok_or_else(|| Error::Invalid("the step's gradients are not taken yet".into()))
    }
}

impl StepSide for HostStep {
    fn open(&mut self, t: &mut Trainer) -> Result<()> {
        self.checks = Some(FiniteChecks::set(t.last_checked_only));
        Ok(())
    }

    fn loss(&mut self, t: &mut Trainer, st: &mut StepState, out: ForwardOutput) -> Result<Tensor> {
        let mut loss = out.loss;
        let value = loss.item()?;
        st.loss_sum += value;
        t.outputs.push(StepOutput {
            loss: value,
            hidden: out.hidden,
        });
        let accumulate = t.cfg.accumulate;
        if accumulate > 1 {
            let d = divisor(accumulate, loss.dtype())?;
            loss = t.engine.scope("loss", |e| e.div(&loss, &d))?;
        }
        Ok(loss)
    }

    fn scale(&mut self, t: &mut Trainer, st: &mut StepState, loss: Tensor) -> Result<Tensor> {
        if !t.scaler.is_enabled() {
            return Ok(loss);
        }
        let s = Tensor::from_exact(vec![t.scaler.scale()], &[1], DType::F32)?;
        let scaled = t.engine.scope("scaler", |e| e.mul(&loss, &s))?;
        st.scaled_loss = Some(scaled.item()?);
        Ok(scaled)
    }

    fn gradients(&mut self, _t: &mut Trainer, st: &StepState) -> Result<()> {
        self.grads = Some(StepGrads::new(&st.grads)?);
        Ok(())
    }

    fn unscale(&mut self, t: &mut Trainer) -> Result<()> {
        let names = t.param_names();
        let grads = self.grads()?;
        grads.unscale(
            &mut t.scaler,
            &names.iter().map(String::as_str).collect::<Vec<_>>(),
        )?;
        t.emit_grads(t.unscale_op(), |i, shape| grads.tensor(i, shape))
    }

    fn clip(&mut self, t: &mut Trainer, st: &mut StepState, max_norm: f32) -> Result<()> {
        let names = t.param_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let grads = self.grads()?;
        let c = grads.clip(&names, max_norm, t.cfg.clip_norm)?;
        if c.nonfinite {
            st.events.push(format!(
                "clip_grad_norm: total norm is {} (non-finite); gradients were multiplied by {}",
                c.total_norm, c.clip_coef
            ));
        }
        st.clip = Some(c);
        t.emit_grads(t.clip_op(max_norm), |i, shape| grads.tensor(i, shape))
    }

    fn optimize(&mut self, t: &mut Trainer, st: &mut StepState) -> Result<()> {
        let names = t.param_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let grads = self.grads()?;
        // The scaler's decision: skip on an Inf/NaN gradient, else unscale (if not yet done).
        let decision = grads.check(&mut t.scaler, &names)?;
        if decision.unscaled_here {
            t.emit_grads(t.unscale_op(), |i, shape| grads.tensor(i, shape))?;
        }
        if !decision.skip {
            optimizer_step(t, grads)?;
        }
        self.decision = Some(decision);
        self.update = Some(t.update(st)?);
        Ok(())
    }

    /// The per-parameter records from the unscaled gradients, then the trainer's record.
    fn finish(mut self, t: &mut Trainer, st: StepState) -> Result<StepRecord> {
        let (Some(decision), Some(upd)) = (self.decision.take(), self.update.take()) else {
            return Err(Error::Invalid(
                "the step finished before its optimizer phase".into(),
            ));
        };
        let grads = self.grads()?;
        let records = grads.records(&t.params.params, st.scale_before)?;
        for (i, p) in t.params.params.iter().enumerate() {
            if records[i].is_some() {
                t.last_grads[i] = grads.take_tensor(i, p.value.shape())?;
            }
        }
        t.record_step(st, records, decision, upd)
    }
}

/// The optimizer updates the parameters from the unscaled gradients.
fn optimizer_step(t: &mut Trainer, grads: &StepGrads) -> Result<()> {
    let blamed = match &t.grad_blame {
        Some(gb) => {
            let opt = t.optimizer.as_ref();
            let exact = |n: &str, p: &[f64], g: &[f64]| Ok(opt.exact_step(n, p, g));
            Some(gb.before_step(&exact, &t.params.params)?)
        }
        None => None,
    };
    let new = {
        let refs: Vec<ParamRef<'_>> = t
            .params
            .params
            .iter()
            .map(|p| ParamRef {
                name: &p.name,
                value: &p.value,
            })
            .collect();
        grads.step(t.optimizer.as_mut(), &refs)?
    };
    for (i, (p, nv)) in t.params.params.iter_mut().zip(new).enumerate() {
        let old = std::mem::replace(&mut p.value, nv);
        let (m, nv) = (p.module.clone(), p.value.clone());
        let blame = match &blamed {
            Some(b) => b.of(i, &old, &nv)?,
            None => None,
        };
        t.engine
            .emit_optimizer_op("optimizer_step", &m, &[&old], &nv, blame);
    }
    Ok(())
}
