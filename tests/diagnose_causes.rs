//! Skip causes and the collapse flag: a scale set too high on healthy models names the op
//! and a safe scale that really stops the skips; the T5 fixture under fp16 autocast is a
//! forward overflow; a NaN that happens in every recipe is divergence.

use amprobe::config::RunConfig;
use amprobe::diagnose::cause::{safe_pow2_scale, SkipKind};
use amprobe::diagnose::collapse::CollapseReason;
use amprobe::diagnose::DiagnoseOptions;
use amprobe::engine::Injection;
use amprobe::runner::{run, RunOptions, RunSummary};
use amprobe::trace::record::{Phase, Record, StepRecord};
use std::path::Path;

fn config(path: &str, edit: impl FnOnce(&mut RunConfig)) -> RunConfig {
    let mut cfg = RunConfig::load(Path::new(path)).unwrap();
    edit(&mut cfg);
    cfg
}

fn run_with(cfg: &RunConfig, opts: RunOptions) -> RunSummary {
    run(cfg, &opts).unwrap()
}

const TWO_40: f32 = 1_099_511_627_776.0;

/// The largest |∂L/∂logit| of a mean cross-entropy over N positions is at most 1/N
/// (softmax minus one-hot, divided by N).
fn check_scale_too_high(cfg: &RunConfig, positions: f64) {
    let s = run_with(cfg, RunOptions::default());
    assert!(!s.steps.is_empty());
    let mut safe = None;
    for st in &s.steps {
        assert!(st.skipped, "step {} at scale {}", st.step, st.scale_before);
        let c = st.skip_cause.as_ref().expect("a skipped step has a cause");
        assert_eq!(c.kind, SkipKind::ScaleTooHigh, "{c:?}");
        assert_eq!(c.scale, st.scale_before);
        let op = c.op.as_ref().expect("the overflowing op is named");
        assert_eq!(op.phase, Phase::Backward);
        // The first op to overflow is the gradient of the logits' cast in the loss.
        assert_eq!((op.op.as_str(), op.module.as_str()), ("to", "loss"));
        let fwd = c.forward_op.as_ref().expect("its forward op is named");
        assert_eq!(fwd.phase, Phase::Forward);
        assert_eq!(Some(fwd.op_index), op.forward_op);
        assert_eq!(fwd.module, "loss");
        let m = c.unscaled_max_abs.expect("pre-scale max |g|");
        assert!(m > 0.5 / positions && m <= 1.0 / positions, "max |g| {m}");
        // The op's own safe scale: m·s < 65504 ≤ m·2s, s a power of two.
        let os = c.op_safe_scale.unwrap();
        assert_eq!(os.log2().fract(), 0.0);
        assert!(m * os < 65504.0 && m * 2.0 * os >= 65504.0, "{m} · {os}");
        assert_eq!(Some(os), safe_pow2_scale(m, 65504.0));
        let step_safe = c.safe_scale.expect("a step-wide safe scale");
        assert!(step_safe <= os && step_safe >= 1.0);
        assert!(c.limiting_op.is_some());
        safe = Some(step_safe);
    }
    // Re-running from the start with the safe scale does not skip.
    let safe = safe.unwrap();
    let mut again = cfg.clone();
    again.scaler.init_scale = Some(safe as f32);
    let s2 = run_with(&again, RunOptions::default());
    assert!(
        s2.steps.iter().all(|st| !st.skipped),
        "at the safe scale {safe}: {:?}",
        s2.steps.iter().map(|s| s.skipped).collect::<Vec<_>>()
    );
    // And it is the largest power of two that is safe: twice it skips.
    let mut twice = cfg.clone();
    twice.train.steps = Some(1);
    twice.scaler.init_scale = Some(2.0 * safe as f32);
    assert!(run_with(&twice, RunOptions::default()).steps[0].skipped);
}

#[test]
fn absurd_scale_on_healthy_t5_is_scale_too_high() {
    let cfg = config("samples/t5_overflow.toml", |c| {
        c.train.keep_fp32 = Some(vec!["wo".into()]);
        c.train.steps = Some(2);
        c.scaler.init_scale = Some(TWO_40);
    });
    // The fixture's batch is 2 × 8 tokens.
    check_scale_too_high(&cfg, 16.0);
}

