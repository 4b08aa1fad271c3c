//! What a training run is configured with: precision, accumulation, clipping, optimizer,
//! scaler, policy, sampling and backend. Layer 9 (train); uses amp, optim, backend.

use crate::amp::mode::Precision;
use crate::amp::policy::DeviceType;
use crate::amp::scaler::ScalerConfig;
use crate::backend::BackendKind;
use crate::optim::clip::NormType;
use crate::optim::OptimizerConfig;
use serde::{Deserialize, Serialize};

/// When full op records are kept for a step. A step that keeps none by schedule only checks
/// its ops' outputs for non-finite values, and completes their statistics if it turns out to
/// keep them for one ([`Trainer::set_full_statistics`]): the records are the same either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpSampling {
    /// Keep every op of every `every`-th step (0: never by schedule).
    pub every: u64,
    /// Keep every op of the first step.
    pub first: bool,
    /// Keep every op of any step in which a value was non-finite.
    pub nonfinite: bool,
}

impl Default for OpSampling {
    fn default() -> Self {
        OpSampling {
            every: 0,
            first: true,
            nonfinite: true,
        }
    }
}

/// Everything the step engine needs besides the model, its parameters and data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Precision mode.
    pub precision: Precision,
    /// Micro-batches per optimizer step (gradient accumulation; the loss is divided by it).
    pub accumulate: u32,
    /// Clip the total gradient norm to this value after unscaling.
    #[serde(serialize_with = "crate::trace::float_json::f32_exact::option::serialize")]
    pub clip: Option<f32>,
    /// Norm used for clipping.
    pub clip_norm: NormType,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Loss scaler.
    pub scaler: ScalerConfig,
    /// Autocast policy table (target device type).
    pub policy: DeviceType,
    /// Seed (dropout, synthetic data).
    pub seed: u64,
    /// Module path patterns kept in fp32.
    pub keep_fp32: Vec<String>,
    /// Probes on or off.
    pub probes: bool,
    /// Which steps keep full op records.
    pub sampling: OpSampling,
    /// The backend the step runs on (resolved from the user's choice by the runner).
    pub backend: BackendKind,
    /// Blame every op of each step whose op records are kept
    /// ([`crate::engine::Engine::set_blame`]).
    #[serde(default)]
    pub blame: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            precision: Precision::Fp32,
            accumulate: 1,
            clip: None,
            clip_norm: NormType::L2,
            optimizer: OptimizerConfig::default(),
            scaler: ScalerConfig::default(),
            policy: DeviceType::Cuda,
            seed: 0,
            keep_fp32: Vec::new(),
            probes: true,
            sampling: OpSampling::default(),
            backend: BackendKind::Cpu,
            blame: false,
        }
    }
}
