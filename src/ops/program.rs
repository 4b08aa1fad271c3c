//! The ops' part of the device program: every op family's `.cu` source and the probe
//! arena's kernels (the step's optimizer-phase kernels join them in
//! [`backend::device_program`](crate::backend::device_program), a layer up).

use crate::device::cuda::{arena, Program};

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
