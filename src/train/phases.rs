//! The phases of a step that differ by backend, as one trait: [`super::step`] runs them in
//! the same order on both. Layer 9 (train); uses the trainer's state.

use super::trainer::{StepState, Trainer};
use crate::error::Result;
use crate::models::Output as ForwardOutput;
use crate::tensor::Tensor;
use crate::trace::record::StepRecord;

/// One backend's part in a step. The host's reads what it needs as it goes (the losses,
/// the scaler's inf check); a device's queues kernels on its stream and reads once, when
/// the step finishes. A value of it lives for one step and holds what its phases hand on.
pub(super) trait StepSide {
    /// Before the first micro-batch, after [`Trainer::begin`].
    fn open(&mut self, t: &mut Trainer) -> Result<()>;
    /// A micro-batch's loss: its value kept for the record, divided by the micro-batch
    /// count when accumulating.
    fn loss(&mut self, t: &mut Trainer, st: &mut StepState, out: ForwardOutput) -> Result<Tensor>;
    /// The loss times the loss scale, when scaling is on (the root of the backward).
    fn scale(&mut self, t: &mut Trainer, st: &mut StepState, loss: Tensor) -> Result<Tensor>;
    /// After the last backward: the step's gradients, taken over for the optimizer phase.
    fn gradients(&mut self, t: &mut Trainer, st: &StepState) -> Result<()>;
    /// Unscale before clipping: the gradients divided by the scale, Inf/NaN noted.
    fn unscale(&mut self, t: &mut Trainer) -> Result<()>;
    /// Clip: the gradients' total norm brought to at most `max_norm`.
    fn clip(&mut self, t: &mut Trainer, st: &mut StepState, max_norm: f32) -> Result<()>;
    /// The scaler's inf check (unscaling first if clipping did not), the optimizer step it
    /// allows, and the scale update.
    fn optimize(&mut self, t: &mut Trainer, st: &mut StepState) -> Result<()>;
    /// The step's record.
    fn finish(self, t: &mut Trainer, st: StepState) -> Result<StepRecord>;
}
