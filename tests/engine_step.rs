//! The step engine: injected non-finite values are traced to their origin, the scaler in
//! the training loop follows the simulator, accumulation, clipping and every precision mode.

use amprobe::amp::mode::Precision;
use amprobe::amp::simulate::simulate;
use amprobe::config::RunConfig;
use amprobe::engine::Injection;
use amprobe::runner::build;
use amprobe::trace::record::Phase;
use amprobe::train::Trainer;
use std::collections::BTreeSet;
use std::path::Path;

fn trainer(edit: impl FnOnce(&mut RunConfig)) -> Trainer {
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    edit(&mut cfg);
    let train = cfg.train_config().unwrap();
    let (m, p, d) = build(&cfg, &train).unwrap();
    Trainer::new(train, m, p, d).unwrap()
}

#[test]
fn injected_inf_is_the_first_inf_and_the_nan_is_named() {
    let mut t = trainer(|_| {});
    t.inject(Injection {
        step: Some(0),
        op: "linear".into(),
        module: "fc1".into(),
        phase: Phase::Forward,
        value: f32::INFINITY,
    });
    let rec = t.step(0).unwrap();
    let inf = rec.origins.first_inf.clone().expect("an Inf origin");
    assert_eq!(
        (inf.op.as_str(), inf.module.as_str(), inf.phase),
        ("linear", "fc1", Phase::Forward)
    );
    let ops = rec.ops.as_ref().expect("a non-finite step keeps its ops");
    let fc1 = ops
        .iter()
        .find(|o| o.module == "fc1" && o.op == "linear" && o.phase == Phase::Forward)
        .unwrap();
    assert_eq!(
        inf.op_index, fc1.index,
        "the origin is exactly the injected op"
    );
    let nan = rec.origins.first_nan.clone().expect("a NaN follows");
    assert!(nan.op_index > inf.op_index);
    // The NaN's op is the first one whose output holds a NaN.
    let first_nan_op = ops.iter().find(|o| o.stats.nan > 0).unwrap();
    assert_eq!(nan.op_index, first_nan_op.index);
    assert_eq!(
        rec.origins.chain.first().map(|o| o.op_index),
        Some(inf.op_index)
    );
    assert_eq!(
        rec.origins.chain.last().map(|o| o.op_index),
        Some(nan.op_index)
    );
    assert!(rec.skipped, "the step with non-finite gradients is skipped");
}

#[test]
fn injected_backward_inf_is_a_backward_origin() {
    let mut t = trainer(|_| {});
    t.inject(Injection {
        step: Some(0),
        op: "relu".into(),
        module: "relu".into(),
        phase: Phase::Backward,
        value: f32::INFINITY,
    });
    let rec = t.step(0).unwrap();
    let inf = rec.origins.first_inf.expect("an Inf origin");
    assert_eq!(
        (inf.op.as_str(), inf.module.as_str(), inf.phase),
        ("relu", "relu", Phase::Backward)
    );
    let ops = rec.ops.unwrap();
    let fwd = ops
        .iter()
        .find(|o| o.index == inf.forward_op.unwrap())
        .unwrap();
    assert_eq!(
        (fwd.op.as_str(), fwd.phase),
        ("relu", Phase::Forward),
        "a backward origin names its forward op"
    );
    assert!(rec.skipped && rec.found_inf);
}

#[test]
fn training_loop_follows_the_scaler_simulator() {
    let overflow: BTreeSet<u64> = [2, 3, 7].into_iter().collect();
    let mut t = trainer(|c| {
        c.scaler.init_scale = Some(1024.0);
        c.scaler.growth_interval = Some(2);
    });
    for &s in &overflow {
        t.inject(Injection {
            step: Some(s),
            op: "linear".into(),
            module: "fc2".into(),
            phase: Phase::Backward,
            value: f32::INFINITY,
        });
    }
    let cfg = t.scaler().config().clone();
    let sim = simulate(&cfg, &overflow, 10).unwrap();
    for s in sim {
        let r = t.step(s.step).unwrap();
        assert_eq!(r.scale_before, s.scale_before as f64, "step {}", s.step);
        assert_eq!(r.scale_after, s.scale_after as f64, "step {}", s.step);
        assert_eq!(r.skipped, s.skipped, "step {}", s.step);
        assert_eq!(r.found_inf, s.found_inf, "step {}", s.step);
        assert_eq!(r.growth_tracker, s.growth_tracker as i64, "step {}", s.step);
    }
}

