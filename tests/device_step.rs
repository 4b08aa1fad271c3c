//! Whole training steps on the CUDA backend against the same steps on the CPU emulator:
//! losses, skip decisions, the loss-scale sequence, gradient norms, parameter records and
//! op records (the step's device work is counted in tests/device_counters.rs). Runs on the simulated device in CI (`AMPROBE_REQUIRE_GPU=1`); skips where
//! no GPU is usable otherwise.

#[path = "device_step/common.rs"]
mod common;
use amprobe::amp::mode::Precision;
use amprobe::amp::policy::DeviceType;
use amprobe::amp::scaler::{ScalerConfig, ScalerKind};
use amprobe::backend::BackendKind;
use amprobe::config::RunConfig;
use amprobe::dtype::DType;
use amprobe::engine::Engine;
use amprobe::optim::clip::NormType;
use amprobe::optim::{AdamWConfig, OptimizerConfig};
use amprobe::tensor::Tensor;
use amprobe::trace::record::Phase;
use amprobe::trace::record::StepRecord;
use amprobe::train::Trainer;
use common::*;

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn sgd_steps_match_the_emulator_in_every_precision_mode() {
    if !device_or_skip() {
        return;
    }
    for p in [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::O2,
        Precision::O2Bf16,
        Precision::Half,
        Precision::Bf16Pure,
    ] {
        let cfg = base(p);
        let cpu = run(&cfg, BackendKind::Cpu, 4, 1.0);
        let dev = run(&cfg, BackendKind::Cuda, 4, 1.0);
        same_steps(&cpu, &dev, 1e-5, &format!("{p:?}"));
    }
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
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
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
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
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
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
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
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
            same_ops(&cpu, &dev, &what);
            for (c, d) in cpu.iter().zip(&dev) {
                let (co, dops) = (c.ops.as_ref().unwrap(), d.ops.as_ref().unwrap());
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
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
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

/// The op records of fp16 scores plus an additive mask made as transformers makes it
/// (`where(mask, 0, −65504)`), then softmax, on the host or on `dev`, and whether the
/// recorder saw an Inf origin.
fn additive_mask_records(
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
    // Scores −40, −20, 0, 20 per row: −65504 plus a score below −16 rounds to −inf.
    let scores = put(Tensor::from_f32(
        (0..8).map(|i| ((i % 4) as f32 - 2.0) * 20.0).collect(),
        &[2, 4],
        DType::F16,
    )
    .unwrap());
    let keep = put(Tensor::from_i64(vec![0, 1, 1, 1], &[1, 4]).unwrap());
    let scalar = |v: f32| put(Tensor::from_f32(vec![v], &[1, 1], DType::F16).unwrap());
    let mut e = Engine::new();
    e.add_observer(Box::new(Recorder::new()));
    e.begin_step(0);
    let (zero, min) = (scalar(0.0), scalar(-65504.0));
    let mask = e.make_mask(|e| e.where_(&keep, &zero, &min)).unwrap();
    let s = e.add(&scores, &mask).unwrap();
    e.softmax(&s, -1).unwrap();
    let mut obs = e.take_observers();
    let r = obs[0].as_any_mut().downcast_mut::<Recorder>().unwrap();
    if let Some(d) = dev {
        let slots = d.with_arena(|a| a.read(d)).unwrap();
        r.resolve(&slots).unwrap();
    }
    (r.take_ops(), r.origins().first_inf.is_some())
}

/// fp16 padding as transformers does it: a masked score of −65504 plus −40 rounds to −inf
/// (once per row).
/// That -inf is the mask's, on the host and on the device alike: counted as masked, no Inf
/// origin, and neither the mask nor its sum is a headroom warning.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn an_additive_masks_neg_inf_is_the_masks_on_both_backends() {
    let check = |ops: &[amprobe::trace::record::OpRecord], origin: bool, on: &str| {
        let (w, a) = (&ops[0], &ops[1]);
        assert_eq!((w.op.as_str(), a.op.as_str()), ("where", "add"), "{on}");
        assert!(
            w.additive_mask && a.additive_mask && !ops[2].additive_mask,
            "{on}"
        );
        assert_eq!((a.stats.neg_inf, a.masked_neg_inf), (2, 2), "{on}");
        assert!(!origin, "{on}: a mask's -inf is not an Inf origin");
        let mut h = amprobe::diagnose::headroom::Headroom::new(Default::default());
        h.observe(0, 1.0, ops);
        assert!(h.report().warnings.is_empty(), "{on}: {:?}", h.report());
    };
    let (cpu, cpu_inf) = additive_mask_records(None);
    check(&cpu, cpu_inf, "host");
    if !device_or_skip() {
        return;
    }
    let dev = amprobe::backend::open_device(0, false).unwrap();
    let (gpu, gpu_inf) = additive_mask_records(Some(&dev));
    check(&gpu, gpu_inf, "device");
}

/// An op whose backward takes several arena slots before its kernels run keeps valid
/// counter addresses when the arena grows (and moves) in between: linear's backward with a
/// bias takes three, and the arena (256 slots) is left one short of full before it.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn an_op_taking_several_arena_slots_survives_the_arena_growing() {
    if !device_or_skip() {
        return;
    }
    let dev = amprobe::backend::open_device(0, false).unwrap();
    for _ in 0..254 {
        dev.counts_slot().unwrap();
    }
    let leaf = |n: usize, shape: &[usize]| {
        Tensor::from_f32((0..n).map(|i| i as f32 / 8.0).collect(), shape, DType::F16)
            .unwrap()
            .to_device(&dev)
            .unwrap()
            .as_leaf(true)
    };
    let (x, w, b) = (leaf(12, &[3, 4]), leaf(8, &[2, 4]), leaf(2, &[2]));
    let mut e = Engine::new();
    let y = e.linear(&x, &w, Some(&b)).unwrap();
    let grads = e.backward(&y).unwrap();
    let gb = grads[&b.id()].to_host().unwrap();
    assert_eq!(
        gb.f32s().unwrap(),
        &[3.0, 3.0],
        "db sums the ones over 3 rows"
    );
}

