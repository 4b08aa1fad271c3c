//! What the device-step tests share: a small model whose ops every backend runs, its
//! parameters and batch, runs on either backend and the comparison of their records.
#![allow(dead_code)]

use amprobe::amp::mode::Precision;
use amprobe::backend::BackendKind;
use amprobe::device::{detect, gpu_required, Detection};
use amprobe::dtype::DType;
use amprobe::engine::Engine;
use amprobe::models::{Batch, Model, Output, Param, ParamAccess, ParamStore};
use amprobe::optim::{OptimizerConfig, SgdConfig};
use amprobe::rng::Rng;
use amprobe::tensor::Tensor;
use amprobe::trace::record::StepRecord;
use amprobe::train::{FixedBatch, TrainConfig, Trainer};

pub fn device_or_skip() -> bool {
    match detect() {
        Detection::Unavailable { reason } => {
            assert!(
                !gpu_required(),
                "AMPROBE_REQUIRE_GPU=1 but no usable GPU: {reason}"
            );
            eprintln!("skipped: no usable GPU ({reason})");
            false
        }
        Detection::Available(_) => true,
    }
}

/// True when the GPU is real hardware, not the project's simulated device.
pub fn on_hardware() -> bool {
    match detect() {
        Detection::Available(info) => info.devices.iter().any(|d| !d.simulated),
        Detection::Unavailable { .. } => false,
    }
}

/// Linear → ReLU → Linear with a loss of ops that every backend runs: the logits summed by
/// two products with ones (so the loss is a sum, its gradient all ones).
#[derive(Clone)]
pub struct SumMlp;

pub fn ones(like: &Tensor, shape: &[usize], dtype: DType) -> amprobe::Result<Tensor> {
    let t = Tensor::from_f32(vec![1.0; shape.iter().product()], shape, dtype)?;
    match like.device() {
        Some(d) => t.to_device(d),
        None => Ok(t),
    }
}

impl Model for SumMlp {
    fn describe(&self) -> String {
        "sum-mlp".into()
    }
    fn clone_model(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }
    fn forward(&self, e: &mut Engine, p: &ParamAccess<'_>, b: &Batch) -> amprobe::Result<Output> {
        let mut x = b.inputs.clone();
        if let Some(d) = p.precision().input_dtype() {
            x = e.to_dtype(&x, d)?;
        }
        let h = e.scope("fc1", |e| {
            let (w, b) = (p.get(e, "fc1.weight")?, p.get(e, "fc1.bias")?);
            e.linear(&x, &w, Some(&b))
        })?;
        let h = e.scope("relu", |e| e.relu(&h))?;
        let logits = e.scope("fc2", |e| {
            let (w, b) = (p.get(e, "fc2.weight")?, p.get(e, "fc2.bias")?);
            e.linear(&h, &w, Some(&b))
        })?;
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        let d = logits.dtype();
        let loss = e.scope("loss", |e| {
            let rows = e.matmul(&ones(&logits, &[1, n], d)?, &logits)?;
            let s = e.matmul(&rows, &ones(&logits, &[c, 1], d)?)?;
            let s = e.to_dtype(&s, DType::F32)?;
            e.mul_scalar(&s, 1.0 / 64.0)
        })?;
        Ok(Output {
            loss,
            logits: logits.clone(),
            hidden: logits,
        })
    }
}

pub fn params(seed: u64, scale: f32) -> ParamStore {
    let mut rng = Rng::new(seed);
    let mut mk = |name: &str, shape: &[usize]| {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| ((rng.uniform() * 2.0 - 1.0) * scale as f64) as f32)
            .collect();
        Param::new(name, Tensor::from_f32(v, shape, DType::F32).unwrap(), false)
    };
    ParamStore {
        params: vec![
            mk("fc1.weight", &[24, 12]),
            mk("fc1.bias", &[24]),
            mk("fc2.weight", &[6, 24]),
            mk("fc2.bias", &[6]),
        ],
    }
}

