//! Layer 10 of `amprobe::LAYERS`: may use layers 0–9 (`dtype` … `train`).
//!
//! Which backend a run uses, decided here and only here: the user's `--backend` choice
//! against what [`detect`](crate::device::detect) finds ([`resolve`]), and for a GPU that
//! `auto` finds, the proof it runs the step as the CPU emulator does before a run uses it
//! ([`resolve_backend`]: every device kernel against the emulator, [`parity`], then a few
//! whole steps on both backends, [`confirm`]).

pub mod confirm;
pub mod parity;

use crate::backend::{BackendChoice, BackendKind, Resolved};
use crate::device::detect::{self, detect, Detection};
use crate::error::{Error, Result};
use confirm::{confirm_device_step, Confirmation};
use std::sync::OnceLock;

/// Resolves a choice against what [`detect`] finds. `Auto` never fails; `Cuda` fails with a
/// message naming what is missing. `Auto` picks a real GPU here, never the simulated one;
/// [`resolve_backend`] then holds that GPU to the CPU emulator before a run uses it and
/// keeps the CPU when it fails.
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

/// The backend a run uses. A real GPU that `auto` finds runs the step only after it passed
/// the step check against the CPU emulator ([`confirm_device_step`]), once per process;
/// when the check fails the run keeps the CPU and the reason says why.
pub fn resolve_backend(choice: BackendChoice) -> Result<Resolved> {
    let found = resolve(choice)?;
    if choice != BackendChoice::Auto || found.kind != BackendKind::Cuda {
        return Ok(found);
    }
    static CHECKED: OnceLock<Resolved> = OnceLock::new();
    Ok(CHECKED
        .get_or_init(|| {
            checked(found, || {
                crate::backend::open_device(0, false).and_then(|d| confirm_device_step(&d))
            })
        })
        .clone())
}

/// `found` (a GPU `auto` chose) after `check`: the GPU with the check in its reason, or the
/// CPU with a warning that says why the GPU was not used.
fn checked(found: Resolved, check: impl FnOnce() -> Result<Confirmation>) -> Resolved {
    let name = found.device.clone().unwrap_or_else(|| "a GPU".into());
    match check() {
        Ok(c) => Resolved {
            reason: format!(
                "{}; it passed the step check against the CPU emulator ({} kernel checks, {} \
                 whole steps)",
                found.reason, c.kernel_checks, c.steps
            ),
            ..found
        },
        Err(e) => {
            let why = format!(
                "found {name}, but it failed the step check against the CPU emulator ({e}); \
                 auto keeps the CPU emulator (--backend cuda runs the device anyway)"
            );
            Resolved {
                kind: BackendKind::Cpu,
                reason: why.clone(),
                device: None,
                warning: Some(why),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;
    use crate::device::detect::{CudaInfo, GpuDevice};
    use crate::error::Error;

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

    fn gpu() -> Resolved {
        Resolved {
            kind: BackendKind::Cuda,
            reason: "found NVIDIA H100".into(),
            device: Some("NVIDIA H100".into()),
            warning: None,
        }
    }

    #[test]
    fn a_gpu_that_passes_the_step_check_runs_the_step() {
        let r = checked(gpu(), || {
            Ok(Confirmation {
                kernel_checks: 300,
                steps: 6,
                skipped: 2,
            })
        });
        assert_eq!(r.kind, BackendKind::Cuda);
        assert!(r.warning.is_none());
        assert!(r.reason.contains("passed the step check"), "{}", r.reason);
    }

    #[test]
    fn a_gpu_that_fails_the_step_check_leaves_the_cpu_and_a_warning() {
        let r = checked(gpu(), || {
            Err(Error::Device(
                "step 3: loss 1.5 on the CPU, 1.7 on the device".into(),
            ))
        });
        assert_eq!(r.kind, BackendKind::Cpu);
        assert_eq!(r.device, None);
        let w = r.warning.expect("a warning");
        assert!(
            w.contains("NVIDIA H100") && w.contains("step 3: loss") && w.contains("CPU emulator"),
            "{w}"
        );
    }
}