/// A Hugging Face checkpoint (the T5 overflow sample, a variant of
/// scripts/make_t5_variants.py, or the GPT-2 sample) built as the runner builds it, for
/// `backend`; `clamp` is T5's.
fn t5_trainer(
    dir: &str,
    precision: Precision,
    clamp: bool,
    backend: BackendKind,
    tweak: impl Fn(&mut amprobe::train::TrainConfig),
) -> Trainer {
    let dir = std::path::PathBuf::from(dir);
    let mut cfg = RunConfig::default();
    cfg.model.hf = Some(dir.clone());
    cfg.model.t5_clamp = Some(clamp);
    cfg.data.inputs = Some(dir.join("inputs.safetensors"));
    cfg.train.optimizer = Some("sgd".into());
    cfg.train.lr = Some(0.01);
    let mut train = cfg.train_config().unwrap();
    train.precision = precision;
    train.backend = backend;
    train.sampling.every = 1;
    tweak(&mut train);
    let (m, p, d) = amprobe::runner::build(&cfg, &train).unwrap();
    Trainer::new(train, m, p, d).unwrap_or_else(|e| panic!("{dir:?} on {backend}: {e}"))
}

/// `steps` steps of a trainer.
fn steps_of(t: &mut Trainer, steps: u64, what: &str) -> Vec<StepRecord> {
    (0..steps)
        .map(|s| t.step(s).unwrap_or_else(|e| panic!("{what} step {s}: {e}")))
        .collect()
}

/// [`t5_trainer`]'s first `steps` steps.
fn t5(
    dir: &str,
    precision: Precision,
    clamp: bool,
    backend: BackendKind,
    steps: u64,
    tweak: impl Fn(&mut amprobe::train::TrainConfig),
) -> Vec<StepRecord> {
    let mut t = t5_trainer(dir, precision, clamp, backend, tweak);
    steps_of(&mut t, steps, &format!("{dir} on {backend}"))
}

/// The same ops in the same order with the same Inf/NaN counts (so the same first Inf,
/// first NaN and chain), and the chain itself.
fn same_ops(cpu: &[StepRecord], dev: &[StepRecord], what: &str) {
    for (c, d) in cpu.iter().zip(dev) {
        assert_eq!(
            c.origins.chain, d.origins.chain,
            "{what} step {}: chain",
            c.step
        );
        let (co, dops) = (c.ops.as_ref().unwrap(), d.ops.as_ref().unwrap());
        assert_eq!(co.len(), dops.len(), "{what} step {}: op count", c.step);
        for (a, b) in co.iter().zip(dops) {
            assert_eq!(
                (a.index, a.phase, &a.op, &a.module),
                (b.index, b.phase, &b.op, &b.module),
                "{what} step {}",
                c.step
            );
            assert_eq!(
                (a.stats.numel, a.stats.nan, a.stats.pos_inf, a.stats.neg_inf),
                (b.stats.numel, b.stats.nan, b.stats.pos_inf, b.stats.neg_inf),
                "{what} step {}: {} #{} in {} ({:?})",
                c.step,
                a.op,
                a.index,
                a.module,
                a.phase
            );
        }
    }
}

