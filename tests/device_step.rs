//! Whole training steps on the CUDA backend against the same steps on the CPU emulator:
//! losses, skip decisions, the loss-scale sequence, gradient norms, parameter records and
//! op records. Runs on the simulated device in CI (`AMPROBE_REQUIRE_GPU=1`); skips where
//! no GPU is usable otherwise.

use amprobe::amp::mode::Precision;
use amprobe::amp::policy::DeviceType;
use amprobe::amp::scaler::{ScalerConfig, ScalerKind};
use amprobe::backend::BackendKind;
use amprobe::config::RunConfig;
use amprobe::device::{detect, gpu_required, Detection};
use amprobe::dtype::DType;
use amprobe::engine::Engine;
use amprobe::models::{Batch, Model, Output, Param, ParamAccess, ParamStore};
use amprobe::optim::clip::NormType;
use amprobe::optim::{AdamWConfig, OptimizerConfig, SgdConfig};
use amprobe::rng::Rng;
use amprobe::tensor::Tensor;
use amprobe::trace::record::{Phase, StepRecord};
use amprobe::train::{FixedBatch, TrainConfig, Trainer};

fn device_or_skip() -> bool {
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

/// Linear → ReLU → Linear with a loss of ops that every backend runs: the logits summed by
/// two products with ones (so the loss is a sum, its gradient all ones).
#[derive(Clone)]
struct SumMlp;

fn ones(like: &Tensor, shape: &[usize], dtype: DType) -> amprobe::Result<Tensor> {
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

fn params(seed: u64, scale: f32) -> ParamStore {
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

fn batch(seed: u64, spread: f32) -> Batch {
    let mut rng = Rng::new(seed);
    let v = (0..8 * 12)
        .map(|_| ((rng.uniform() * 2.0 - 1.0) * spread as f64) as f32)
        .collect();
    Batch {
        inputs: Tensor::from_f32(v, &[8, 12], DType::F32).unwrap(),
        labels: Tensor::from_i64(vec![0; 8], &[8]).unwrap(),
    }
}

fn run(cfg: &TrainConfig, backend: BackendKind, steps: u64, spread: f32) -> Vec<StepRecord> {
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
fn rel(a: f64, b: f64) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs())
    }
}

/// Device records against CPU records: the skip decisions and the scale sequence
/// identical; losses, gradient norms and parameter maxima within `tol` (cuBLAS and the
/// emulator's GEMM sum in different orders; everything else rounds identically).
fn same_steps(cpu: &[StepRecord], dev: &[StepRecord], tol: f64, what: &str) {
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

fn base(precision: Precision) -> TrainConfig {
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

#[test]
fn sgd_steps_match_the_emulator_in_every_precision_mode() {
    if !device_or_skip() {
        return;
    }
    for p in [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::O2,
        Precision::Half,
    ] {
        let cfg = base(p);
        let cpu = run(&cfg, BackendKind::Cpu, 4, 1.0);
        let dev = run(&cfg, BackendKind::Cuda, 4, 1.0);
        same_steps(&cpu, &dev, 1e-5, &format!("{p:?}"));
    }
}

#[test]
fn overflowing_fp16_steps_are_skipped_and_the_scale_backs_off_as_on_the_cpu() {
    if !device_or_skip() {
        return;
    }
    // Inputs of 2^10 and a scale of 2^24: the scaled gradients overflow fp16 until the
    // scale has backed off far enough.
    let mut cfg = base(Precision::Fp16);
    cfg.scaler = ScalerConfig {
        init_scale: 16_777_216.0,
        growth_interval: 3,
        ..Default::default()
    };
    let cpu = run(&cfg, BackendKind::Cpu, 20, 1024.0);
    let dev = run(&cfg, BackendKind::Cuda, 20, 1024.0);
    assert!(cpu.iter().any(|r| r.skipped), "the case must skip steps");
    assert!(cpu.iter().any(|r| !r.skipped), "and recover");
    same_steps(&cpu, &dev, 1e-5, "fp16 backoff");
    let skipped = dev.iter().find(|r| r.skipped).unwrap();
    if let Some(ops) = &skipped.ops {
        assert!(
            ops.iter().all(|o| o.op != "optimizer_step"),
            "a skipped step records no parameter update"
        );
    }
}

#[test]
fn adamw_clipping_and_the_scaler_variants_match_the_emulator() {
    if !device_or_skip() {
        return;
    }
    let kinds = [
        ScalerKind::Default,
        ScalerKind::MaxClip { max_scale: 4096.0 },
        ScalerKind::Hysteresis {
            hysteresis: 2,
            min_scale: 1.0,
            error_at_floor: false,
        },
        ScalerKind::Fixed,
        ScalerKind::None,
    ];
    for (i, kind) in kinds.into_iter().enumerate() {
        for norm in [NormType::L2, NormType::Inf] {
            let mut cfg = base(Precision::Bf16);
            cfg.optimizer = OptimizerConfig::AdamW(AdamWConfig {
                lr: 0.01,
                ..Default::default()
            });
            cfg.clip = Some(0.25);
            cfg.clip_norm = norm;
            cfg.scaler = ScalerConfig {
                kind,
                init_scale: 8192.0,
                growth_interval: 2,
                ..Default::default()
            };
            if i == 2 {
                cfg.precision = Precision::Fp16;
                cfg.scaler.init_scale = 16_777_216.0;
            }
            let cpu = run(&cfg, BackendKind::Cpu, 6, 64.0);
            let dev = run(&cfg, BackendKind::Cuda, 6, 64.0);
            same_steps(&cpu, &dev, 1e-5, &format!("{kind:?} {norm:?}"));
            for (c, d) in cpu.iter().zip(&dev) {
                assert_eq!(c.clip_coef.is_some(), d.clip_coef.is_some());
                if let (Some(a), Some(b)) = (c.clip_coef, d.clip_coef) {
                    assert!(rel(a, b) <= 1e-5, "{kind:?} clip coef {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn the_step_records_the_same_ops_with_the_same_statistics() {
    if !device_or_skip() {
        return;
    }
    let mut cfg = base(Precision::Fp16);
    cfg.sampling.every = 1;
    let cpu = run(&cfg, BackendKind::Cpu, 2, 1.0);
    let dev = run(&cfg, BackendKind::Cuda, 2, 1.0);
    for (c, d) in cpu.iter().zip(&dev) {
        let (co, dops) = (c.ops.as_ref().unwrap(), d.ops.as_ref().unwrap());
        assert_eq!(co.len(), dops.len());
        for (a, b) in co.iter().zip(dops) {
            assert_eq!(
                (a.index, a.phase, &a.op, &a.module, &a.output),
                (b.index, b.phase, &b.op, &b.module, &b.output)
            );
            assert_eq!(a.stats.numel, b.stats.numel, "{} {}", a.op, a.module);
            assert_eq!(
                (a.stats.nan, a.stats.pos_inf, a.stats.neg_inf),
                (b.stats.nan, b.stats.pos_inf, b.stats.neg_inf),
                "{} {} {:?}",
                a.op,
                a.module,
                a.phase
            );
            assert!(
                rel(a.stats.max_abs, b.stats.max_abs) <= 1e-2,
                "{} {} {:?}: max {} vs {}",
                a.op,
                a.module,
                a.phase,
                a.stats.max_abs,
                b.stats.max_abs
            );
        }
        assert!(dops.iter().any(|o| o.phase == Phase::Optimizer));
    }
}

/// The seed MLP sample (Linear → ReLU → Linear, cross-entropy with ignore_index) built
/// as the runner builds it, for `backend`.
fn seed_mlp(
    precision: Precision,
    policy: DeviceType,
    backend: BackendKind,
    steps: u64,
) -> Vec<StepRecord> {
    let cfg = RunConfig::load(std::path::Path::new("samples/mlp.toml")).unwrap();
    let mut train = cfg.train_config().unwrap();
    train.precision = precision;
    train.policy = policy;
    train.backend = backend;
    train.sampling.every = 1;
    let (m, p, d) = amprobe::runner::build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d)
        .unwrap_or_else(|e| panic!("seed mlp trainer on {backend}: {e}"));
    (0..steps)
        .map(|s| {
            t.step(s)
                .unwrap_or_else(|e| panic!("seed mlp step {s} on {backend}: {e}"))
        })
        .collect()
}

#[test]
fn the_seed_mlp_with_its_cross_entropy_runs_on_the_device_as_on_the_emulator() {
    if !device_or_skip() {
        return;
    }
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        // CPU autocast keeps cross_entropy fused in fp32; CUDA autocast decomposes it
        // into log_softmax and nll_loss.
        for policy in [DeviceType::Cpu, DeviceType::Cuda] {
            let cpu = seed_mlp(precision, policy, BackendKind::Cpu, 3);
            let dev = seed_mlp(precision, policy, BackendKind::Cuda, 3);
            let what = format!("seed mlp {precision:?} policy {policy:?}");
            same_steps(&cpu, &dev, 1e-5, &what);
            for (c, d) in cpu.iter().zip(&dev) {
                let (co, dops) = (c.ops.as_ref().unwrap(), d.ops.as_ref().unwrap());
                let names = |o: &[amprobe::trace::record::OpRecord]| {
                    o.iter()
                        .map(|o| (o.index, o.phase, o.op.clone(), o.module.clone()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(names(co), names(dops), "{what} step {}: op records", c.step);
                let decomposed = policy == DeviceType::Cuda && precision != Precision::Fp32;
                let loss_op = if decomposed {
                    "nll_loss"
                } else {
                    "cross_entropy_loss"
                };
                assert!(
                    dops.iter().any(|o| o.op == loss_op),
                    "{what}: the loss runs as {loss_op}"
                );
                for (a, b) in co.iter().zip(dops) {
                    assert_eq!(
                        (a.stats.numel, a.stats.nan, a.stats.pos_inf, a.stats.neg_inf),
                        (b.stats.numel, b.stats.nan, b.stats.pos_inf, b.stats.neg_inf),
                        "{what}: {} {} {:?}",
                        a.op,
                        a.module,
                        a.phase
                    );
                    assert_eq!(a.rounding, b.rounding, "{what}: {} {}", a.op, a.module);
                }
            }
        }
    }
}

/// The op records of an engine with a recorder running `masked_fill(x, mask, -inf)` then
/// a scaling of it, on the host or on `dev` (statistics resolved from the arena read).
fn masked_records(
    dev: Option<&std::sync::Arc<amprobe::device::cuda::CudaDevice>>,
) -> (Vec<amprobe::trace::record::OpRecord>, bool) {
    use amprobe::probe::recorder::Recorder;
    let put = |t: Tensor| match dev {
        Some(d) => t.to_device(d).unwrap(),
        None => t,
    };
    if let Some(d) = dev {
        d.with_arena(|a| a.reset(d)).unwrap();
    }
    let x =
        put(Tensor::from_f32((0..12).map(|i| i as f32).collect(), &[3, 4], DType::F16).unwrap());
    let mask = put(Tensor::from_i64(vec![0, 1, 0, 1], &[4]).unwrap());
    let mut e = Engine::new();
    e.add_observer(Box::new(Recorder::new()));
    e.begin_step(0);
    let y = e.masked_fill(&x, &mask, f64::NEG_INFINITY).unwrap();
    e.mul_scalar(&y, 2.0).unwrap();
    let mut obs = e.take_observers();
    let r = obs[0].as_any_mut().downcast_mut::<Recorder>().unwrap();
    if let Some(d) = dev {
        let slots = d.with_arena(|a| a.read(d)).unwrap();
        r.resolve(&slots).unwrap();
    }
    (r.take_ops(), r.origins().first_inf.is_some())
}

#[test]
fn a_device_masks_neg_inf_is_counted_on_the_device_and_is_no_origin() {
    if !device_or_skip() {
        return;
    }
    let dev = amprobe::backend::open_device(0, false).unwrap();
    let (cpu, cpu_inf) = masked_records(None);
    let (gpu, gpu_inf) = masked_records(Some(&dev));
    assert_eq!(cpu[0].masked_neg_inf, 6);
    assert_eq!(
        gpu[0].masked_neg_inf, 6,
        "resolved from the op's arena slot"
    );
    assert_eq!(gpu[0].stats.neg_inf, 6);
    assert!(!cpu_inf && !gpu_inf, "a mask's -inf is not an Inf origin");
}
