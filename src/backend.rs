//! Layer 8 of `amprobe::LAYERS`: may use layers 0–7 (`dtype` … `probe`).
//!
//! The two backends by name, the CPU emulator and an NVIDIA GPU through CUDA (what a user
//! asks for, [`BackendChoice`]; what a run uses, [`BackendKind`] and [`Resolved`]), and the
//! device program a GPU step loads ([`device_program`], [`open_device`]). Which backend a
//! run uses is decided in [`crate::backend_choice`].

use crate::device::cuda::{CudaDevice, Program};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The whole device program of a training step: every op family's kernels, the probe
/// arena's, and the optimizer phase's (unscale, clipping, the updates, the scale update).
pub fn device_program() -> Program {
    let mut p = crate::ops::kernel_sources::program();
    p.sources
        .push(("optim/optim.cu", crate::optim::cuda::SOURCE));
    p.kernels.extend_from_slice(crate::optim::cuda::KERNELS);
    p
}

/// Opens CUDA device `ordinal` with the whole step's kernels loaded (true fp32 GEMM
/// unless `tf32`).
pub fn open_device(ordinal: usize, tf32: bool) -> Result<Arc<CudaDevice>> {
    CudaDevice::open(ordinal, tf32, &device_program())
}

/// The backend a user asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// A real GPU that passes the step check against the CPU emulator, else the CPU; never
    /// the simulated device.
    #[default]
    Auto,
    /// The CPU emulator (bit-exact fp16/bf16).
    Cpu,
    /// An NVIDIA GPU through CUDA; fails when none is usable.
    Cuda,
}

impl BackendChoice {
    /// Parses `auto`, `cpu` or `cuda`.
    pub fn parse(s: &str) -> Result<BackendChoice> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" | "gpu" => Ok(BackendChoice::Cuda),
            other => Err(Error::Invalid(format!(
                "backend `{other}`: expected auto, cpu or cuda"
            ))),
        }
    }
}

impl std::fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        })
    }
}

/// The backend a run uses, with why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The backend that runs the step.
    pub kind: BackendKind,
    /// One line on why (shown by `doctor` and in `--verbose` runs).
    pub reason: String,
    /// The device's name when the step runs on a GPU.
    pub device: Option<String>,
    /// What a user must hear even without `--verbose`: a GPU was found but not used.
    pub warning: Option<String>,
}

/// A concrete backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU emulator.
    Cpu,
    /// CUDA device `ordinal`.
    Cuda,
}

impl BackendKind {
    /// The name written in traces and summaries (`cpu`, `cuda`).
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