/// T5 steps on the device against the emulator's. Skip decisions, the scale sequence and
/// the non-finite counts are identical. Losses and gradient norms are within 1e-5 relative.
/// Each parameter's max |g| and max |p| are within 1e-3 relative, or 1e-6 of the step's
/// largest |g|. The T5 cases are ill-conditioned on purpose: a planted residual channel
/// of about 1e5 beside unit-scale values. An fp32 GEMM summed in another order (cuBLAS k
/// order against the emulator's blocked order, each within γ_k·Σ|a||b| of the exact sum)
/// then moves a layer norm's weight gradient by up to 1.4e-4 relative. It also moves the
/// attention projections' gradients in saturated blocks, which cancel to 1e-12 from terms
/// near 1e-5, by 50%. In the fp16 and bf16 modes each GEMM output is rounded to 16 bits;
/// here that absorbs the order, and the steps are identical.
///
/// On real hardware cuBLAS adds in its own order, so GEMM outputs differ from the
/// emulator's in their last bits and what follows from them by as many units in the last
/// place of the mode's compute dtype as the model's conditioning makes of it; no bound on
/// that is the emulator's to give. There the decisions (skips, scale, non-finite counts) are
/// held in every step, and the largest deviation of the values is printed in units in the
/// last place of the compute dtype (values below 1e-6 of the step's largest gradient left
/// out, as the simulated device's tolerance leaves them), for the hardware run's log. The simulated device adds
/// in the emulator's order and is held to the tolerances in every step.
fn t5_close(cpu: &[StepRecord], dev: &[StepRecord], p: Precision, what: &str) {
    let hardware = on_hardware();
    let (mantissa, min_exp) = match p.low_dtype() {
        Some(DType::F16) => (10, -14),
        Some(DType::BF16) => (7, -126),
        _ => (23, -126),
    };
    let ulps = |a: f64, b: f64| -> f64 {
        let v = a.abs().max(b.abs());
        let e = if v > 0.0 {
            v.log2().floor() as i32
        } else {
            min_exp
        };
        (a - b).abs() / 2f64.powi(e.max(min_exp) - mantissa)
    };
    let mut worst = (0.0f64, String::new());
    for (c, d) in cpu.iter().zip(dev) {
        let s = c.step;
        assert_eq!(
            (c.found_inf, c.skipped, c.scale_before, c.scale_after),
            (d.found_inf, d.skipped, d.scale_before, d.scale_after),
            "{what} step {s}: skip decision and scale"
        );
        let largest = c
            .params
            .iter()
            .map(|p| p.max_abs_grad)
            .filter(|g| g.is_finite())
            .fold(0.0, f64::max);
        let mut values = vec![
            ("loss".to_string(), c.loss, d.loss, 1e-5),
            ("grad norm".to_string(), c.grad_norm, d.grad_norm, 1e-5),
        ];
        for (pc, pd) in c.params.iter().zip(&d.params) {
            assert_eq!(pc.nonfinite, pd.nonfinite, "{what} step {s} {}", pc.name);
            values.push((
                format!("{} max |g|", pc.name),
                Some(pc.max_abs_grad),
                Some(pd.max_abs_grad),
                1e-3,
            ));
            values.push((
                format!("{} max |p|", pc.name),
                Some(pc.param_max_abs_after),
                Some(pd.param_max_abs_after),
                1e-3,
            ));
        }
        for (q, a, b, tol) in values {
            let (a, b) = (a.unwrap_or(0.0), b.unwrap_or(0.0));
            if hardware {
                // Gradients that are zero but for rounding (a key bias under softmax) have
                // no last place to speak of: below 1e-6 of the step's largest, not counted.
                let tiny = tol == 1e-3 && a.abs().max(b.abs()) <= 1e-6 * largest;
                if a.is_finite() && b.is_finite() && !tiny && ulps(a, b) > worst.0 {
                    worst = (ulps(a, b), format!("step {s} {q}: {a} vs {b}"));
                }
                continue;
            }
            let small = tol == 1e-3 && (a - b).abs() <= 1e-6 * largest;
            assert!(rel(a, b) <= tol || small, "{what} step {s}: {q} {a} vs {b}");
        }
    }
    if hardware {
        eprintln!(
            "{what}: largest deviation from the emulator {:.1} units in the last place of {} \
             ({})",
            worst.0,
            p.low_dtype().unwrap_or(DType::F32),
            worst.1
        );
    }
}

const T5_CASES: [&str; 3] = [
    "samples/t5_overflow_small",
    "tests/golden/t5_variants/gated_gelu_block1",
    "tests/golden/t5_variants/relu_6_layers_block4",
];

