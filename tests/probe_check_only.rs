//! A step whose op records the sampling does not keep by schedule only checks its forward
//! and backward outputs for non-finite values; a step that then keeps them for a
//! non-finite value completes their statistics from a re-run. Every record, origin and
//! parameter must be the same, bit for bit, as with full statistics in every step.

use amprobe::config::RunConfig;
use amprobe::engine::Injection;
use amprobe::runner::build;
use amprobe::trace::record::{Phase, StepRecord};
use amprobe::train::Trainer;
use std::path::Path;

mod report_util;
use report_util::inject;

fn trainer(sample: &str, edit: &dyn Fn(&mut RunConfig), full: bool) -> Trainer {
    let mut cfg = RunConfig::load(Path::new(sample)).unwrap();
    edit(&mut cfg);
    let mut train = cfg.train_config().unwrap();
    // No ops kept by schedule: every step but those with a non-finite value is checked only.
    train.sampling.first = false;
    let (m, p, d) = build(&cfg, &train).unwrap();
    let mut t = Trainer::new(train, m, p, d).unwrap();
    t.set_full_statistics(full);
    t
}

/// The record as JSON, without the step's wall time (the one field that may differ).
fn comparable(r: &StepRecord) -> serde_json::Value {
    let mut v = serde_json::to_value(r).unwrap();
    v.as_object_mut().unwrap().remove("wall_ms");
    v
}

/// What a step of the checked trainer did with its forward and backward ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Only checked them, and kept no records.
    Checked,
    /// Checked them, then kept records completed from a re-run.
    Completed,
    /// Computed their full statistics at once.
    Full,
}

/// Runs `steps` steps of `sample` (edited) with injections, once with full statistics in
/// every step and once with checks only where allowed, compares every record and the
/// final parameters, and returns what the checked run did in each step.
fn same_records(
    sample: &str,
    edit: &dyn Fn(&mut RunConfig),
    injections: &[Injection],
    steps: u64,
) -> Vec<Seen> {
    let mut full = trainer(sample, edit, true);
    let mut checked = trainer(sample, edit, false);
    for inj in injections {
        full.inject(inj.clone());
        checked.inject(inj.clone());
    }
    let mut seen = Vec::new();
    for s in 0..steps {
        let a = full.step(s).unwrap();
        let b = checked.step(s).unwrap();
        assert_eq!(full.checked_values(), 0);
        assert_eq!(comparable(&a), comparable(&b), "{sample}: step {s}");
        seen.push(match (checked.checked_values() > 0, b.ops.is_some()) {
            (true, false) => Seen::Checked,
            (true, true) => Seen::Completed,
            (false, _) => Seen::Full,
        });
        if let Some(ops) = &b.ops {
            // Completed statistics are whole: the histogram of every nonzero finite value.
            for o in ops {
                let s = &o.stats;
                let nonzero_finite = s.numel - s.nan - s.pos_inf - s.neg_inf - s.zeros;
                let hist: u64 = s.exp_hist.iter().map(|(_, c)| c).sum();
                assert_eq!(hist, nonzero_finite, "{sample}: step {s:?} {}", o.op);
            }
        }
    }
    for (x, y) in full.params().params.iter().zip(&checked.params().params) {
        let bits = |t: &amprobe::tensor::Tensor| {
            t.to_f64_vec()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&x.value), bits(&y.value), "{sample}: {}", x.name);
    }
    seen
}

#[test]
fn the_seed_mlp_with_forward_and_backward_faults_and_micro_batches() {
    use Seen::*;
    let edit = |c: &mut RunConfig| {
        c.train.accumulate = Some(2);
        c.train.clip = Some(1.0);
        c.train.optimizer = Some("adamw".into());
    };
    let faults = [
        inject(2, "linear", "fc1", Phase::Forward, f32::INFINITY),
        inject(3, "relu", "relu", Phase::Backward, f32::NAN),
        inject(6, "linear", "fc2", Phase::Forward, f32::NEG_INFINITY),
    ];
    let seen = same_records("samples/mlp.toml", &edit, &faults, 8);
    // A step after one kept for a non-finite value has full statistics at once (3, 4, 7).
    assert_eq!(
        seen,
        [Checked, Checked, Completed, Full, Full, Checked, Completed, Full]
    );
}

/// An inverse scale that overflows makes the first non-finite values in the optimizer
/// phase, after the forward and backward ops were only checked.
#[test]
fn a_step_kept_for_an_optimizer_phase_value_completes_the_ops_before_it() {
    let edit = |c: &mut RunConfig| {
        c.scaler.kind = Some("fixed".into());
        c.scaler.init_scale = Some(2f32.powi(-130));
        c.train.optimizer = Some("adam".into());
    };
    let seen = same_records("samples/mlp.toml", &edit, &[], 3);
    assert_eq!(seen, [Seen::Completed, Seen::Full, Seen::Full]);
}

