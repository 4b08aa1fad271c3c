//! Re-running a trainer's last step under another precision recipe ([`Variant`]): the
//! remedies that `fix` ranks, the bisection of modules kept in fp32, and the re-run that
//! completes a check-only step's statistics.

use super::config::OpSampling;
use super::data::Replayed;
use super::trainer::{StepOutput, Trainer};
use crate::amp::mode::Precision;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::trace::record::StepRecord;

/// A different precision recipe for re-running a step from the same weights and data.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// Precision mode (None: the trainer's).
    pub precision: Option<Precision>,
    /// Module patterns kept in fp32 (None: the trainer's).
    pub keep_fp32: Option<Vec<String>>,
    /// Loss scale for the step (None: the scale the step used).
    pub scale: Option<f32>,
    /// transformers' fp16 clamp (None: the model's setting).
    pub clamp: Option<bool>,
    /// The model's fp16 switches to turn on ([`crate::models::Model::fp16_switches`]).
    pub switches: Vec<String>,
    /// Probes on or off (None: the trainer's).
    pub probes: Option<bool>,
}

/// A step re-run under a [`Variant`].
pub struct Replay {
    /// Its record (op records always kept).
    pub record: StepRecord,
    /// Loss and hidden state per micro-batch.
    pub outputs: Vec<StepOutput>,
}

impl Trainer {
    /// Re-runs the last step from the weights, loss scale and batches it started from,
    /// under another precision recipe; this trainer's state is untouched.
    pub fn replay(&self, v: &Variant) -> Result<Replay> {
        let b = self
            .before
            .as_ref()
            .ok_or_else(|| Error::Invalid("no step to re-run yet".into()))?;
        let mut cfg = self.cfg.clone();
        if let Some(p) = v.precision {
            cfg.precision = p;
        }
        if let Some(k) = &v.keep_fp32 {
            cfg.keep_fp32 = k.clone();
        }
        if let Some(p) = v.probes {
            cfg.probes = p;
        }
        cfg.scaler.init_scale = v.scale.unwrap_or(b.scale);
        cfg.sampling = OpSampling {
            every: 1,
            first: true,
            nonfinite: true,
        };
        let mut model = self.model.clone_model();
        if let Some(c) = v.clamp {
            if !model.set_clamp(c) && c {
                return Err(Error::Invalid(format!(
                    "{} has no fp16 clamp",
                    model.describe()
                )));
            }
        }
        for s in &v.switches {
            if !model.set_switch(s, true) {
                return Err(Error::Invalid(format!(
                    "{} has no fp16 switch `{s}`",
                    model.describe()
                )));
            }
        }
        let mut params = b.params.clone();
        params.convert(DType::F32, |_| false)?;
        let mut t = Trainer::new(cfg, model, params, Box::new(Replayed(b.batches.clone())))?;
        // Injections stand for faults in the step itself (data, kernels): they recur in
        // every recipe of the same step.
        for inj in &self.injections {
            t.inject(inj.clone());
        }
        let record = t.step(b.step)?;
        Ok(Replay {
            record,
            outputs: t.outputs,
        })
    }
}
