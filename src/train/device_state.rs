//! What a trainer keeps on its CUDA device between steps: the device, the scaler's state
//! there and the optimizer's kernels. Layer 9 (train); uses device and optim.

use crate::amp::scaler::GradScaler;
use crate::device::cuda::CudaDevice;
use crate::error::Result;
use crate::optim::cuda::{DeviceOptimizer, DeviceScaler};
use crate::optim::OptimizerConfig;
use std::sync::Arc;

/// What a trainer keeps on its device between steps.
pub(super) struct DeviceState {
    pub dev: Arc<CudaDevice>,
    pub scaler: DeviceScaler,
    pub opt: DeviceOptimizer,
    /// Whether op kernels gather their outputs' statistics when probes are on.
    pub fused_stats: bool,
}

impl DeviceState {
    /// Opens the device side of a trainer: the scaler's state uploaded once.
    pub fn new(
        dev: Arc<CudaDevice>,
        scaler: &GradScaler,
        opt: &OptimizerConfig,
    ) -> Result<DeviceState> {
        let scaler = DeviceScaler::new(
            &dev,
            scaler.scale(),
            scaler.growth_tracker(),
            scaler.hysteresis_tracker().unwrap_or(0),
        )?;
        Ok(DeviceState {
            dev,
            scaler,
            opt: DeviceOptimizer::new(opt),
            fused_stats: true,
        })
    }
}
