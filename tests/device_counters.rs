//! What a training step asks of the device, counted by the simulated device: one
//! device-to-host read per step, no allocations once the memory cache is warm, the same
//! launches every step. Alone in its test binary, since the counters are the process's,
//! and its tests one at a time ([`COUNTERS`]).

#[path = "device_step/common.rs"]
mod common;
use amprobe::amp::mode::Precision;
use amprobe::backend::BackendKind;
use amprobe::train::{FixedBatch, Trainer};
use common::*;

/// Held by each test while it counts: the counters are the process's.
static COUNTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn a_step_reads_the_device_once_and_allocates_nothing_once_the_pool_is_warm() {
    if !device_or_skip() {
        return;
    }
    use amprobe::device::cuda::counters::sim_counters;
    let _serial = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let mut cfg = base(Precision::Fp16);
    cfg.backend = BackendKind::Cuda;
    cfg.clip = Some(1.0);
    let mut t = Trainer::new(
        cfg,
        Box::new(SumMlp),
        params(3, 0.5),
        Box::new(FixedBatch(batch(5, 1.0))),
    )
    .unwrap();
    let Some(mut before) = sim_counters() else {
        eprintln!("skipped: counters exist on the simulated device only");
        return;
    };
    let mut launches = Vec::new();
    for s in 0..5 {
        t.step(s).unwrap();
        let now = sim_counters().unwrap();
        let d = now.since(&before);
        before = now;
        assert_eq!(d.dtoh_copies, 1, "step {s}: device-to-host reads {d:?}");
        // The cache of freed memory fills over two steps: during step 1 the trainer still
        // holds step 0's starting parameters (what a replay of the last step needs) beside
        // step 0's results, one more set than step 0 had alive.
        if s >= 2 {
            assert_eq!(d.allocs, 0, "step {s}: device allocations {d:?}");
        } else {
            assert!(d.allocs > 0);
            continue;
        }
        assert!(d.launches > 0);
        launches.push(d.launches);
    }
    assert!(
        launches.windows(2).all(|w| w[0] == w[1]),
        "every step launches the same kernels: {launches:?}"
    );

    // The T5 sample in pure fp16 with transformers' clamp, whose blocks overflow: the clamp's
    // choice of bound is made on the device, so a step still reads once. (Here, not in a
    // test of its own: the counters are the process's and tests run side by side.)
    let dir = std::path::PathBuf::from("samples/t5_overflow_small");
    let mut rc = amprobe::config::RunConfig::default();
    rc.model.hf = Some(dir.clone());
    rc.model.t5_clamp = Some(true);
    rc.data.inputs = Some(dir.join("inputs.safetensors"));
    let mut train = rc.train_config().unwrap();
    train.precision = Precision::Half;
    train.backend = BackendKind::Cuda;
    let (m, p, d) = amprobe::runner::build(&rc, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    assert!(t.model().describe().contains("fp16 clamp"));
    let mut before = sim_counters().unwrap();
    for s in 0..2 {
        t.step(s).unwrap();
        let now = sim_counters().unwrap();
        let d = now.since(&before);
        before = now;
        assert_eq!(
            d.dtoh_copies, 1,
            "t5 clamp step {s}: device-to-host reads {d:?}"
        );
    }
}

/// With probes on, the kernels that write op outputs gather their statistics as they
/// write them: against the probe arena's own pass over each output, a step launches fewer
/// kernels and reads less. Every cast of 64k values or more (whose probe would have been a
/// launch of its own, reading the whole output) is one launch and its output's bytes
/// fewer at least. Same records either way (`device_step.rs`).
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn gathering_statistics_in_the_producing_kernels_saves_a_launch_and_a_read_per_output() {
    if !device_or_skip() {
        return;
    }
    use amprobe::device::cuda::counters::{measure_traffic, sim_counters};
    use amprobe::models::pretrained::Pretrained;
    use amprobe::models::t5::{synthetic_ids, T5Config, T5Encoder};
    use amprobe::optim::{OptimizerConfig, SgdConfig};
    use amprobe::train::{Synthetic, TrainConfig};
    let _serial = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let trainer = |fused: bool| {
        let cfg = T5Config::relu(256, 512, (4, 64), 1, 64);
        let model = T5Encoder::new(cfg);
        let params = model.seeded(0).unwrap();
        let mut train = TrainConfig {
            precision: Precision::Fp16,
            backend: BackendKind::Cuda,
            optimizer: OptimizerConfig::Sgd(SgdConfig {
                lr: 0.01,
                ..SgdConfig::default()
            }),
            ..TrainConfig::default()
        };
        train.sampling.every = 1;
        let data = Synthetic(|step, micro| synthetic_ids(64, 1, 256, 0, step * 16 + micro as u64));
        let mut t = Trainer::new(train, Box::new(model), params, Box::new(data)).unwrap();
        t.set_fused_stats(fused);
        t
    };
    let mut measured = Vec::new();
    for fused in [true, false] {
        let mut t = trainer(fused);
        for s in 0..2 {
            t.step(s).unwrap();
        }
        measure_traffic(true);
        let before = sim_counters().unwrap();
        let rec = t.step(2).unwrap();
        let d = sim_counters().unwrap().since(&before);
        measure_traffic(false);
        assert_eq!(d.dtoh_copies, 1, "fused {fused}: {d:?}");
        measured.push((d, rec));
    }
    let ((fused, rec), (pass, _)) = (&measured[0], &measured[1]);
    let big_casts: Vec<u64> = rec
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .filter(|o| o.op == "to" && o.stats.numel >= 65_536)
        .map(|o| {
            o.stats.numel
                * if o.output.dtype.is_low_precision() {
                    2
                } else {
                    4
                }
        })
        .collect();
    assert!(big_casts.len() >= 4, "{big_casts:?}");
    assert!(
        fused.launches + big_casts.len() as u64 <= pass.launches,
        "launches: gathered {}, own pass {}, casts of 64k+ values {}",
        fused.launches,
        pass.launches,
        big_casts.len()
    );
    let cast_bytes: u64 = big_casts.iter().sum();
    assert!(
        fused.kernel_read_bytes + cast_bytes <= pass.kernel_read_bytes,
        "bytes read: gathered {}, own pass {}, cast outputs {cast_bytes}",
        fused.kernel_read_bytes,
        pass.kernel_read_bytes
    );
}

/// Launches of each named kernel during `f`.
fn kernel_launches<R>(names: &[&str], f: impl FnOnce() -> R) -> (Vec<u64>, R) {
    use amprobe::device::cuda::counters::sim_kernel_launches;
    let count = || -> Vec<u64> {
        names
            .iter()
            .map(|n| sim_kernel_launches(n).expect("the simulated device"))
            .collect()
    };
    let before = count();
    let r = f();
    let after = count();
    (after.iter().zip(&before).map(|(a, b)| a - b).collect(), r)
}

/// With probes off (`--no-probes`) a device step runs no statistics pass at all: the
/// per-parameter records every step carries are gathered by the update kernels, and the
/// one arena read sums their partials (one launch of `amp_stats_finish`). Probes on, the
/// arena's own pass runs only for what no kernel gathered. Every parameter's update is
/// one launch, and so are the unscale, the gradient norms and the clip.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn without_probes_a_device_step_runs_no_statistics_pass() {
    if !device_or_skip() {
        return;
    }
    let _serial = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let names = [
        "amp_stats",
        "amp_stats_batch",
        "amp_stats_finish",
        "amp_sgd_multi",
        "amp_adam_multi",
        "amp_unscale_multi",
        "amp_grad_norm_multi",
        "amp_clip_apply_multi",
    ];
    let dir = std::path::PathBuf::from("samples/t5_overflow_small");
    for probes in [false, true] {
        let mut rc = amprobe::config::RunConfig::default();
        rc.model.hf = Some(dir.clone());
        rc.data.inputs = Some(dir.join("inputs.safetensors"));
        let mut train = rc.train_config().unwrap();
        train.precision = Precision::Fp16;
        train.backend = BackendKind::Cuda;
        train.clip = Some(1.0);
        train.probes = probes;
        let (m, p, d) = amprobe::runner::build(&rc, &train).unwrap();
        let mut t = Trainer::new(train, m, p, d).unwrap();
        for s in 0..3 {
            let (n, rec) = kernel_launches(&names, || t.step(s).unwrap());
            let with_grad = rec.params.iter().filter(|p| p.grad_dtype.is_some()).count();
            assert!(with_grad > 0 && rec.params.iter().all(|p| p.numel > 0));
            // Every parameter's update (and record) in one launch, and so the unscale, the
            // per-gradient norms and the clip.
            assert_eq!(n[3] + n[4], 1, "step {s}: {names:?} {n:?}");
            assert_eq!(n[5..], [1, 1, 1], "step {s}: {names:?} {n:?}");
            if !probes {
                assert_eq!(n[..3], [0, 0, 1], "probes off, step {s}: {names:?}");
            } else {
                assert_eq!(n[2], 1, "probes on, step {s}");
                assert!(n[0] + n[1] > 0, "probes on, step {s}: {n:?}");
            }
        }
    }
}