/// T5 in fp16 overflows at the FFN output by itself, in every step: only the first is
/// checked and completed.
#[test]
fn t5_overflowing_in_fp16() {
    let seen = same_records("samples/t5_overflow.toml", &|_| {}, &[], 4);
    assert_eq!(seen, [Seen::Completed, Seen::Full, Seen::Full, Seen::Full]);
}

/// BERT's additive attention mask makes -inf in fp16 that are the mask's, not an origin.
#[test]
fn bert_with_its_attention_mask_in_fp16_and_bf16() {
    for p in ["fp16", "bf16"] {
        let edit = |c: &mut RunConfig| c.train.precision = Some(p.into());
        let module = "bert.encoder.layer.0.attention.self";
        let faults = [inject(1, "softmax", module, Phase::Forward, f32::NAN)];
        let seen = same_records("samples/bert_overflow.toml", &edit, &faults, 3);
        // fp16 overflows in step 0 by itself.
        let want = match p {
            "fp16" => [Seen::Completed, Seen::Full, Seen::Full],
            _ => [Seen::Checked, Seen::Completed, Seen::Full],
        };
        assert_eq!(seen, want, "{p}");
    }
}

/// Tells, for every op, whether it said its output was all finite and whether it was.
struct Witness(std::sync::Arc<std::sync::Mutex<Vec<(String, bool, bool)>>>);

impl amprobe::engine::observer::Observer for Witness {
    fn on_op(&mut self, ev: &amprobe::engine::observer::OpEvent<'_>) {
        let truth = ev
            .output
            .to_f64_vec()
            .unwrap()
            .iter()
            .all(|x| x.is_finite());
        let name = format!("{:?} {} {}", ev.phase, ev.op, ev.module);
        self.0.lock().unwrap().push((name, ev.finite, truth));
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// An op that says its output is all finite (which spares the probe reading it) is right,
/// in steps that overflow, with faults injected, in every precision mode; ops say so only
/// in a step that only checks its outputs.
#[test]
fn an_output_said_to_be_finite_is_finite() {
    let runs: [(&str, &str, Vec<Injection>); 5] = [
        ("samples/t5_overflow.toml", "fp16", vec![]),
        ("samples/t5_overflow.toml", "bf16", vec![]),
        ("samples/t5_overflow.toml", "fp32", vec![]),
        (
            "samples/bert_overflow.toml",
            "bf16",
            vec![inject(
                1,
                "linear",
                "cls.predictions.decoder",
                Phase::Forward,
                f32::NAN,
            )],
        ),
        (
            "samples/mlp.toml",
            "fp16",
            vec![
                inject(1, "linear", "fc1", Phase::Forward, f32::INFINITY),
                inject(2, "relu", "relu", Phase::Backward, -f32::INFINITY),
            ],
        ),
    ];
    for (sample, precision, faults) in runs {
        let edit = |c: &mut RunConfig| c.train.precision = Some(precision.into());
        let mut t = trainer(sample, &edit, false);
        for f in faults {
            t.inject(f);
        }
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        t.add_observer(Box::new(Witness(seen.clone())));
        let mut said = 0;
        for s in 0..4 {
            let checked_only = {
                t.step(s).unwrap();
                t.checked_values() > 0
            };
            let ops = std::mem::take(&mut *seen.lock().unwrap());
            for (op, finite, truth) in &ops {
                assert!(!finite || *truth, "{sample} {precision} step {s}: {op}");
            }
            let n = ops.iter().filter(|o| o.1).count();
            assert!(checked_only || n == 0, "{sample} {precision} step {s}");
            said += n;
        }
        assert!(said > 0, "{sample} {precision}: no op said so");
    }
}

/// The other model families, in fp16 (where their samples overflow) and bf16, GPT-2 with a
/// NaN written into its logits.
#[test]
fn gpt2_llama_and_t5_seq2seq() {
    for sample in [
        "samples/gpt2_overflow.toml",
        "samples/llama_overflow.toml",
        "samples/t5_seq2seq.toml",
    ] {
        for p in ["fp16", "bf16"] {
            let edit = |c: &mut RunConfig| c.train.precision = Some(p.into());
            let faults = match sample {
                "samples/gpt2_overflow.toml" => {
                    vec![inject(1, "linear", "lm_head", Phase::Forward, f32::NAN)]
                }
                _ => vec![],
            };
            let seen = same_records(sample, &edit, &faults, 3);
            use Seen::*;
            let want = match (p, faults.is_empty()) {
                ("fp16", _) => [Completed, Full, Full],
                (_, false) => [Checked, Completed, Full],
                (_, true) => [Checked, Checked, Checked],
            };
            assert_eq!(seen, want, "{sample} {p}");
        }
    }
}
