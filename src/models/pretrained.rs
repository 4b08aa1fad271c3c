//! How a model read from Hugging Face files gets its parameters: from a checkpoint, or
//! seeded.

use super::weights::{init_params, read_checkpoint, take_params, Checkpoint};
use super::{Model, ParamStore};
use crate::error::Result;
use crate::rng::Rng;
use std::path::Path;

/// A model read from Hugging Face files (`config.json` and a checkpoint).
pub trait Pretrained: Model + Sized + 'static {
    /// The key of the seeded parameters' random stream.
    const INIT_KEY: u64;
    /// The standard deviation of the seeded parameters' normal draws.
    const INIT_STD: f64;
    /// Parameter names (transformers'), shapes, and whether each is a norm weight.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>, bool)>;
    /// The number of parameters, or `None` when it does not fit a `u64`.
    fn param_total(&self) -> Option<u64>;
    /// The checkpoint's tensors under the names of [`Pretrained::param_shapes`] (saved
    /// names differ between transformers' versions and heads); as they are by default.
    fn canonical_names(&self, all: Checkpoint) -> Checkpoint {
        all
    }
    /// The vocabulary size, and the sequence length of synthetic batches.
    fn tokens(&self) -> (usize, usize);

    /// Its parameters from a checkpoint (a directory or one safetensors file): f32, f16
    /// or bf16, kept as fp32 masters.
    fn load_weights(&self, weights: &Path) -> Result<ParamStore> {
        let mut all = self.canonical_names(read_checkpoint(weights)?);
        take_params(&mut all, &self.param_shapes(), weights)
    }
    /// Seeded parameters, for runs without a checkpoint (normal draws, biases 0, norm
    /// weights 1).
    fn seeded(&self, seed: u64) -> Result<ParamStore> {
        let rng = Rng::derive(seed, &[Self::INIT_KEY]);
        init_params(
            &self.param_shapes(),
            self.param_total(),
            rng,
            Self::INIT_STD,
        )
    }
}
