//! Where a step's batches come from. Layer 9 (train); uses models and the error type.

use crate::error::{Error, Result};
use crate::models::Batch;

/// Supplies the batch of each step and micro-batch.
pub trait DataSource: Send {
    /// The batch for `step`, micro-batch `micro`.
    fn batch(&mut self, step: u64, micro: u32) -> Result<Batch>;
}

/// The same batch every step.
pub struct FixedBatch(pub Batch);

impl DataSource for FixedBatch {
    fn batch(&mut self, _step: u64, _micro: u32) -> Result<Batch> {
        Ok(self.0.clone())
    }
}

/// A seeded generator of batches.
pub struct Synthetic<F: FnMut(u64, u32) -> Result<Batch> + Send>(pub F);

impl<F: FnMut(u64, u32) -> Result<Batch> + Send> DataSource for Synthetic<F> {
    fn batch(&mut self, step: u64, micro: u32) -> Result<Batch> {
        (self.0)(step, micro)
    }
}

/// The batches a step used, fed again to its re-run.
pub(super) struct Replayed(pub(super) Vec<Batch>);

impl DataSource for Replayed {
    fn batch(&mut self, _step: u64, micro: u32) -> Result<Batch> {
        self.0
            .get(micro as usize)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("no recorded batch for micro-batch {micro}")))
    }
}
