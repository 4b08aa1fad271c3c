//! One training step: the same sequence of phases on every backend, each backend's part
//! below it ([`StepSide`]: [`HostStep`], [`DeviceStep`]). Layer 9 (train); uses the trainer
//! and both sides.

use super::device::DeviceStep;
use super::grad_blame::GradBlame;
use super::host::HostStep;
use super::phases::StepSide;
use super::trainer::Trainer;
use crate::error::Result;
use crate::trace::record::StepRecord;

impl Trainer {
    /// Runs one optimizer step (all its micro-batches) and returns its record: per
    /// micro-batch forward, loss, scale and backward; then unscale, clip, the optimizer step
    /// and the scale update, each a phase of its own.
    pub fn step(&mut self, step: u64) -> Result<StepRecord> {
        if self.device.is_some() {
            return self.run_step(step, DeviceStep::default());
        }
        // The host step runs on one of rayon's threads, so that each op's parallel loop
        // starts on the thread that reaches it instead of handing the work to the pool and
        // sleeping until a pool thread has picked it up (hundreds of hand-offs a step).
        rayon::scope(|_| self.run_step(step, HostStep::default()))
    }

    fn run_step(&mut self, step: u64, mut side: impl StepSide) -> Result<StepRecord> {
        let mut st = self.begin(step);
        side.open(self)?;
        for micro in 0..self.cfg.accumulate {
            let out = self.forward(&mut st, micro)?;
            let loss = side.loss(self, &mut st, out)?;
            let root = side.scale(self, &mut st, loss)?;
            self.backward(&mut st, &root)?;
            // (the shadows go once the micro-batch's backward is done)
            self.engine.set_blame(false);
        }
        self.grad_blame = match self.blame_step {
            true => GradBlame::new(&st.grads, &st.grad_shadows)?,
            false => None,
        };
        self.blame_step = false;
        self.before = st.inputs.take();
        side.gradients(self, &st)?;
        if let Some(max_norm) = self.cfg.clip {
            side.unscale(self)?;
            side.clip(self, &mut st, max_norm)?;
        }
        side.optimize(self, &mut st)?;
        self.grad_blame = None;
        side.finish(self, st)
    }
}