#[test]
fn skipped_step_leaves_parameters_unchanged() {
    let mut t = trainer(|_| {});
    let before: Vec<Vec<f64>> = t
        .params()
        .params
        .iter()
        .map(|p| p.value.to_f64_vec().unwrap())
        .collect();
    t.inject(Injection {
        step: Some(0),
        op: "linear".into(),
        module: "fc2".into(),
        phase: Phase::Backward,
        value: f32::NAN,
    });
    let r = t.step(0).unwrap();
    assert!(r.skipped);
    assert_eq!(r.scale_after, r.scale_before * 0.5);
    let after: Vec<Vec<f64>> = t
        .params()
        .params
        .iter()
        .map(|p| p.value.to_f64_vec().unwrap())
        .collect();
    assert_eq!(before, after);
}

/// Accumulating two micro-batches of the same batch (loss / 2 each) gives the gradient of
/// one batch, unscaled once.
#[test]
fn accumulation_matches_a_single_batch() {
    let mut one = trainer(|c| c.train.precision = Some("fp32".into()));
    let mut two = trainer(|c| {
        c.train.precision = Some("fp32".into());
        c.train.accumulate = Some(2);
    });
    let r1 = one.step(0).unwrap();
    let r2 = two.step(0).unwrap();
    assert_eq!(r2.micro_batches, 2);
    assert!((r1.loss.unwrap() - r2.loss.unwrap()).abs() < 1e-6);
    for (a, b) in one.last_grads().iter().zip(two.last_grads()) {
        let (a, b) = (
            a.as_ref().unwrap().to_f64_vec().unwrap(),
            b.as_ref().unwrap().to_f64_vec().unwrap(),
        );
        let m = a.iter().fold(0f64, |x, y| x.max(y.abs()));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * m, "{x} vs {y}");
        }
    }
}

/// Clipping happens on unscaled gradients: the clipped total norm is the max norm,
/// whatever the loss scale.
#[test]
fn clipping_after_unscale() {
    for scale in [1.0f32, 65536.0] {
        let mut t = trainer(|c| {
            c.train.precision = Some("fp32".into());
            c.train.clip = Some(0.05);
            c.scaler.init_scale = Some(scale);
        });
        let r = t.step(0).unwrap();
        let norm = r.grad_norm.unwrap();
        assert!(norm > 0.05, "the seed gradient norm exceeds the clip");
        let clipped: f64 = t
            .last_grads()
            .iter()
            .flatten()
            .map(|g| g.to_f64_vec().unwrap().iter().map(|x| x * x).sum::<f64>())
            .sum::<f64>()
            .sqrt();
        assert!(
            (clipped - 0.05).abs() < 1e-5,
            "scale {scale}: clipped norm {clipped}"
        );
        assert!((r.clip_coef.unwrap() - 0.05 / (norm + 1e-6)).abs() < 1e-6);
    }
}

#[test]
fn every_precision_mode_runs_and_puts_ops_in_its_dtypes() {
    use amprobe::DType;
    for p in Precision::ALL {
        let mut t = trainer(|c| c.train.precision = Some(p.name().into()));
        let r = t.step(0).unwrap();
        assert!(r.loss.unwrap().is_finite(), "{p}");
        let ops = r.ops.unwrap();
        let fc1 = ops
            .iter()
            .find(|o| o.op == "linear" && o.module == "fc1" && o.phase == Phase::Forward)
            .unwrap();
        let want = match p {
            Precision::Fp32 => DType::F32,
            _ => p.low_dtype().unwrap(),
        };
        assert_eq!(fc1.output.dtype, want, "{p}: fc1 output");
        for pr in &r.params {
            assert_eq!(pr.dtype, p.param_dtype(), "{p}: {} storage", pr.name);
            assert_eq!(
                pr.grad_dtype,
                Some(p.param_dtype()),
                "{p}: {} gradient dtype",
                pr.name
            );
        }
        // Autocast and O2 cast each fp32 parameter once per forward.
        let expected_casts = if p.autocast_dtype().is_some() || p.o2_dtype().is_some() {
            4
        } else {
            0
        };
        assert_eq!(r.weight_casts, expected_casts, "{p}: weight casts");
    }
}

#[test]
fn disabled_probes_change_nothing_but_the_records() {
    let mut on = trainer(|_| {});
    let mut off = trainer(|c| c.probe.enabled = Some(false));
    let (a, b) = (on.step(0).unwrap(), off.step(0).unwrap());
    assert_eq!(a.loss, b.loss);
    assert!(a.ops.is_some() && b.ops.is_none());
    for (x, y) in on.params().params.iter().zip(&off.params().params) {
        assert_eq!(x.value.to_f64_vec().unwrap(), y.value.to_f64_vec().unwrap());
    }
}

