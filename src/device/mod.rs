//! Layer 2 of `amprobe::LAYERS`: may use layers 0–1 (`dtype` … `trace`).
//!
//! Where tensor data lives: host memory, or the memory of a CUDA device.
//!
//! This is the runtime under the tensors: [`detect`] finds a usable GPU without ever
//! panicking or printing, and [`cuda`] holds the device context, its stream, the loaded
//! kernel module, cuBLAS, device buffers and the probe statistics arena. What the kernels
//! compute belongs to the op families above (`ops/*/cuda.rs` beside each `.cu`).

pub mod cuda;
pub mod detect;

pub use detect::{detect, Detection, GpuDevice};

/// True when the environment asks GPU tests to fail rather than skip
/// (`AMPROBE_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("AMPROBE_REQUIRE_GPU").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}