/// Two steps of a T5 case in every precision mode (pure fp16 with and without
/// transformers' clamp) on both backends, held by [`t5_close`] and [`same_ops`].
fn t5_case_in_every_mode(dir: &str) {
    if !device_or_skip() {
        return;
    }
    for (p, clamp) in [
        (Precision::Fp32, false),
        (Precision::Fp16, false),
        (Precision::Bf16, false),
        (Precision::O2, false),
        (Precision::O2Bf16, false),
        (Precision::Half, false),
        (Precision::Half, true),
        (Precision::Bf16Pure, false),
    ] {
        let what = format!("{dir} {p:?} clamp {clamp}");
        let cpu = t5(dir, p, clamp, BackendKind::Cpu, 2, |_| {});
        let dev = t5(dir, p, clamp, BackendKind::Cuda, 2, |_| {});
        t5_close(&cpu, &dev, p, &what);
        same_ops(&cpu, &dev, &what);
        if clamp {
            same_clamp_bounds(&cpu, &dev, &what);
        }
    }
}

/// transformers' clamp chose the same bound on both backends: every clamp op's largest
/// |value| is identical (in pure fp16 each GEMM output is rounded to 16 bits, which absorbs
/// cuBLAS's order, and a clamp that bites leaves its bound, 64504 or 65504, as the largest).
fn same_clamp_bounds(cpu: &[StepRecord], dev: &[StepRecord], what: &str) {
    let mut clamps = 0;
    for (c, d) in cpu.iter().zip(dev) {
        let (co, dops) = (c.ops.as_ref().unwrap(), d.ops.as_ref().unwrap());
        for (a, b) in co.iter().zip(dops).filter(|(a, _)| a.op == "clamp") {
            assert_eq!(
                a.stats.max_abs, b.stats.max_abs,
                "{what} step {}: clamp #{} in {} ({:?})",
                c.step, a.index, a.module, a.phase
            );
            clamps += 1;
        }
    }
    assert!(clamps > 0, "{what}: no clamp op");
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_t5_fixture_matches_the_emulator_in_every_precision_mode() {
    t5_case_in_every_mode(T5_CASES[0]);
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_gated_gelu_t5_variant_matches_the_emulator_in_every_precision_mode() {
    t5_case_in_every_mode(T5_CASES[1]);
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_six_layer_t5_variant_matches_the_emulator_in_every_precision_mode() {
    t5_case_in_every_mode(T5_CASES[2]);
}

/// The GPT-2 sample (scripts/make_gpt2.py's checkpoint, its block 1 attention scores past
/// fp16's range) in every precision mode on both backends.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_gpt2_sample_matches_the_emulator_in_every_precision_mode() {
    hf_sample_in_every_mode("samples/gpt2_overflow_tiny");
}

/// The BERT sample (scripts/make_bert.py's checkpoint: padding with the extended mask, the
/// padding row without gradient, token types, -100 labels; layer 1's FFN output past
/// 65504) on the device, step for step as on the emulator.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_bert_sample_matches_the_emulator_in_every_precision_mode() {
    hf_sample_in_every_mode("samples/bert_overflow_tiny");
}

/// The full T5 sample (scripts/make_t5_seq2seq.py's checkpoint: encoder padding, the
/// causal decoder with cross-attention, an untied head; decoder block 1's `wo` past 65504)
/// on the device, step for step as on the emulator, with the clamp off and on.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_t5_seq2seq_sample_matches_the_emulator_in_every_precision_mode() {
    hf_sample_in_every_mode("samples/t5_seq2seq_tiny");
    if !device_or_skip() {
        return;
    }
    let dir = "samples/t5_seq2seq_tiny";
    let cpu = t5(dir, Precision::Half, true, BackendKind::Cpu, 2, |_| {});
    let dev = t5(dir, Precision::Half, true, BackendKind::Cuda, 2, |_| {});
    t5_close(&cpu, &dev, Precision::Half, "t5 seq2seq half clamp");
    same_ops(&cpu, &dev, "t5 seq2seq half clamp");
    same_clamp_bounds(&cpu, &dev, "t5 seq2seq half clamp");
}

/// The LLaMA sample (scripts/make_llama.py's checkpoint: grouped-query attention, rotary
/// embeddings, RMSNorm, SwiGLU; layer 1's MLP output past fp16's range) in every
/// precision mode on both backends.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn the_llama_sample_matches_the_emulator_in_every_precision_mode() {
    hf_sample_in_every_mode("samples/llama_overflow_tiny");
}

