//! The ops' part of the device program: every op family's `.cu` source, the tensor
//! layer's accumulation kernel and the probe arena's kernels (the step's optimizer-phase
//! kernels join them in [`backend::device_program`](crate::backend::device_program), a
//! layer up).

use crate::device::cuda::{arena, Program};

/// The kernels of every op family, of gradient accumulation and of the probe arena, as
/// one program.
pub fn program() -> Program {
    Program {
        sources: vec![
            ("ops/cast/cast.cu", include_str!("cast/cast.cu")),
            (
                "ops/elementwise/elementwise.cu",
                include_str!("elementwise/elementwise.cu"),
            ),
            ("ops/reduce/reduce.cu", include_str!("reduce/reduce.cu")),
            ("ops/nn/nn.cu", include_str!("nn/nn.cu")),
            ("ops/loss/loss.cu", include_str!("loss/loss.cu")),
            ("ops/select/select.cu", include_str!("select/select.cu")),
            ("ops/shape/shape.cu", include_str!("shape/shape.cu")),
            ("tensor/accumulate.cu", crate::tensor::accumulate::SOURCE),
            ("probes/stats.cu", arena::SOURCE),
        ],
        kernels: [
            super::cast::cuda::KERNELS,
            super::elementwise::cuda::KERNELS,
            super::reduce::cuda::KERNELS,
            super::nn::cuda::KERNELS,
            super::loss::cuda::KERNELS,
            super::select::cuda::KERNELS,
            super::shape::cuda::KERNELS,
            crate::tensor::accumulate::KERNELS,
            arena::KERNELS,
        ]
        .concat(),
    }
}
