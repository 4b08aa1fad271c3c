//! Remedies and precision bisection on the T5 fixture: each remedy's verdict and accuracy
//! are checked against independent runs made from scratch with the remedy's own flags.

use amprobe::config::RunConfig;
use amprobe::diagnose::remedy::{RemedyKind, RemedyMode, RemedyReport};
use amprobe::diagnose::DiagnoseOptions;
use amprobe::engine::module_matches;
use amprobe::runner::{build, run, RunOptions};
use amprobe::train::{StepOutput, Trainer};
use std::path::Path;

fn cfg(edit: impl FnOnce(&mut RunConfig)) -> RunConfig {
    let mut c = RunConfig::load(Path::new("samples/t5_overflow.toml")).unwrap();
    edit(&mut c);
    c
}

fn report(c: &RunConfig, mode: RemedyMode) -> RemedyReport {
    let opts = RunOptions {
        diagnose: DiagnoseOptions {
            remedies: mode,
            stop_at_failure: true,
            ..DiagnoseOptions::default()
        },
        ..RunOptions::default()
    };
    let s = run(c, &opts).unwrap();
    assert_eq!(s.steps.len(), 1, "the run stops at the failing step");
    s.remedies.expect("remedies at the failing step")
}

/// Step 0 of a fresh run: (skipped, loss finite, outputs).
fn fresh_step(c: &RunConfig) -> (bool, bool, Vec<StepOutput>) {
    let train = c.train_config().unwrap();
    let (m, p, d) = build(c, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    let rec = t.step(0).unwrap();
    let forward_origin = [&rec.origins.first_inf, &rec.origins.first_nan]
        .into_iter()
        .flatten()
        .any(|o| o.phase == amprobe::trace::record::Phase::Forward);
    (
        rec.skipped || forward_origin,
        rec.loss.unwrap().is_finite(),
        t.last_outputs().to_vec(),
    )
}

/// The documented accuracy measures, recomputed in f64 from two runs' outputs.
fn errors(got: &[StepOutput], fp32: &[StepOutput]) -> (f64, f64) {
    let mut le = 0f64;
    let mut he = 0f64;
    for (g, r) in got.iter().zip(fp32) {
        le = le.max((g.loss - r.loss).abs() / r.loss.abs());
        let (a, b) = (
            g.hidden.to_f64_vec().unwrap(),
            r.hidden.to_f64_vec().unwrap(),
        );
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let n = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
        he = he.max(d / n);
    }
    (le, he)
}

#[test]
fn remedies_on_the_fixture_under_fp16_autocast() {
    let base = cfg(|_| {});
    let r = report(&base, RemedyMode::All);
    assert_eq!(r.step, 0);
    assert_eq!(r.failure, "forward-overflow");
    assert!(r.reference_finite);
    let fp32 = cfg(|c| c.train.precision = Some("fp32".into()));
    let (_, _, ref_out) = fresh_step(&fp32);
    assert_eq!(r.reference_loss, Some(ref_out[0].loss));
    let get = |kind, flags: &[&str]| {
        r.remedies
            .iter()
            .find(|m| m.kind == kind && m.flags == flags)
            .unwrap_or_else(|| panic!("no {kind:?} {flags:?} in {:#?}", r.remedies))
    };
    // bf16 autocast and keeping `wo` in fp32 make the step finite; the clamp does not (the
    // residual stream is fp32 under autocast, and transformers clamps only fp16 states).
    let bf16 = get(RemedyKind::Bf16, &["--precision", "bf16"]);
    let wo = get(RemedyKind::KeepFp32, &["--keep-fp32", "wo"]);
    let clamp = get(RemedyKind::Clamp, &["--t5-clamp"]);
    assert!(bf16.finite && wo.finite && !clamp.finite);
    assert_eq!(
        clamp.first_nonfinite.as_ref().map(|o| o.module.as_str()),
        Some("encoder.block.3.layer.1.DenseReluDense.wo")
    );
    assert!(!r.remedies.iter().any(|m| m.kind == RemedyKind::LowerScale));
    // Each verdict and accuracy equals a fresh run with the remedy's flags.
    for (m, edit) in [
        (
            bf16,
            Box::new(|c: &mut RunConfig| c.train.precision = Some("bf16".into()))
                as Box<dyn Fn(&mut RunConfig)>,
        ),
        (
            wo,
            Box::new(|c: &mut RunConfig| c.train.keep_fp32 = Some(vec!["wo".into()])),
        ),
        (
            clamp,
            Box::new(|c: &mut RunConfig| c.model.t5_clamp = Some(true)),
        ),
    ] {
        let (failed, _, out) = fresh_step(&cfg(edit));
        assert_eq!(!failed, m.finite, "{}", m.remedy);
        if m.finite {
            let (le, he) = errors(&out, &ref_out);
            assert_eq!(m.loss_rel_err, Some(le), "{}", m.remedy);
            assert_eq!(m.hidden_rel_err, Some(he), "{}", m.remedy);
            // Small, and not zero: the low precision is still there.
            assert!(le > 0.0 && le < 1e-2, "{}: {le}", m.remedy);
            assert!(he > 0.0 && he < 1e-2, "{}: {he}", m.remedy);
        } else {
            assert_eq!(m.loss_rel_err, None);
        }
    }
    // The suggestion is a remedy that works.
    assert!(r.best().unwrap().finite);
    // Re-runs: bf16, clamp, and the bisection's (the fp32 reference came with the cause).
    let b = r.bisection.as_ref().unwrap();
    assert_eq!(r.replays, 2 + b.replays);
}

#[test]
fn bisection_under_fp16_autocast_rediscovers_wo() {
    let base = cfg(|_| {});
    let r = report(&base, RemedyMode::BisectOnly);
    let b = r.bisection.as_ref().unwrap();
    assert!(b.found && b.minimal && !b.coarse);
    assert!(!b.modules.is_empty());
    for m in &b.modules {
        assert!(m.ends_with("DenseReluDense.wo"), "{m}");
    }
    // Only block 3's wo leaves the fp16 range under autocast.
    assert_eq!(b.modules, vec!["encoder.block.3.layer.1.DenseReluDense.wo"]);
    assert_eq!(b.pattern.as_deref(), Some("wo"));
    assert_eq!(b.pattern_finite, Some(true));
    assert_eq!(b.keep_fp32, vec!["wo"]);
    assert_eq!(b.flags(), "--keep-fp32 wo");
    assert_eq!(b.toml(), "[train]\nkeep_fp32 = [\"wo\"]\n");
    assert!(
        b.replays >= 3 && b.replays <= 2 * b.candidates as u32,
        "{}",
        b.replays
    );
    // A fresh run with the answer is finite, and with the exact set too.
    let (failed, loss_ok, _) = fresh_step(&cfg(|c| c.train.keep_fp32 = Some(b.keep_fp32.clone())));
    assert!(!failed && loss_ok);
    let (failed, _, _) = fresh_step(&cfg(|c| c.train.keep_fp32 = Some(b.modules.clone())));
    assert!(!failed);
    // Only bisection remedies in this mode.
    assert!(r.remedies.iter().all(|m| m.kind == RemedyKind::KeepFp32));
}

#[test]
fn bisection_under_pure_fp16_makes_the_step_finite() {
    let base = cfg(|c| c.train.precision = Some("half".into()));
    let r = report(&base, RemedyMode::BisectOnly);
    let b = r.bisection.as_ref().unwrap();
    assert!(b.found, "{b:?}");
    // The answer, applied from scratch, makes step 0 finite.
    let (failed, loss_ok, _) = fresh_step(&cfg(|c| {
        c.train.precision = Some("half".into());
        c.train.keep_fp32 = Some(b.keep_fp32.clone());
    }));
    assert!(!failed && loss_ok, "{:?}", b.keep_fp32);
    // 1-minimal: dropping any one module of the exact set fails again.
    if b.minimal {
        for drop in &b.modules {
            let keep: Vec<String> = b.modules.iter().filter(|m| *m != drop).cloned().collect();
            let (failed, _, _) = fresh_step(&cfg(|c| {
                c.train.precision = Some("half".into());
                c.train.keep_fp32 = Some(keep.clone());
            }));
            assert!(failed, "without {drop} the step is still finite");
        }
    }
    // Both wo modules that overflow in pure fp16 are in it.
    for blk in [2, 3] {
        let wo = format!("encoder.block.{blk}.layer.1.DenseReluDense.wo");
        assert!(
            b.keep_fp32.iter().any(|p| module_matches(p, &wo)),
            "{wo} not kept: {:?}",
            b.keep_fp32
        );
    }
}

#[test]
fn scale_too_high_remedy_is_the_safe_scale() {
    let c = cfg(|c| {
        c.train.keep_fp32 = Some(vec!["wo".into()]);
        c.scaler.init_scale = Some(1_099_511_627_776.0);
    });
    let r = report(&c, RemedyMode::All);
    assert_eq!(r.failure, "scale-too-high");
    let lower = r
        .remedies
        .iter()
        .find(|m| m.kind == RemedyKind::LowerScale)
        .unwrap();
    assert!(lower.finite);
    let s: f32 = lower.flags[1].parse().unwrap();
    assert_eq!(lower.flags[0], "--init-scale");
    // No bisection or clamp for a scale problem.
    assert!(r.bisection.is_none());
    assert!(!r.remedies.iter().any(|m| m.kind == RemedyKind::Clamp));
    let (failed, _, _) = fresh_step(&cfg(|x| {
        x.train.keep_fp32 = Some(vec!["wo".into()]);
        x.scaler.init_scale = Some(s);
    }));
    assert!(!failed);
}