/// An add's gradient to an operand of the output's shape and dtype is the output gradient
/// itself (no kernel, as on the host), and no gradient is computed for an operand that
/// needs none (an attention mask): the backward of `(x + y) + mask`, mask broadcast, launches
/// no gradient kernel at all, and the gradients are the output gradient's values.
#[test]
#[ignore = "needs a GPU or the simulated device: scripts/test.sh runs it on the simulated device"]
fn add_gradients_pass_through_and_masks_get_none() {
    if !device_or_skip() {
        return;
    }
    use amprobe::device::cuda::counters::sim_kernel_launches;
    use amprobe::dtype::DType;
    use amprobe::engine::Engine;
    use amprobe::tensor::Tensor;
    let _serial = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let dev = amprobe::backend::open_device(0, false).expect("open device 0");
    let t = |v: Vec<f32>, s: &[usize]| Tensor::from_f32(v, s, DType::F32).unwrap();
    let x = t((0..12).map(|i| i as f32 * 0.5).collect(), &[2, 2, 3])
        .to_device(&dev)
        .unwrap()
        .as_leaf(true);
    let y = t(vec![1.0; 12], &[2, 2, 3])
        .to_device(&dev)
        .unwrap()
        .as_leaf(true);
    let mask = t(vec![0.0, -1.0, 0.0], &[1, 1, 3]).to_device(&dev).unwrap();
    let g = t((0..12).map(|i| 1.0 - i as f32).collect(), &[2, 2, 3])
        .to_device(&dev)
        .unwrap();
    let kernels = [
        "amp_binary_grad",
        "amp_binary_grad_same",
        "amp_binary_grad_warp",
    ];
    let Some(before) = kernels
        .iter()
        .map(|k| sim_kernel_launches(k))
        .collect::<Option<Vec<u64>>>()
    else {
        eprintln!("skipped: counters exist on the simulated device only");
        return;
    };
    let mut e = Engine::new();
    let s = e.add(&x, &y).unwrap();
    let out = e.add(&s, &mask).unwrap();
    let grads = e.backward_with(&out, g.clone()).unwrap();
    let after: Vec<u64> = kernels
        .iter()
        .map(|k| sim_kernel_launches(k).unwrap())
        .collect();
    assert_eq!(after, before, "gradient kernels launched ({kernels:?})");
    let want = g.to_host().unwrap().f32s().unwrap().to_vec();
    for leaf in [&x, &y] {
        let got = grads[&leaf.id()].to_host().unwrap();
        assert_eq!(got.f32s().unwrap(), want.as_slice());
    }
}