/// Two steps of a Hugging Face sample in every precision mode on both backends.
fn hf_sample_in_every_mode(dir: &str) {
    if !device_or_skip() {
        return;
    }
    for p in [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::O2,
        Precision::O2Bf16,
        Precision::Half,
        Precision::Bf16Pure,
    ] {
        let what = format!("{dir} {p:?}");
        let cpu = t5(dir, p, false, BackendKind::Cpu, 2, |_| {});
        let dev = t5(dir, p, false, BackendKind::Cuda, 2, |_| {});
        t5_close(&cpu, &dev, p, &what);
        same_ops(&cpu, &dev, &what);
    }
}

/// Without probes nothing counts a rounding, so 16-bit products come out of cuBLAS in
/// their dtype, rounded there instead of by the counting cast: steps of every sample in
/// the 16-bit modes still match the emulator's (held by [`t5_close`]: skips, scales,
/// non-finite counts; values to the tolerances on the simulated device). There, where
/// both roundings are the same arithmetic, the losses, scales and parameter records also
/// equal the probed device step's bit for bit.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn unprobed_steps_with_cublas_rounded_products_match_the_emulator() {
    if !device_or_skip() {
        return;
    }
    let unprobed = |t: &mut amprobe::train::TrainConfig| t.probes = false;
    for dir in [
        T5_CASES[0],
        "samples/gpt2_overflow_tiny",
        "samples/llama_overflow_tiny",
        "samples/t5_seq2seq_tiny",
    ] {
        for p in [
            Precision::Fp16,
            Precision::Bf16,
            Precision::O2,
            Precision::Half,
        ] {
            let what = format!("{dir} {p:?} unprobed");
            let cpu = t5(dir, p, false, BackendKind::Cpu, 3, unprobed);
            let dev = t5(dir, p, false, BackendKind::Cuda, 3, unprobed);
            t5_close(&cpu, &dev, p, &what);
            if !on_hardware() {
                let probed = t5(dir, p, false, BackendKind::Cuda, 3, |_| {});
                let key = |r: &[StepRecord]| {
                    r.iter()
                        .map(|s| {
                            let params: Vec<_> = s
                                .params
                                .iter()
                                .map(|q| {
                                    (q.max_abs_grad.to_bits(), q.param_max_abs_after.to_bits())
                                })
                                .collect();
                            (s.loss.map(f64::to_bits), s.scale_after.to_bits(), params)
                        })
                        .collect::<Vec<_>>()
                };
                let (a, b) = (key(&dev), key(&probed));
                if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
                    panic!("{what}: step {i}'s loss, scale or parameters differ when probed");
                }
            }
        }
    }
}

/// Device steps the sampling keeps no records of only count their forward and backward
/// outputs' non-finite values; one that keeps them for a non-finite value completes them
/// from a re-run on the device. Every record (but the wall time) must equal, bit for bit, a
/// trainer's that gathers full statistics in every step.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn check_only_device_steps_keep_the_records_of_full_statistics() {
    if !device_or_skip() {
        return;
    }
    let comparable = |r: &StepRecord| {
        let mut v = serde_json::to_value(r).unwrap();
        v.as_object_mut().unwrap().remove("wall_ms");
        v
    };
    let unscheduled = |t: &mut amprobe::train::TrainConfig| {
        t.sampling.every = 0;
        t.sampling.first = false;
    };
    for (dir, p, nonfinite) in [
        (T5_CASES[0], Precision::Fp16, true),
        (T5_CASES[0], Precision::Bf16, false),
        ("samples/gpt2_overflow_tiny", Precision::Fp16, true),
        ("samples/bert_overflow_tiny", Precision::Half, true),
    ] {
        let what = format!("{dir} {p:?}");
        let mut full = t5_trainer(dir, p, false, BackendKind::Cuda, unscheduled);
        full.set_full_statistics(true);
        let mut checked = t5_trainer(dir, p, false, BackendKind::Cuda, unscheduled);
        let mut seen = Vec::new();
        for s in 0..3 {
            let a = full
                .step(s)
                .unwrap_or_else(|e| panic!("{what} step {s}: {e}"));
            let b = checked
                .step(s)
                .unwrap_or_else(|e| panic!("{what} step {s}: {e}"));
            assert!(!full.last_step_checked_only());
            assert_eq!(comparable(&a), comparable(&b), "{what}: step {s}");
            seen.push((checked.last_step_checked_only(), b.ops.is_some()));
        }
        assert!(seen[0].0, "{what}: the first step is only checked");
        if nonfinite {
            assert_eq!(
                seen[0],
                (true, true),
                "{what}: step 0 is completed, got {seen:?}"
            );
        } else {
            assert!(seen.iter().all(|&s| s == (true, false)), "{what}: {seen:?}");
        }
    }
}