pub fn batch(seed: u64, spread: f32) -> Batch {
    let mut rng = Rng::new(seed);
    let v = (0..8 * 12)
        .map(|_| ((rng.uniform() * 2.0 - 1.0) * spread as f64) as f32)
        .collect();
    Batch::new(
        Tensor::from_f32(v, &[8, 12], DType::F32).unwrap(),
        Tensor::from_i64(vec![0; 8], &[8]).unwrap(),
    )
}

pub fn run(cfg: &TrainConfig, backend: BackendKind, steps: u64, spread: f32) -> Vec<StepRecord> {
    let mut cfg = cfg.clone();
    cfg.backend = backend;
    let mut t = Trainer::new(
        cfg,
        Box::new(SumMlp),
        params(3, 0.5),
        Box::new(FixedBatch(batch(5, spread))),
    )
    .unwrap_or_else(|e| panic!("trainer on {backend}: {e}"));
    (0..steps)
        .map(|s| {
            t.step(s)
                .unwrap_or_else(|e| panic!("step {s} on {backend}: {e}"))
        })
        .collect()
}

/// Relative difference, 0 for two equal (or two NaN) values.
pub fn rel(a: f64, b: f64) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

/// Device records against CPU records: the skip decisions and the scale sequence
/// identical; losses, gradient norms and parameter maxima within `tol` (cuBLAS and the
/// emulator's GEMM sum in different orders; everything else rounds identically).
pub fn same_steps(cpu: &[StepRecord], dev: &[StepRecord], tol: f64, what: &str) {
    for (c, d) in cpu.iter().zip(dev) {
        let s = c.step;
        assert_eq!(
            (c.found_inf, c.skipped),
            (d.found_inf, d.skipped),
            "{what} step {s}: skip decision"
        );
        assert_eq!(
            (c.scale_before, c.scale_after, c.growth_tracker),
            (d.scale_before, d.scale_after, d.growth_tracker),
            "{what} step {s}: loss scale"
        );
        let (cl, dl) = (c.loss.unwrap(), d.loss.unwrap());
        assert!(rel(cl, dl) <= tol, "{what} step {s}: loss {cl} vs {dl}");
        let (cn, dn) = (c.grad_norm.unwrap_or(0.0), d.grad_norm.unwrap_or(0.0));
        assert!(
            rel(cn, dn) <= tol,
            "{what} step {s}: grad norm {cn} vs {dn}"
        );
        assert_eq!(c.params.len(), d.params.len(), "{what} step {s}: params");
        for (pc, pd) in c.params.iter().zip(&d.params) {
            assert_eq!(pc.name, pd.name);
            assert_eq!(pc.nonfinite, pd.nonfinite, "{what} {}", pc.name);
            assert!(
                rel(pc.max_abs_grad, pd.max_abs_grad) <= tol,
                "{what} step {s} {}: max |g| {} vs {}",
                pc.name,
                pc.max_abs_grad,
                pd.max_abs_grad
            );
            assert!(
                rel(pc.param_max_abs_after, pd.param_max_abs_after) <= tol,
                "{what} step {s} {}: max |p| {} vs {}",
                pc.name,
                pc.param_max_abs_after,
                pd.param_max_abs_after
            );
        }
        assert_eq!(c.op_count, d.op_count, "{what} step {s}: op count");
        assert_eq!(
            c.origins
                .first_inf
                .as_ref()
                .map(|o| (o.op_index, &o.op, &o.module)),
            d.origins
                .first_inf
                .as_ref()
                .map(|o| (o.op_index, &o.op, &o.module)),
            "{what} step {s}: first Inf"
        );
        assert_eq!(
            c.origins
                .first_nan
                .as_ref()
                .map(|o| (o.op_index, &o.op, &o.module)),
            d.origins
                .first_nan
                .as_ref()
                .map(|o| (o.op_index, &o.op, &o.module)),
            "{what} step {s}: first NaN"
        );
    }
}

pub fn base(precision: Precision) -> TrainConfig {
    TrainConfig {
        precision,
        optimizer: OptimizerConfig::Sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        }),
        ..Default::default()
    }
}
