//! Blame for precision loss, held to answers known in closed form: every forward op is
//! recomputed in f64 from its own inputs (the error it introduces) and from the all-f64
//! shadow of the run (the error it inherits), and their ratio to the inputs' error is the
//! op's condition number where one is defined.

use amprobe::engine::observer::{Blame, Observer, OpEvent};
use amprobe::engine::Engine;
use amprobe::tensor::Tensor;
use amprobe::DType;
use std::sync::{Arc, Mutex};

/// Every blamed op: its name and blame, in order.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, Blame)>>>);

impl Observer for Seen {
    fn on_op(&mut self, ev: &OpEvent<'_>) {
        if let Some(b) = ev.blame {
            self.0.lock().unwrap().push((ev.op.to_string(), b));
        }
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

fn engine() -> (Engine, Seen) {
    let mut e = Engine::new();
    let seen = Seen::default();
    e.add_observer(Box::new(seen.clone()));
    e.set_blame(true);
    (e, seen)
}

fn f32s(v: Vec<f32>) -> Tensor {
    let n = v.len();
    Tensor::from_f32(v, &[n], DType::F32).unwrap()
}

/// Step 0 of the T5 sample run with `--blame`, its config edited by `edit`.
fn blamed_t5_step(
    edit: impl FnOnce(&mut amprobe::config::RunConfig),
) -> amprobe::trace::record::StepRecord {
    use amprobe::runner::{run, RunOptions};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg =
        amprobe::config::RunConfig::load(std::path::Path::new("samples/t5_overflow.toml")).unwrap();
    cfg.train.steps = Some(1);
    cfg.probe.blame = Some(true);
    let trace = dir.path().join("t.jsonl");
    cfg.probe.trace = Some(trace.clone());
    edit(&mut cfg);
    run(&cfg, &RunOptions::default()).unwrap();
    let mut t = amprobe::trace::read_trace(&trace).unwrap();
    t.steps.swap_remove(0)
}

trait Amplification {
    fn amplification_estimate(&self) -> f64;
}

impl Amplification for Blame {
    fn amplification_estimate(&self) -> f64 {
        self.inherited / self.input
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn a_variance_by_cancellation_in_fp16_is_introduced_by_its_squares_and_amplified_by_the_subtraction(
) {
    // E[x²] − E[x]² of values 100 ± 0.5: both terms near 10⁴, where fp16's spacing is 8.
    let (mut e, seen) = engine();
    let x32 = f32s((0..1024).map(|i| 100.0 + 0.5 * (i as f32).sin()).collect());
    let x = e.to_dtype(&x32, DType::F16).unwrap();
    let sq = e.mul(&x, &x).unwrap();
    let m2 = e.mean(&sq, &[], false).unwrap();
    let m = e.mean(&x, &[], false).unwrap();
    let msq = e.mul(&m, &m).unwrap();
    let var = e.sub(&m2, &msq).unwrap();
    let twice = e.mul_scalar(&var, 2.0).unwrap();
    let _ = twice;
    let ops = seen.0.lock().unwrap().clone();
    let names: Vec<&str> = ops.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["to", "mul", "mean", "mean", "mul", "sub", "mul"]);
    let b = |i: usize| ops[i].1;
    // The cast and the squares of x round (the square of the mean, 100² = 10⁴, is
    // exact in fp16): each introduces at most fp16's half-spacing.
    for i in [0, 1] {
        assert!(b(i).introduced > 0.0, "{i}: {:?}", b(i));
    }
    for i in 0..5 {
        assert!(b(i).introduced <= 2f64.powi(-11), "{i}: {:?}", b(i));
    }
    // Two fp16 values within a factor 2 subtract exactly (Sterbenz): the subtraction
    // introduces nothing, and magnifies its inputs' 10⁻⁴ into an error of the order of
    // the variance itself.
    let sub = b(5);
    assert_eq!(sub.introduced, 0.0, "{sub:?}");
    assert!(sub.inherited > 0.5, "{sub:?}");
    assert!(sub.input < 1e-3, "{sub:?}");
    assert!(sub.inherited / sub.input > 1e3, "{sub:?}");
    // Downstream, times two (exact): all inherited.
    let down = b(6);
    assert_eq!(down.introduced, 0.0);
    assert!(close(down.inherited, sub.total, 1e-12), "{down:?} {sub:?}");
}

#[test]
fn exp_magnifies_its_inputs_error_by_its_condition_number_and_a_shifted_softmax_does_not() {
    // Softmax scores of 8.3 each, rounded to fp16: exp's condition number at x is |x|.
    let (mut e, seen) = engine();
    let s32 = f32s(vec![8.3; 16]);
    let s = e.to_dtype(&s32, DType::F16).unwrap();
    let ex = e.exp(&s).unwrap();
    let sum = e.sum(&ex, &[], true).unwrap();
    let _p = e.div(&ex, &sum).unwrap();
    // Shifted by the maximum first, as a stable softmax is.
    let mx = e.max(&s, 0, true).unwrap();
    let z = e.sub(&s, &mx).unwrap();
    let ez = e.exp(&z).unwrap();
    // x² and 1/√x: condition numbers 2 and 1/2 (the same relative error everywhere, so the
    // norm-wise ratio is the pointwise one).
    let _ = e.pow(&s, 2.0).unwrap();
    let _ = e.rsqrt(&s).unwrap();
    let ops = seen.0.lock().unwrap().clone();
    let names: Vec<&str> = ops.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["to", "exp", "sum", "div", "max", "sub", "exp", "pow", "rsqrt"]
    );
    let amp = |i: usize| ops[i].1.amplification_estimate();
    assert!(close(amp(7), 2.0, 0.01), "{:?}", ops[7]);
    assert!(close(amp(8), 0.5, 0.01), "{:?}", ops[8]);
    let cast = ops[0].1;
    assert!(cast.introduced > 0.0);
    let exp = ops[1].1;
    assert!(close(exp.input, cast.total, 1e-12));
    // |x| = 8.3 (to first order: the cast's error is 10⁻⁴).
    assert!(close(exp.amplification_estimate(), 8.3, 0.01), "{exp:?}");
    // The shifted scores are exactly 0 in both the run and its shadow: exp(0) = 1, no
    // error in or out.
    let (zb, ezb) = (ops[5].1, ops[6].1);
    assert_eq!((zb.total, ezb.total, ezb.input), (0.0, 0.0, 0.0));
    let _ = ez;
}

#[test]
fn a_long_fp16_sum_introduces_at_each_add_and_the_next_op_inherits_all() {
    // 100 + 0.01 + 0.01 + ... in fp16: 0.01 is below half of fp16's spacing at 100
    // (0.0625), so every add rounds back to 100.
    let (mut e, seen) = engine();
    let one = |v: f32, e: &mut Engine| {
        let t = Tensor::from_f32(vec![v], &[1], DType::F32).unwrap();
        e.to_dtype(&t, DType::F16).unwrap()
    };
    let mut acc = one(100.0, &mut e);
    let d = one(0.01, &mut e);
    let k = 200;
    for _ in 0..k {
        acc = e.add(&acc, &d).unwrap();
    }
    let _ = e.mul_scalar(&acc, 0.5).unwrap();
    let ops = seen.0.lock().unwrap().clone();
    assert_eq!(ops.len(), 2 + k + 1);
    let dv = f64::from(half::f16::from_f32(0.01).to_f32());
    // (the shadow adds the 0.01 that was cast, in f64)
    let d32 = f64::from(0.01f32);
    let adds = &ops[2..2 + k];
    for (i, (name, b)) in adds.iter().enumerate() {
        assert_eq!(name, "add");
        // Its own inputs are 100 and d: the exact sum 100 + d, the output 100.
        assert!(close(b.introduced, dv / (100.0 + dv), 1e-9), "{i}: {b:?}");
        // The shadow holds 100 + (i + 1)·0.01.
        let shadow = 100.0 + (i as f64 + 1.0) * d32;
        assert!(
            close(b.total, (shadow - 100.0) / shadow, 1e-9),
            "{i}: {b:?}"
        );
    }
    let last = adds[k - 1].1;
    assert!(last.inherited > 100.0 * last.introduced);
    let (name, half) = &ops[2 + k];
    assert_eq!(name, "mul");
    assert_eq!(half.introduced, 0.0);
    assert!(close(half.inherited, last.total, 1e-12));
}

#[test]
fn t5s_wo_introduces_its_error_and_the_residual_stream_inherits_it() {
    // The T5 sample's block 3 `wo` writes the planted channel (|x| about 1.2·10⁵) in bf16.
    let t = blamed_t5_step(|c| c.train.precision = Some("bf16".into()));
    let ops = t.ops.as_ref().unwrap();
    let at = |op: &str, module: &str| {
        ops.iter()
            .position(|o| o.op == op && o.module == module)
            .unwrap_or_else(|| panic!("no `{op}` in `{module}`"))
    };
    let wo = at("linear", "encoder.block.3.layer.1.DenseReluDense.wo");
    let b = |i: usize| {
        ops[i]
            .blame
            .unwrap_or_else(|| panic!("{} unblamed", ops[i].op))
    };
    // bf16 rounding of a product: about 2⁻⁹ relative.
    assert!(
        b(wo).introduced > 1e-4 && b(wo).introduced < 2f64.powi(-7),
        "{:?}",
        b(wo)
    );
    // The residual add after it runs in fp32: what its output is off by, it inherits.
    let add = (wo..ops.len())
        .find(|&i| ops[i].op == "add" && ops[i].module == "encoder.block.3.layer.1")
        .unwrap();
    assert!(b(add).introduced < 1e-6, "{:?}", b(add));
    assert!(b(add).inherited > 1e-4, "{:?}", b(add));
    // Every forward op of the kept step is blamed, none of the others.
    use amprobe::trace::record::Phase;
    for o in ops {
        assert_eq!(
            o.blame.is_some(),
            o.phase == Phase::Forward,
            "{} {:?}",
            o.op,
            o.phase
        );
    }
}

#[test]
fn run_blame_prints_the_top_offenders_and_refuses_what_it_cannot_blame() {
    use std::process::Command;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("s.json");
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "samples/mlp.toml", "--blame", "--summary-json"])
        .arg(&json)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("Blame (forward ops of step 0 against f64): most error introduced"),
        "{out}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let top = s["blame"]["introduced"].as_array().unwrap();
    assert!(!top.is_empty() && top.len() <= 5);
    // Largest first.
    let figs: Vec<f64> = top.iter().map(|h| h["figure"].as_f64().unwrap()).collect();
    assert!(figs.windows(2).all(|w| w[0] >= w[1]), "{figs:?}");
    // Without --blame the summary has no blame.
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "samples/mlp.toml", "--summary-json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(s.get("blame").is_none());
    // A script trains itself: --blame is one of the flags it cannot take.
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "--blame", "--", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

#[test]
fn a_report_of_a_blamed_run_has_its_section_and_chart() {
    use amprobe::config::RunConfig;
    use amprobe::report::{write_report, ReportOptions, TraceFile};
    use amprobe::runner::{run, RunOptions};
    let dir = tempfile::tempdir().unwrap();
    for blame in [true, false] {
        let mut cfg = RunConfig::load(std::path::Path::new("samples/mlp.toml")).unwrap();
        cfg.probe.blame = Some(blame);
        let trace = dir.path().join(format!("t{blame}.jsonl"));
        cfg.probe.trace = Some(trace.clone());
        run(&cfg, &RunOptions::default()).unwrap();
        let out_dir = dir.path().join(format!("rep{blame}"));
        let out = write_report(
            &TraceFile::open(&trace).unwrap(),
            &ReportOptions {
                out_dir: out_dir.clone(),
                ..ReportOptions::default()
            },
        )
        .unwrap();
        let md = std::fs::read_to_string(&out.summary_md).unwrap();
        assert_eq!(md.contains("## Blame"), blame, "{md}");
        assert_eq!(md.contains("### Most error introduced"), blame, "{md}");
        assert_eq!(out_dir.join("blame.png").exists(), blame);
        assert_eq!(out_dir.join("blame.svg").exists(), blame);
        if blame {
            // The top offender of the summary's table is the run's: fc1's or fc2's casts
            // and products.
            let table = md.split("### Most error introduced").nth(1).unwrap();
            let first = table.lines().find(|l| l.starts_with("| `")).unwrap();
            assert!(
                first.contains("`fc1`") || first.contains("`fc2`"),
                "{first}"
            );
        }
    }
}

#[test]
fn compare_names_the_op_that_introduced_most_before_the_first_divergence() {
    use std::process::Command;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin = env!("CARGO_BIN_EXE_amprobe");
    let cfg = std::path::absolute("samples/t5_overflow.toml").unwrap();
    let o = Command::new(bin)
        .current_dir(d)
        .args(["run"])
        .arg(&cfg)
        .args(["--precision", "bf16,fp32", "--blame", "--steps", "1"])
        .args(["--trace", "c.jsonl"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A threshold low enough for bf16's rounding to count: the first divergence is forward.
    let o = Command::new(bin)
        .current_dir(d)
        .args([
            "compare",
            "c-bf16.jsonl",
            "c-fp32.jsonl",
            "--threshold",
            "0.003",
        ])
        .args(["--out", "cmp"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}");
    let first = out
        .lines()
        .find(|l| l.contains("first divergence at step 0 forward op #"))
        .unwrap();
    let idx: u64 = first
        .split("forward op #")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let blame = out
        .lines()
        .find(|l| l.starts_with("  blame: that op introduces"))
        .unwrap();
    // The op of step 0, up to the divergence, that introduced the most.
    let t = amprobe::trace::read_trace(d.join("c-bf16.jsonl")).unwrap();
    let worst = t.steps[0]
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .filter(|o| o.index <= idx)
        .filter_map(|o| o.blame.map(|b| (o, b.introduced)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap()
        .0;
    assert!(
        blame.contains(&format!(
            "the most was introduced by `{}` in `{}` (op #{},",
            worst.op, worst.module, worst.index
        )),
        "{blame}"
    );
}

#[test]
fn t5s_wo_close_to_fp16s_overflow_introduces_its_error_and_downstream_inherits_it() {
    // The T5 sample with block 3's `wo` weight halved: its fp16 output peaks near 6·10⁴,
    // close to fp16's 65504 but finite.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("t5");
    std::fs::create_dir_all(&ckpt).unwrap();
    let src = std::path::Path::new("samples/t5_overflow_small");
    std::fs::copy(src.join("config.json"), ckpt.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let wo = "encoder.block.3.layer.1.DenseReluDense.wo.weight";
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{n}");
            let k = if n == wo { 0.5f32 } else { 1.0 };
            let b = v
                .data()
                .chunks_exact(4)
                .flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) * k).to_le_bytes())
                .collect();
            (n, v.shape().to_vec(), b)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), v.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &ckpt.join("model.safetensors")).unwrap();

    let t = blamed_t5_step(|c| c.model.hf = Some(ckpt));
    assert!(t.origins.first_inf.is_none(), "no overflow any more");
    let ops = t.ops.as_ref().unwrap();
    let i = ops
        .iter()
        .position(|o| o.op == "linear" && o.module == "encoder.block.3.layer.1.DenseReluDense.wo")
        .unwrap();
    let wo = &ops[i];
    assert_eq!(wo.output.dtype, DType::F16);
    assert!(
        wo.stats.max_abs > 32752.0 && wo.stats.max_abs < 65504.0,
        "{}",
        wo.stats.max_abs
    );
    // The product's rounding to fp16 (half a spacing, 2⁻¹¹ relative, at most).
    let b = wo.blame.unwrap();
    assert!(
        b.introduced > 0.0 && b.introduced <= 2f64.powi(-11),
        "{b:?}"
    );
    // Downstream in fp32 — the residual add, then the final RMS norm's square and mean —
    // they introduce nothing near it and inherit what it wrote.
    let after: Vec<_> = ops[i + 1..]
        .iter()
        .filter(|o| o.phase == amprobe::trace::record::Phase::Forward)
        .filter(|o| {
            (o.op == "add" && o.module == "encoder.block.3.layer.1")
                || (o.module == "encoder.final_layer_norm"
                    && ["pow", "mean"].contains(&o.op.as_str()))
        })
        .collect();
    assert_eq!(after.len(), 3, "{after:?}");
    for o in after {
        let d = o.blame.unwrap();
        assert!(d.introduced < 1e-3 * b.introduced, "{} {d:?}", o.op);
        assert!(d.inherited > 0.1 * b.introduced, "{} {d:?}", o.op);
    }
}
