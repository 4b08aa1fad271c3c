//! What a finished step leaves behind: its record (parameters, kept op records, origins,
//! the scaler's decision), its gradients as optimizer-phase ops, and the full statistics
//! of a check-only step that went non-finite.

use super::grad_blame::GradOp;
use super::replay::Variant;
use super::trainer::{StepState, Trainer};
use crate::amp::scaler::{StepDecision, UpdateOutcome};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::trace::record::{ParamRecord, StepRecord};

impl Trainer {
    /// The step's record from its parameter records (None: no gradient), the op records
    /// the sampling keeps and the origins.
    pub(super) fn record_step(
        &mut self,
        st: StepState,
        records: Vec<Option<ParamRecord>>,
        decision: StepDecision,
        upd: UpdateOutcome,
    ) -> Result<StepRecord> {
        let mut params_rec = Vec::new();
        let mut sum_sq = 0f64;
        let mut any_grad = false;
        for rec in records.into_iter().flatten() {
            any_grad = true;
            sum_sq += if rec.nonfinite > 0 {
                f64::INFINITY
            } else {
                rec.grad_l2 * rec.grad_l2
            };
            params_rec.push(rec);
        }
        let grad_norm = match st.clip {
            Some(c) => Some(c.total_norm as f64),
            None if any_grad => Some(sum_sq.sqrt()),
            None => None,
        };
        let step = st.step;
        let scheduled = self.scheduled(step);
        let kept_nonfinite =
            self.cfg.sampling.nonfinite && self.recorder().is_some_and(|r| r.saw_nonfinite());
        self.last_kept_nonfinite = kept_nonfinite;
        if kept_nonfinite && self.recorder().is_some_and(|r| r.is_check_only()) {
            self.complete_statistics()?;
        }
        let (origins, ops, op_count) = match self.recorder() {
            Some(r) => {
                let keep = scheduled || kept_nonfinite;
                let origins = r.origins();
                let count = r.ops().len() as u64;
                (origins, if keep { Some(r.take_ops()) } else { None }, count)
            }
            None => (Default::default(), None, 0),
        };
        let accumulate = self.cfg.accumulate;
        Ok(StepRecord {
            step,
            micro_batches: accumulate,
            loss: Some(st.loss_sum / accumulate as f64),
            scaled_loss: st.scaled_loss,
            scale_before: upd.scale_before as f64,
            scale_after: upd.scale_after as f64,
            found_inf: upd.found_inf || decision.found_inf,
            skipped: decision.skip,
            growth_tracker: upd.growth_tracker as i64,
            grad_norm,
            clip_coef: st.clip.map(|c| c.clip_coef as f64),
            lr: self.optimizer.lr_f64(),
            weight_casts: st.weight_casts,
            origins,
            params: params_rec,
            ops,
            op_count,
            events: st.events,
            wall_ms: st.t0.elapsed().as_secs_f64() * 1e3,
            skip_cause: None,
        })
    }

    /// Each parameter's gradient (`grad_of(i, shape)`, None without one) as an
    /// optimizer-phase op `op` of its module, when probing.
    /// The unscale of this step's gradients, as blame computes it.
    pub(super) fn unscale_op(&self) -> GradOp {
        GradOp::Unscale {
            scale: match self.scaler.is_enabled() {
                true => f64::from(self.scaler.scale()),
                false => 1.0,
            },
        }
    }

    /// Clipping to `max_norm`, as blame computes it.
    pub(super) fn clip_op(&self, max_norm: f32) -> GradOp {
        GradOp::Clip {
            max_norm: f64::from(max_norm),
            norm: self.cfg.clip_norm,
        }
    }

    /// Tells observers of gradient op `op` of the optimizer phase, one event per
    /// parameter with a gradient (`grad_of` gives it after the op), blamed in a blamed step.
    pub(super) fn emit_grads(
        &mut self,
        op: GradOp,
        grad_of: impl Fn(usize, &[usize]) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        if !self.engine.probing() {
            return Ok(());
        }
        let after: Vec<Option<Tensor>> = self
            .params
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| grad_of(i, p.value.shape()))
            .collect::<Result<_>>()?;
        let blames = match self.grad_blame.as_mut() {
            Some(gb) => gb.advance(op, &after)?,
            None => vec![None; after.len()],
        };
        for ((p, g), b) in self.params.params.iter().zip(&after).zip(blames) {
            if let Some(g) = g {
                let m = p.module.clone();
                self.engine.emit_optimizer_op(op.name(), &m, &[], g, b);
            }
        }
        Ok(())
    }

    pub(super) fn param_names(&self) -> Vec<String> {
        self.params.params.iter().map(|p| p.name.clone()).collect()
    }

    /// The full statistics of a step recorded in the check-only mode, from a re-run of
    /// it (the same weights, scale, batches and injections) with full statistics.
    fn complete_statistics(&mut self) -> Result<()> {
        let full = self.replay(&Variant::default())?.record.ops;
        match self.recorder() {
            Some(r) => r.complete_from(full.as_deref().unwrap_or_default()),
            None => Ok(()),
        }
    }
}
