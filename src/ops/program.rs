//! The device program: every op family's `.cu` source and the probe arena's kernels,
//! compiled together into one module when a device is opened.

use crate::device::cuda::{arena, CudaDevice, Program};
use crate::error::Result;
use std::sync::Arc;

/// The kernels of every op family and of the probe arena, as one program.
pub fn program() -> Program {
    Program {
        sources: vec![
            ("ops/cast/cast.cu", include_str!("cast/cast.cu")),
            (
                "ops/elementwise/elementwise.cu",
                include_str!("elementwise/elementwise.cu"),
            ),
            ("probes/stats.cu", arena::SOURCE),
        ],
        kernels: [
            super::cast::cuda::KERNELS,
            super::elementwise::cuda::KERNELS,
            arena::KERNELS,
        ]
        .concat(),
    }
}

/// Opens CUDA device `ordinal` with every op family's kernels loaded.
pub fn open_device(ordinal: usize, tf32: bool) -> Result<Arc<CudaDevice>> {
    CudaDevice::open(ordinal, tf32, &program())
}