/// Twenty steps of the T5 sample with transformers' fix (`wo` kept in fp32) from a scale
/// of 2^24 that grows every 3 clean steps: the backward overflows, the scale backs off,
/// then grows again, step for step as on the emulator.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn twenty_t5_steps_give_the_emulators_loss_scale_sequence() {
    if !device_or_skip() {
        return;
    }
    let tweak = |t: &mut amprobe::train::TrainConfig| {
        t.keep_fp32 = vec!["wo".into()];
        t.scaler = ScalerConfig {
            init_scale: 16_777_216.0,
            growth_interval: 3,
            ..Default::default()
        };
        t.sampling.every = 0;
    };
    let dir = T5_CASES[0];
    let cpu = t5(dir, Precision::Fp16, false, BackendKind::Cpu, 20, tweak);
    let dev = t5(dir, Precision::Fp16, false, BackendKind::Cuda, 20, tweak);
    let scales = |r: &[StepRecord]| {
        r.iter()
            .map(|s| (s.scale_before, s.skipped))
            .collect::<Vec<_>>()
    };
    assert!(cpu.iter().any(|r| r.skipped), "the case must skip steps");
    assert!(
        cpu.windows(2)
            .any(|w| w[1].scale_before > w[0].scale_before),
        "and grow the scale again"
    );
    assert_eq!(scales(&cpu), scales(&dev));
    t5_close(&cpu, &dev, Precision::Fp16, "t5 twenty steps");
}

/// A label out of range fails the step on the device with the emulator's error, naming the
/// label and its position, instead of a NaN loss.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn a_label_out_of_range_is_the_emulators_error_on_the_device() {
    if !device_or_skip() {
        return;
    }
    let model = amprobe::models::mlp::Mlp {
        inputs: 12,
        hidden: 16,
        classes: 5,
    };
    let mut batch = amprobe::models::mlp::synthetic_batch(12, 5, 8, 1, 0).unwrap();
    batch.labels = Tensor::from_i64(vec![0, 1, 2, -100, 4, 9, 1, 0], &[8]).unwrap();
    let error = |backend: BackendKind| {
        let mut cfg = base(Precision::Fp16);
        cfg.backend = backend;
        let mut t = Trainer::new(
            cfg,
            Box::new(model.clone()),
            model.init(1).unwrap(),
            Box::new(amprobe::train::FixedBatch(batch.clone())),
        )
        .unwrap();
        t.step(0).expect_err("the step must fail").to_string()
    };
    let (cpu, dev) = (error(BackendKind::Cpu), error(BackendKind::Cuda));
    assert!(cpu.contains("label 9 at position 5"), "{cpu}");
    assert_eq!(cpu, dev);
}