/// Re-running the last step under another recipe starts from the same weights, scale and
/// batch, and leaves the trainer alone.
#[test]
fn replay_reruns_the_same_step() {
    use amprobe::train::Variant;
    let mut t = trainer(|_| {});
    let r = t.step(0).unwrap();
    let same = t.replay(&Variant::default()).unwrap();
    assert_eq!(
        same.record.loss, r.loss,
        "the same recipe gives the same step"
    );
    assert_eq!(same.record.scale_before, r.scale_before);
    let fp32 = t
        .replay(&Variant {
            precision: Some(Precision::Fp32),
            ..Variant::default()
        })
        .unwrap();
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("tests/golden/seed_mlp/expected.json").unwrap(),
    )
    .unwrap();
    assert_eq!(
        fp32.record.loss.unwrap(),
        golden["modes"]["fp32"]["loss"].as_f64().unwrap()
    );
    assert_eq!(fp32.outputs.len(), 1);
    // The trainer's own next step is unaffected by the replays.
    let r1 = t.step(1).unwrap();
    assert!(r1.loss.unwrap() < r.loss.unwrap());
}

/// The live channel carries the same records as a trace: the header, every step, the end.
#[test]
fn live_channel_carries_header_steps_and_end() {
    use amprobe::runner::{run, RunOptions};
    use amprobe::trace::record::Record;
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.steps = Some(3);
    let (tx, rx) = std::sync::mpsc::channel();
    let summary = run(
        &cfg,
        &RunOptions {
            live: Some(tx),
            ..RunOptions::default()
        },
    )
    .unwrap();
    let recs: Vec<Record> = rx.try_iter().collect();
    assert!(matches!(recs.first(), Some(Record::Header(_))));
    assert_eq!(
        recs.iter().filter(|r| matches!(r, Record::Step(_))).count(),
        3
    );
    match recs.last() {
        Some(Record::End(e)) => {
            assert_eq!((e.steps, e.verdict.as_str()), (3, summary.verdict.as_str()))
        }
        _ => panic!("the last record is the end"),
    }
}

#[test]
fn header_and_summary_name_the_backend_that_ran() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.steps = Some(1);
    cfg.train.backend = Some("cpu".into());
    let summary = amprobe::runner::run(
        &cfg,
        &amprobe::runner::RunOptions {
            live: Some(tx),
            ..Default::default()
        },
    )
    .unwrap();
    let Some(amprobe::trace::Record::Header(h)) = rx.try_iter().next() else {
        panic!("the first record is the header");
    };
    assert_eq!((h.backend.as_str(), h.device.as_deref()), ("cpu", None));
    let json = serde_json::to_value(&summary).unwrap();
    assert_eq!(json["backend"], "cpu");
    assert_eq!(json["precision"], summary.precision.name());
    assert!(json.get("device").is_none(), "{json}");
}

#[test]
fn a_trainer_on_the_cuda_backend_opens_the_device_or_says_why_not() {
    let cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    let mut train = cfg.train_config().unwrap();
    let (model, params, data) = build(&cfg, &train).unwrap();
    train.backend = amprobe::backend::BackendKind::Cuda;
    let made = Trainer::new(train, model, params, data);
    match amprobe::device::detect() {
        amprobe::device::Detection::Unavailable { .. } => {
            let err = made.err().expect("refused without a GPU");
            assert!(err.to_string().contains("no usable GPU"), "{err}");
        }
        amprobe::device::Detection::Available(_) => {
            let t = made.expect("a device trainer");
            assert!(t.params().params.iter().all(|p| p.value.device().is_some()));
        }
    }
}

#[test]
fn an_overflowing_inverse_scale_is_told_once() {
    let mut cfg = RunConfig::load(Path::new("samples/mlp.toml")).unwrap();
    cfg.train.steps = Some(3);
    cfg.train.precision = Some("fp16".into());
    cfg.scaler.kind = Some("fixed".into());
    cfg.scaler.init_scale = Some(2f32.powi(-130));
    let summary = amprobe::runner::run(&cfg, &Default::default()).unwrap();
    let told: Vec<&String> = summary
        .events
        .iter()
        .filter(|e| e.contains("1/scale overflows f32"))
        .collect();
    assert_eq!(told.len(), 1, "{:#?}", summary.events);
    assert!(told[0].starts_with("step 0: scale collapse: "), "{told:?}");
}

/// Pure fp16 with a loss scaler unscales fp16 gradients, which PyTorch refuses: the run
/// says so once, in the step where it first happens, not again in every later step.
#[test]
fn a_scaler_warning_is_told_once() {
    let mut t = trainer(|c| c.train.precision = Some("half".into()));
    let events: Vec<Vec<String>> = (0..3).map(|s| t.step(s).unwrap().events).collect();
    let told = |e: &Vec<String>| e.iter().any(|w| w.contains("unscaling float16 gradients"));
    assert!(told(&events[0]), "{:?}", events[0]);
    assert!(!told(&events[1]) && !told(&events[2]), "{events:?}");
}