#[test]
fn absurd_scale_on_the_mlp_is_scale_too_high() {
    let cfg = config("samples/mlp.toml", |c| {
        c.train.steps = Some(2);
        c.scaler.init_scale = Some(1e30);
    });
    check_scale_too_high(&cfg, 16.0);
}

#[test]
fn fixture_under_fp16_autocast_is_forward_overflow() {
    let cfg = config("samples/t5_overflow.toml", |_| {});
    let s = run_with(&cfg, RunOptions::default());
    assert_eq!(s.steps.len(), 3);
    for st in &s.steps {
        let c = st.skip_cause.as_ref().unwrap();
        assert_eq!(c.kind, SkipKind::ForwardOverflow);
        let op = c.op.as_ref().unwrap();
        assert_eq!(op.phase, Phase::Forward);
        assert_eq!(op.module, "encoder.block.3.layer.1.DenseReluDense.wo");
        assert_eq!(op.op, "linear");
        assert_eq!(c.dtype, Some(amprobe::DType::F16));
        // One re-run each: the fp32 check for divergence.
        assert_eq!(c.replays, 1);
    }
    assert_eq!(s.diagnosis_replays, 3);
    // With probes off the step has no op records: one more re-run recovers them.
    let mut quiet = cfg.clone();
    quiet.probe.enabled = Some(false);
    quiet.train.steps = Some(1);
    let s = run_with(&quiet, RunOptions::default());
    let c = s.steps[0].skip_cause.as_ref().unwrap();
    assert_eq!(c.kind, SkipKind::ForwardOverflow);
    assert_eq!(
        c.op.as_ref().map(|o| o.module.as_str()),
        Some("encoder.block.3.layer.1.DenseReluDense.wo")
    );
    assert_eq!(c.replays, 2);
    // The classification limit leaves later skips unclassified, and says so.
    let s = run_with(
        &cfg,
        RunOptions {
            diagnose: DiagnoseOptions {
                classify_limit: 1,
                ..DiagnoseOptions::default()
            },
            ..RunOptions::default()
        },
    );
    assert!(s.steps[0].skip_cause.is_some());
    assert!(s.steps[1].skip_cause.is_none() && s.steps[2].skip_cause.is_none());
    assert_eq!(s.unclassified_skips, 2);
}

#[test]
fn injected_nan_in_every_recipe_is_divergence() {
    let cfg = config("samples/mlp.toml", |c| {
        c.train.steps = Some(2);
    });
    let opts = RunOptions {
        injections: vec![Injection {
            step: None,
            op: "relu".into(),
            module: "relu".into(),
            phase: Phase::Forward,
            value: f32::NAN,
        }],
        diagnose: DiagnoseOptions {
            remedies: amprobe::diagnose::remedy::RemedyMode::All,
            ..DiagnoseOptions::default()
        },
        ..RunOptions::default()
    };
    let s = run_with(&cfg, opts);
    for st in &s.steps {
        assert!(st.skipped);
        let c = st.skip_cause.as_ref().unwrap();
        assert_eq!(c.kind, SkipKind::Divergence, "{c:?}");
        let op = c.op.as_ref().unwrap();
        assert_eq!((op.op.as_str(), op.module.as_str()), ("relu", "relu"));
        assert_eq!(op.phase, Phase::Forward);
        assert_eq!(
            c.dtype,
            Some(amprobe::DType::F32),
            "found in the fp32 re-run"
        );
    }
    let r = s.remedies.as_ref().unwrap();
    assert!(!r.reference_finite);
    assert!(r.remedies.is_empty());
    assert!(r.note.as_ref().unwrap().contains("fp32 too"));
}