/// Steps whose op statistics were gathered by the kernels that wrote the outputs give the
/// records the probe arena's own pass over each output gives: every field of every step
/// and op record is identical, the sums of squares aside. Those are f64 sums: each thread
/// sums the values it writes, in the order it writes them, then the block's tree and the
/// blocks in order. The arena batches a tensor under 64k values into one block where a
/// gathering kernel runs the statistics pass's shape (one block per 2048 values); both
/// shapes are one block up to 2048 values and the same from 64k on. There, a kernel that
/// writes in output order gives the sum bit for bit; the gradient of a transpose or a
/// permute writes in its input's order (a permutation of the output), softmax and
/// log-softmax (and their gradients) a line per thread on their own launch shape, and
/// other sizes split the sum otherwise, so those are within 2n·2⁻⁵³ relative (both
/// orders' error bounds for n positive terms).
fn same_records_either_way(fused: &[StepRecord], pass: &[StepRecord], what: &str) {
    assert_eq!(fused.len(), pass.len());
    for (a, b) in fused.iter().zip(pass) {
        let (mut a, mut b) = (a.clone(), b.clone());
        (a.wall_ms, b.wall_ms) = (0.0, 0.0);
        let (ao, bo) = (a.ops.as_mut().unwrap(), b.ops.as_mut().unwrap());
        assert_eq!(ao.len(), bo.len(), "{what} step {}: op count", a.step);
        for (x, y) in ao.iter_mut().zip(bo.iter_mut()) {
            let (n, sx, sy) = (x.stats.numel, x.stats.sum_sq, y.stats.sum_sq);
            let at = format!("{what} step {} {} #{} {}", a.step, x.op, x.index, x.module);
            let permuted = x.phase == Phase::Backward && (x.op == "transpose" || x.op == "permute");
            let by_line = x.op == "softmax" || x.op == "log_softmax";
            if (n <= 2048 || n >= 65536) && !permuted && !by_line {
                assert_eq!(
                    sx.to_bits(),
                    sy.to_bits(),
                    "{at}: sum of squares {sx} vs {sy}"
                );
            } else {
                let bound = 2.0 * n as f64 * 2f64.powi(-53);
                assert!(rel(sx, sy) <= bound, "{at}: sum of squares {sx} vs {sy}");
            }
            y.stats.sum_sq = sx;
        }
        let (ja, jb) = (
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap(),
        );
        assert!(ja == jb, "{what} step {}: records differ", a.step);
    }
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn statistics_gathered_by_the_producing_kernels_equal_the_arenas_own_pass() {
    if !device_or_skip() {
        return;
    }
    for (dir, p, clamp) in [
        (T5_CASES[0], Precision::Fp16, false),
        (T5_CASES[0], Precision::Fp32, false),
        (T5_CASES[0], Precision::Half, true),
        (T5_CASES[1], Precision::Bf16, false),
        (T5_CASES[2], Precision::O2, false),
    ] {
        let what = format!("{dir} {p:?} clamp {clamp}");
        let run = |fused: bool| {
            let mut t = t5_trainer(dir, p, clamp, BackendKind::Cuda, |_| {});
            t.set_fused_stats(fused);
            steps_of(&mut t, 2, &what)
        };
        same_records_either_way(&run(true), &run(false), &what);
    }
    // The MLP's linear layers with biases: in fp32 the bias sum is the output.
    for p in [Precision::Fp32, Precision::Fp16] {
        let mut cfg = base(p);
        cfg.backend = BackendKind::Cuda;
        cfg.sampling.every = 1;
        let run = |fused: bool| {
            let mut t = Trainer::new(
                cfg.clone(),
                Box::new(SumMlp),
                params(3, 0.5),
                Box::new(amprobe::train::FixedBatch(batch(5, 1.0))),
            )
            .unwrap();
            t.set_fused_stats(fused);
            steps_of(&mut t, 2, "mlp")
        };
        same_records_either_way(&run(true), &run(false), &format!("mlp {p:?}"));
    }
}

/// Each parameter's record, gathered by its update kernel in the pass that steps it,
/// against the host's record of the same device step: the step's gradients and new values
/// read back and recorded as the emulator records them (`ParamRecord::from_grad`). Every
/// field is identical but the gradient's L2 norm, an f64 sum in another order (within
/// 2n·2⁻⁵³ relative for n positive terms, both orders' error bounds together). A loss
/// scale of 2⁻¹⁶ makes the scaled fp16 flushes count.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn each_parameters_record_is_gathered_by_its_update_as_the_host_records_it() {
    if !device_or_skip() {
        return;
    }
    use amprobe::trace::record::ParamRecord;
    let mut flushed = 0;
    for (dir, p) in [
        (T5_CASES[0], Precision::Fp16),
        (T5_CASES[1], Precision::Bf16),
        (T5_CASES[0], Precision::Half),
    ] {
        let mut t = t5_trainer(dir, p, false, BackendKind::Cuda, |c| {
            c.scaler.init_scale = 2f32.powi(-16);
            c.scaler.growth_interval = 1000;
        });
        for s in 0..2 {
            let rec = t.step(s).unwrap();
            for (i, (param, g)) in t.params().params.iter().zip(t.last_grads()).enumerate() {
                let Some(g) = g else {
                    assert!(rec.params[i].grad_dtype.is_none());
                    continue;
                };
                let gh = g.to_host().unwrap();
                let ph = param.value.to_host().unwrap();
                let host = ParamRecord::from_grad(
                    &param.name,
                    ph.dtype(),
                    gh.dtype(),
                    gh.f32s().unwrap(),
                    rec.scale_before as f32,
                    ph.f32s().unwrap(),
                );
                let mut dev = rec.params[i].clone();
                let what = format!("{dir} {p:?} step {s} {}", param.name);
                let bound = 2.0 * host.numel as f64 * 2f64.powi(-53);
                assert!(
                    rel(host.grad_l2, dev.grad_l2) <= bound,
                    "{what}: grad L2 {} vs {}",
                    host.grad_l2,
                    dev.grad_l2
                );
                dev.grad_l2 = host.grad_l2;
                assert_eq!(host, dev, "{what}");
                flushed += (dev.f16_underflow_frac_scaled > 0.0) as usize;
            }
        }
    }
    assert!(flushed > 0, "no record counted a scaled fp16 flush");
}

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn blame_on_the_device_matches_the_emulators() {
    if !device_or_skip() {
        return;
    }
    // The simulated device adds a product's terms in the emulator's order, so its outputs,
    // and every figure of their blame, are the emulator's. On hardware cuBLAS adds them in
    // its own order: a 16-bit product's f32 sum can round to the other neighbour, and the
    // blame of that output and of everything after it moves with it (an fp16 `fc1` total of
    // 4.7307e-4 against 4.7306e-4 on an H200), by as much as the model's conditioning makes
    // of it. There the same ops are blamed in every phase, and the largest difference is
    // printed for the run's log, as `t5_close` does with values.
    let hardware = on_hardware();
    // Two steps of AdamW in bf16, every step blamed: the second's exact update starts
    // from the moments the first left on the device, read back.
    let blamed = |precision: Precision, backend: BackendKind, adamw: bool| {
        let cfg = RunConfig::load(std::path::Path::new("samples/mlp.toml")).unwrap();
        let mut train = cfg.train_config().unwrap();
        train.precision = precision;
        train.backend = backend;
        train.blame = true;
        train.clip = Some(1.0);
        if adamw {
            train.optimizer = OptimizerConfig::AdamW(AdamWConfig::default());
            train.sampling.every = 1;
        }
        let (m, p, d) = amprobe::runner::build(&cfg, &train).unwrap();
        let mut t = Trainer::new(train, m, p, d).unwrap();
        let steps = if adamw { 2 } else { 1 };
        (0..steps)
            .flat_map(|s| t.step(s).unwrap().ops.unwrap())
            .collect::<Vec<_>>()
    };
    for (precision, adamw) in [
        (Precision::Fp16, false),
        (Precision::Bf16, false),
        (Precision::Bf16, true),
    ] {
        let (cpu, dev) = (
            blamed(precision, BackendKind::Cpu, adamw),
            blamed(precision, BackendKind::Cuda, adamw),
        );
        let what = format!("{precision:?} adamw {adamw}");
        assert_eq!(cpu.len(), dev.len(), "{what}");
        let mut n = 0;
        let mut worst = (0.0f64, String::new());
        for (a, b) in cpu.iter().zip(&dev) {
            assert_eq!((&a.op, &a.module), (&b.op, &b.module), "{what}");
            match (a.blame, b.blame) {
                (None, None) => {}
                (Some(x), Some(y)) => {
                    n += 1;
                    for (f, g, name) in [
                        (x.introduced, y.introduced, "introduced"),
                        (x.inherited, y.inherited, "inherited"),
                        (x.total, y.total, "total"),
                        (x.input, y.input, "input"),
                    ] {
                        let d = (f - g).abs() / f.abs().max(g.abs()).max(1e-300);
                        if hardware {
                            if d > worst.0 {
                                worst = (
                                    d,
                                    format!(
                                        "{} {} {name}: cpu {f:e}, device {g:e}",
                                        a.op, a.module
                                    ),
                                );
                            }
                            continue;
                        }
                        assert!(
                            (f - g).abs() <= 1e-6 * f.abs().max(g.abs()) + 1e-9,
                            "{what}: {} {} {name}: cpu {f:e}, device {g:e}",
                            a.op,
                            a.module
                        );
                    }
                }
                _ => panic!("{what}: {} {} blamed on one backend only", a.op, a.module),
            }
        }
        if hardware {
            eprintln!("{what}: largest relative difference of a blame figure from the emulator's {:.1e} ({})", worst.0, worst.1);
        }
        assert!(n > 5, "{what}: {n} ops blamed");
        assert!(
            dev.iter()
                .any(|o| o.blame.is_some_and(|b| b.introduced > 0.0)),
            "{what}: no op introduced any error"
        );
        // The backward ops are blamed too, from the gradients read back, and the optimizer
        // phase's.
        for (phase, op) in [
            (Phase::Backward, None),
            (Phase::Optimizer, Some("unscale")),
            (Phase::Optimizer, Some("clip_grad_norm")),
            (Phase::Optimizer, Some("optimizer_step")),
        ] {
            assert!(
                dev.iter().any(|o| o.phase == phase
                    && op.is_none_or(|op| o.op == op)
                    && o.blame.is_some_and(|b| b.total > 0.0)),
                "{what}: no {phase:?} {op:?} blamed"
            );
        }
        // Four parameters a step.
        let updates = dev
            .iter()
            .filter(|o| o.op == "optimizer_step" && o.blame.is_some())
            .count();
        assert_eq!(updates, if adamw { 8 } else { 4 }, "{what}");
    }
}
