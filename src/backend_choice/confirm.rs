//! The check a real GPU passes before `--backend auto` gives it the training step: every
//! device kernel against the CPU emulator, then a few whole AMP steps of a small model on
//! both backends, held to each other.

use super::parity;
use crate::amp::mode::Precision;
use crate::amp::scaler::ScalerConfig;
use crate::backend::BackendKind;
use crate::device::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::models::mlp::{synthetic_batch, Mlp};
use crate::optim::clip::NormType;
use crate::optim::{AdamWConfig, OptimizerConfig};
use crate::trace::record::StepRecord;
use crate::train::{FixedBatch, TrainConfig, Trainer};
use std::sync::Arc;

/// Elements per tensor in the kernel checks: a few blocks, an odd tail.
const KERNEL_ELEMENTS: usize = 1031;
/// Steps of the whole-step check.
const STEPS: u64 = 6;
/// Relative bound on losses, gradient norms and parameter maxima: cuBLAS and the emulator's
/// GEMM sum in different orders; nothing else may differ.
const TOLERANCE: f64 = 1e-3;

/// What the check ran, for the reason a run prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirmation {
    /// Kernel checks run.
    pub kernel_checks: usize,
    /// Whole steps compared.
    pub steps: u64,
    /// Steps the scaler skipped in the compared run (the overflow path was exercised).
    pub skipped: u64,
}

/// Runs the kernel self-test and the whole-step comparison on `dev`; an error says which
/// check failed and by how much.
pub fn confirm_device_step(dev: &Arc<CudaDevice>) -> Result<Confirmation> {
    let checks = parity::run_all(dev, 11, KERNEL_ELEMENTS)?;
    if let Some(c) = checks.iter().find(|c| !c.ok()) {
        return Err(Error::Device(format!(
            "kernel check `{}` ({}) failed on {} of {} elements: {}",
            c.name,
            c.dtype,
            c.failures,
            c.n,
            c.first.as_deref().unwrap_or("")
        )));
    }
    let cpu = run(BackendKind::Cpu)?;
    let gpu = run(BackendKind::Cuda)?;
    compare(&cpu, &gpu)?;
    Ok(Confirmation {
        kernel_checks: checks.len(),
        steps: STEPS,
        skipped: cpu.iter().filter(|r| r.skipped).count() as u64,
    })
}

/// The seed MLP under fp16 autocast with AdamW, clipping and a scale so large that the
/// first steps overflow: found_inf, skipped steps, the back-off and the updates all run.
fn run(backend: BackendKind) -> Result<Vec<StepRecord>> {
    let model = Mlp {
        inputs: 24,
        hidden: 40,
        classes: 7,
    };
    let params = model.init(5)?;
    let batch = synthetic_batch(24, 7, 16, 5, 0)?;
    let cfg = TrainConfig {
        precision: Precision::Fp16,
        clip: Some(1.0),
        clip_norm: NormType::L2,
        optimizer: OptimizerConfig::AdamW(AdamWConfig::default()),
        scaler: ScalerConfig {
            init_scale: 2f32.powi(20),
            ..ScalerConfig::default()
        },
        backend,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg, Box::new(model), params, Box::new(FixedBatch(batch)))?;
    (0..STEPS).map(|s| t.step(s)).collect()
}

/// The two runs' records against each other.
fn compare(cpu: &[StepRecord], gpu: &[StepRecord]) -> Result<()> {
    let fail = |s: u64, what: String| Err(Error::Device(format!("step {s}: {what}")));
    for (c, d) in cpu.iter().zip(gpu) {
        let s = c.step;
        if (c.found_inf, c.skipped) != (d.found_inf, d.skipped) {
            return fail(
                s,
                format!(
                    "found_inf/skipped {:?} on the CPU, {:?} on the device",
                    (c.found_inf, c.skipped),
                    (d.found_inf, d.skipped)
                ),
            );
        }
        if (c.scale_before, c.scale_after) != (d.scale_before, d.scale_after) {
            return fail(
                s,
                format!(
                    "loss scale {} -> {} on the CPU, {} -> {} on the device",
                    c.scale_before, c.scale_after, d.scale_before, d.scale_after
                ),
            );
        }
        let pairs = [
            ("loss", c.loss, d.loss),
            ("gradient norm", c.grad_norm, d.grad_norm),
        ];
        for (what, a, b) in pairs {
            let (a, b) = (a.unwrap_or(0.0), b.unwrap_or(0.0));
            if rel(a, b) > TOLERANCE {
                return fail(s, format!("{what} {a} on the CPU, {b} on the device"));
            }
        }
        for (pc, pd) in c.params.iter().zip(&d.params) {
            let (a, b) = (pc.param_max_abs_after, pd.param_max_abs_after);
            if rel(a, b) > TOLERANCE {
                return fail(
                    s,
                    format!("{}: max |p| {a} on the CPU, {b} on the device", pc.name),
                );
            }
        }
    }
    Ok(())
}

/// Relative difference, 0 for two equal (or two NaN) values.
fn rel(a: f64, b: f64) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compared_run_overflows_first_and_then_trains() {
        let r = run(BackendKind::Cpu).unwrap();
        assert!(r[0].skipped, "the check must exercise a skipped step");
        assert!(r.iter().any(|s| !s.skipped), "and some updates");
    }

    #[test]
    fn a_different_scale_or_loss_is_named() {
        let cpu = run(BackendKind::Cpu).unwrap();
        let mut other = cpu.clone();
        other[2].scale_after *= 2.0;
        let e = compare(&cpu, &other).unwrap_err().to_string();
        assert!(e.contains("step 2") && e.contains("loss scale"), "{e}");
        let mut other = cpu.clone();
        other[3].loss = other[3].loss.map(|l| l * 1.01);
        let e = compare(&cpu, &other).unwrap_err().to_string();
        assert!(e.contains("step 3") && e.contains("loss"), "{e}");
        assert!(compare(&cpu, &cpu).is_ok());
    }
}