/// A gradient too large for fp16 at any scale: an injected 10^6 in the ReLU's backward
/// output (finite in f32) makes fc1's weight gradient overflow fp16 even at scale 1, while
/// the fp32 step stays finite.
#[test]
fn gradient_too_large_even_unscaled_is_backward_overflow() {
    let cfg = config("samples/mlp.toml", |c| {
        c.train.steps = Some(1);
    });
    let opts = RunOptions {
        injections: vec![Injection {
            step: None,
            op: "relu".into(),
            module: "relu".into(),
            phase: Phase::Backward,
            value: 1e6,
        }],
        ..RunOptions::default()
    };
    let s = run_with(&cfg, opts);
    let st = &s.steps[0];
    assert!(st.skipped);
    let c = st.skip_cause.as_ref().unwrap();
    assert_eq!(c.kind, SkipKind::BackwardOverflow, "{c:?}");
    let op = c.op.as_ref().unwrap();
    assert_eq!(op.phase, Phase::Backward);
    assert_eq!(op.module, "fc1");
    assert_eq!(c.dtype, Some(amprobe::DType::F16));
    // It overflowed at scale 1 too: no pre-scale value, no safe scale.
    assert_eq!((c.unscaled_max_abs, c.safe_scale), (None, None));
    // fp32 check and scale-1 re-run.
    assert_eq!(c.replays, 2);
}

#[test]
fn mlp_module_names_for_the_injection() {
    // The divergence test injects into `relu` in `relu`: make sure that op exists.
    let cfg = config("samples/mlp.toml", |_| {});
    let train = cfg.train_config().unwrap();
    let (m, p, d) = amprobe::runner::build(&cfg, &train).unwrap();
    let mut t = amprobe::train::Trainer::new(train, m, p, d).unwrap();
    let rec = t.step(0).unwrap();
    let ops = rec.ops.unwrap();
    assert!(ops
        .iter()
        .any(|o| o.op == "relu" && o.module == "relu" && o.phase == Phase::Forward));
}

#[test]
fn scale_collapse_is_flagged_as_field_and_event() {
    let cfg = config("samples/t5_overflow.toml", |c| {
        c.train.steps = Some(9);
    });
    let s = run_with(
        &cfg,
        RunOptions {
            diagnose: DiagnoseOptions {
                classify_limit: 0,
                ..DiagnoseOptions::default()
            },
            ..RunOptions::default()
        },
    );
    let f = s.scale_collapse.as_ref().expect("collapse flagged");
    assert_eq!(f.reason, CollapseReason::Falling);
    assert_eq!(f.step, 7);
    assert_eq!(f.falling_steps, 8);
    assert_eq!((f.scale_from, f.scale_to), (65536.0, 256.0));
    assert!(
        s.events
            .iter()
            .any(|e| e.starts_with("step 7: loss scale collapsing")),
        "{:?}",
        s.events
    );
    // K is configurable, and a scale below 1 is flagged at once.
    let cfg = config("samples/t5_overflow.toml", |c| {
        c.train.steps = Some(3);
        c.scaler.init_scale = Some(2.0);
    });
    let s = run_with(
        &cfg,
        RunOptions {
            diagnose: DiagnoseOptions {
                collapse_steps: 3,
                ..DiagnoseOptions::default()
            },
            ..RunOptions::default()
        },
    );
    let f = s.scale_collapse.as_ref().unwrap();
    assert_eq!((f.step, f.reason), (1, CollapseReason::BelowOne));
    assert!(s
        .events
        .iter()
        .any(|e| e.contains("collapsing: it fell on 3")));
}

#[test]
fn skip_cause_is_in_the_trace_and_old_traces_load() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let cfg = config("samples/t5_overflow.toml", |c| {
        c.train.steps = Some(1);
        c.probe.trace = Some(trace.clone());
    });
    run_with(&cfg, RunOptions::default());
    let t = amprobe::trace::read_trace(&trace).unwrap();
    let step = t.steps.first().unwrap();
    assert_eq!(
        step.skip_cause.as_ref().map(|c| c.kind),
        Some(SkipKind::ForwardOverflow)
    );
    // A step record written before the field existed reads back with no cause.
    let mut v = serde_json::to_value(Record::Step(StepRecord::default())).unwrap();
    v.as_object_mut().unwrap().remove("skip_cause");
    let Record::Step(old) = serde_json::from_value(v).unwrap() else {
        panic!("not a step");
    };
    assert_eq!(old.skip_cause, None);
}
