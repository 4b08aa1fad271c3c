//! Layer 8 of `amprobe::LAYERS`: may use layers 0–7 (`dtype` … `probe`).
//!
//! Which backend a run uses: the CPU emulator or an NVIDIA GPU through CUDA.
//!
//! [`resolve`] turns the user's `--backend` choice into the backend a run uses, from what
//! [`detect`](crate::device::detect) finds; [`parity`] checks the device kernels against
//! the CPU emulator.

pub mod parity;

use crate::device::cuda::{CudaDevice, Program};
use crate::device::detect::{self, detect, Detection};
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

/// Resolves a choice against what [`detect`] finds. `Auto` never fails; `Cuda` fails with a
/// message naming what is missing. `Auto` picks a real GPU here, never the simulated one;
/// the runner then holds that GPU to the CPU emulator before the run uses it
/// (`train::confirm`) and keeps the CPU when it fails.
pub fn resolve(choice: BackendChoice) -> Result<Resolved> {
    resolve_with(choice, &detect())
}

/// [`resolve`] against a given detection (tests use made-up detections).
pub fn resolve_with(choice: BackendChoice, found: &Detection) -> Result<Resolved> {
    match (choice, found) {
        (BackendChoice::Cpu, _) => Ok(Resolved {
            kind: BackendKind::Cpu,
            reason: "asked for the CPU emulator".into(),
            device: None,
            warning: None,
        }),
        (BackendChoice::Auto, Detection::Unavailable { reason }) => Ok(Resolved {
            kind: BackendKind::Cpu,
            reason: format!("no usable GPU ({reason})"),
            device: None,
            warning: None,
        }),
        (BackendChoice::Cuda, Detection::Unavailable { reason }) => Err(Error::Device(format!(
            "--backend cuda needs a usable NVIDIA GPU: {reason}; use --backend cpu or auto \
             (`amprobe doctor` shows what was found)"
        ))),
        (BackendChoice::Auto, Detection::Available(r)) if first_is_simulated(r) => Ok(Resolved {
            kind: BackendKind::Cpu,
            reason: format!(
                "found {}, a simulated device, which runs only when asked for \
                 (--backend cuda)",
                first_device(r)
            ),
            device: None,
            warning: None,
        }),
        (_, Detection::Available(r)) => Ok(Resolved {
            kind: BackendKind::Cuda,
            reason: format!("found {}", first_device(r)),
            device: Some(first_device(r).to_string()),
            warning: None,
        }),
    }
}

/// True when the device a run would use is the simulated one.
fn first_is_simulated(r: &detect::CudaInfo) -> bool {
    r.devices.first().is_some_and(|d| d.simulated)
}

/// The name of the first device found (the one a run uses).
fn first_device(r: &detect::CudaInfo) -> &str {
    r.devices.first().map_or("a GPU", |d| d.name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::detect::{CudaInfo, GpuDevice};

    fn found(simulated: bool) -> Detection {
        Detection::Available(CudaInfo {
            driver_version: 13000,
            devices: vec![GpuDevice {
                ordinal: 0,
                name: if simulated {
                    "amprobe-sim (simulated)".into()
                } else {
                    "NVIDIA H100 80GB HBM3".into()
                },
                total_mem: 80 << 30,
                compute_capability: (9, 0),
                simulated,
            }],
            nvrtc: Ok((13, 0)),
            cublas: Ok((13, 0, 0)),
            bindings: "13.0",
        })
    }

    #[test]
    fn auto_picks_a_real_gpu_for_the_runner_to_check() {
        let r = resolve_with(BackendChoice::Auto, &found(false)).unwrap();
        assert_eq!(r.kind, BackendKind::Cuda);
        assert_eq!(r.device.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    }

    #[test]
    fn auto_never_picks_the_simulated_device() {
        let r = resolve_with(BackendChoice::Auto, &found(true)).unwrap();
        assert_eq!(r.kind, BackendKind::Cpu);
        assert!(r.reason.contains("simulated"), "{}", r.reason);
    }

    #[test]
    fn cpu_is_always_honoured() {
        for sim in [false, true] {
            let r = resolve_with(BackendChoice::Cpu, &found(sim)).unwrap();
            assert_eq!(r.kind, BackendKind::Cpu);
        }
    }
}
