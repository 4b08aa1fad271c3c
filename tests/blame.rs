//! Blame for precision loss, held to answers known in closed form: every forward op is
//! recomputed in f64 from its own inputs (the error it introduces) and from the all-f64
//! shadow of the run (the error it inherits), and their ratio to the inputs' error is the
//! op's condition number where one is defined; every backward op likewise, from its own
//! output gradient and from that gradient's shadow; the optimizer phase's ops by their
//! formulas in f64.

use amprobe::engine::observer::{Blame, Observer, OpEvent};
use amprobe::engine::Engine;
use amprobe::tensor::Tensor;
use amprobe::DType;
use std::sync::{Arc, Mutex};

/// Every blamed op: its name (a backward op's as `op grad input`) and blame, in order.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, Blame)>>>);

impl Observer for Seen {
    fn on_op(&mut self, ev: &OpEvent<'_>) {
        if let Some(b) = ev.blame {
            let name = match ev.wrt {
                Some(w) => format!("{} grad {w}", ev.op),
                None => ev.op.to_string(),
            };
            self.0.lock().unwrap().push((name, b));
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

/// Step 0 of sample `name` run with `--blame`, its config edited by `edit`.
fn blamed_step(
    name: &str,
    edit: impl FnOnce(&mut amprobe::config::RunConfig),
) -> amprobe::trace::record::StepRecord {
    use amprobe::runner::{run, RunOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = format!("samples/{name}.toml");
    let mut cfg = amprobe::config::RunConfig::load(std::path::Path::new(&path)).unwrap();
    cfg.train.steps = Some(1);
    cfg.probe.blame = Some(true);
    let trace = dir.path().join("t.jsonl");
    cfg.probe.trace = Some(trace.clone());
    edit(&mut cfg);
    run(&cfg, &RunOptions::default()).unwrap();
    let mut t = amprobe::trace::read_trace(&trace).unwrap();
    t.steps.swap_remove(0)
}

/// Step 0 of the T5 sample with `--blame`, its config edited by `edit`.
fn blamed_t5_step(
    edit: impl FnOnce(&mut amprobe::config::RunConfig),
) -> amprobe::trace::record::StepRecord {
    blamed_step("t5_overflow", edit)
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
    // Every op of the kept step is blamed, the optimizer phase's too.
    use amprobe::trace::record::Phase;
    for o in ops {
        assert!(o.blame.is_some(), "{} {:?}", o.op, o.phase);
    }
    assert!(ops.iter().any(|o| o.phase == Phase::Optimizer));
    // The backward of `wo`: its weight's gradient is a bf16 product of bf16 operands.
    let wo_index = ops[wo].index;
    let dw = ops
        .iter()
        .find(|o| o.forward_op == Some(wo_index) && o.wrt.as_deref() == Some("weight"))
        .and_then(|o| o.blame)
        .unwrap();
    assert!(
        dw.introduced > 1e-4 && dw.introduced < 2f64.powi(-7),
        "{dw:?}"
    );
    // Its output gradient comes from a backward that ran in bf16 too: it carries error in.
    assert!(dw.input > 1e-4 && dw.inherited > 1e-4, "{dw:?}");
}

/// A leaf parameter of `v` (f32, requiring a gradient).
fn param(v: Vec<f32>) -> Tensor {
    f32s(v).as_leaf(true)
}

/// A one-element fp16 tensor of `shape` holding `v` rounded.
fn fp16(v: f32, shape: &[usize]) -> Tensor {
    Tensor::from_f32(vec![v], shape, DType::F16).unwrap()
}

#[test]
fn a_gradient_that_underflows_fp16_is_introduced_where_it_flushes_and_a_loss_scale_keeps_it() {
    // y = sum(x16 · 10⁻⁴) with an output gradient of 10⁻⁴: the input's gradient is 10⁻⁸,
    // below half of fp16's smallest subnormal (2⁻²⁴ ≈ 6·10⁻⁸), so it flushes to 0.
    let run = |seed: f32| {
        let (mut e, seen) = engine();
        let w = param(vec![1.0; 8]);
        let x = e.to_dtype(&w, DType::F16).unwrap();
        let c = e.to_dtype(&f32s(vec![1e-4; 8]), DType::F16).unwrap();
        let y = e.mul(&x, &c).unwrap();
        let s = e.sum(&y, &[], false).unwrap();
        e.backward_with(&s, fp16(seed, &[])).unwrap();
        let ops = seen.0.lock().unwrap().clone();
        ops
    };
    let ops = run(1e-4);
    let names: Vec<&str> = ops.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "to",
            "to",
            "mul",
            "sum",
            "sum grad self",
            "mul grad self",
            "to grad input"
        ]
    );
    // The sum's gradient is the output gradient, broadcast: exact.
    let dsum = ops[4].1;
    assert_eq!((dsum.introduced, dsum.total), (0.0, 0.0), "{dsum:?}");
    // The product flushes every value: all of the gradient is lost there.
    let dmul = ops[5].1;
    assert_eq!(dmul.introduced, 1.0, "{dmul:?}");
    assert_eq!(dmul.total, 1.0, "{dmul:?}");
    // Its own inputs and their shadows differ only by the cast of 10⁻⁴ to fp16.
    let c16 = f64::from(half::f16::from_f32(1e-4).to_f32());
    let c32 = f64::from(1e-4f32);
    assert!(
        close(dmul.inherited, (c16 - c32).abs() / c32, 1e-9),
        "{dmul:?}"
    );
    // The cast back to f32 adds nothing and passes the loss on.
    let dcast = ops[6].1;
    assert_eq!(dcast.introduced, 0.0, "{dcast:?}");
    assert_eq!(dcast.inherited, 1.0, "{dcast:?}");
    // Scaled by 2¹⁶ the gradient is a normal fp16 number: it rounds by half a spacing at most.
    let ops = run(65536.0 * 1e-4);
    let dmul = ops[5].1;
    assert!(
        dmul.introduced > 0.0 && dmul.introduced <= 2f64.powi(-11),
        "{dmul:?}"
    );
}

#[test]
fn a_gradient_summed_over_many_uses_in_fp16_loses_the_small_ones_at_each_accumulation() {
    // x16 used 200 times with weight 0.01 and, last, once with weight 100: the backward
    // gives it 100 first, then 0.01 at a time, each rounded away in fp16 (spacing 0.0625
    // at 100), as the forward long sum does.
    let (mut e, seen) = engine();
    let w = param(vec![1.0]);
    let x = e.to_dtype(&w, DType::F16).unwrap();
    let k = 200;
    let mut acc = e.mul_scalar(&x, 0.01).unwrap();
    for _ in 1..k {
        let t = e.mul_scalar(&x, 0.01).unwrap();
        acc = e.add(&acc, &t).unwrap();
    }
    let big = e.mul_scalar(&x, 100.0).unwrap();
    let root = e.add(&acc, &big).unwrap();
    seen.0.lock().unwrap().clear();
    e.backward_with(&root, fp16(1.0, &[1])).unwrap();
    let ops = seen.0.lock().unwrap().clone();
    let acc: Vec<Blame> = ops
        .iter()
        .filter(|(n, _)| n == "accumulate_grad")
        .map(|(_, b)| *b)
        .collect();
    assert_eq!(acc.len(), k);
    let dv = f64::from(half::f16::from_f32(0.01).to_f32());
    for (i, b) in acc.iter().enumerate() {
        // Its own inputs are 100 and dv: the exact sum 100 + dv, the output 100.
        assert!(close(b.introduced, dv / (100.0 + dv), 1e-9), "{i}: {b:?}");
        // The shadow holds 100 + (i + 1)·0.01 (the shadow's weight is 0.01 itself).
        let shadow = 100.0 + (i as f64 + 1.0) * 0.01;
        assert!(
            close(b.total, (shadow - 100.0) / shadow, 1e-9),
            "{i}: {b:?}"
        );
    }
    // The gradient of weight 100 (the first) is exact; each of weight 0.01 rounds 0.01 to
    // fp16: what it introduces.
    let muls: Vec<Blame> = ops
        .iter()
        .filter(|(n, _)| n == "mul grad input")
        .map(|(_, b)| *b)
        .collect();
    assert_eq!(muls.len(), k + 1);
    assert_eq!(muls[0].total, 0.0, "{:?}", muls[0]);
    for small in &muls[1..] {
        assert!(
            close(small.introduced, (dv - 0.01).abs() / 0.01, 1e-9),
            "{small:?}"
        );
    }
    // The cast back to f32 inherits the whole loss.
    let (last, cast) = (&ops[ops.len() - 1], acc[k - 1]);
    assert_eq!(last.0, "to grad input");
    assert_eq!(last.1.introduced, 0.0);
    assert!(close(last.1.inherited, cast.total, 1e-12), "{last:?}");
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
        out.contains("Blame (every op of step 0 against f64): most error introduced"),
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

/// Step 0 of the MLP sample (fp16) with `--blame`, its config edited by `edit`.
fn blamed_mlp_step(
    edit: impl FnOnce(&mut amprobe::config::RunConfig),
) -> amprobe::trace::record::StepRecord {
    blamed_step("mlp", edit)
}

#[test]
fn unscaling_and_clipping_carry_each_gradients_error_and_add_only_their_own_rounding() {
    use amprobe::trace::record::{OpBlame, OpRecord, Phase};
    // A max norm of 0.01, below the gradients' norm, so that clipping scales every gradient
    // (and so rounds: asserted below).
    let step = blamed_mlp_step(|c| c.train.clip = Some(0.01));
    let ops = step.ops.unwrap();
    let of = |op: &str| -> Vec<&OpRecord> {
        ops.iter()
            .filter(|o| o.phase == Phase::Optimizer && o.op == op)
            .collect()
    };
    let (unscale, clip) = (of("unscale"), of("clip_grad_norm"));
    // Four parameters: two weights, two biases.
    assert_eq!((unscale.len(), clip.len()), (4, 4));
    let b = |o: &OpRecord| -> OpBlame { o.blame.unwrap_or_else(|| panic!("{} unblamed", o.op)) };
    for (u, c) in unscale.iter().zip(&clip) {
        assert_eq!(u.module, c.module);
        // Dividing by the scale, a power of two, is exact: nothing introduced, and the
        // gradient's error against f64 is what the backward left in it.
        let (bu, bc) = (b(u), b(c));
        assert_eq!(bu.introduced, 0.0, "{}: {bu:?}", u.module);
        assert!(close(bu.total, bu.input, 1e-12), "{}: {bu:?}", u.module);
        assert!(bu.total > 0.0, "{}: {bu:?}", u.module);
        // Clipping multiplies by one f32 coefficient: at most f32's rounding of it and of
        // the product, both about 6·10⁻⁸, is its own.
        assert!(
            bc.introduced > 0.0 && bc.introduced < 2e-7,
            "{}: {bc:?}",
            c.module
        );
        assert!(close(bc.input, bu.total, 1e-12), "{}: {bc:?}", c.module);
    }
    // The weights' gradients are products of fp16 operands rounded to fp16, their error
    // of fp16's order; so is the biases'.
    for u in &unscale {
        assert!(b(u).total < 1e-2, "{}: {:?}", u.module, b(u));
    }
    // The norm over every gradient (its coefficient) is off by about their error too: the
    // coefficient's error reaches every gradient, so clipping inherits about as much as
    // it receives.
    let worst_in = clip.iter().map(|c| b(c).input).fold(0.0, f64::max);
    for c in &clip {
        assert!(b(c).inherited <= 2.0 * worst_in, "{}: {:?}", c.module, b(c));
    }
}

#[test]
fn an_update_below_half_the_parameters_spacing_is_lost_and_the_optimizer_step_introduces_it() {
    use amprobe::trace::record::Phase;
    // SGD: the change is −lr·g. At lr 0.01 it is far above f32's spacing of the weights
    // (about 0.1); at lr 10⁻⁹ it is below half of it, and p − lr·g rounds back to p.
    let steps = |lr: f64| -> Vec<OpBlame> {
        let step = blamed_mlp_step(|c| c.train.lr = Some(lr));
        let ops = step.ops.unwrap();
        let b: Vec<OpBlame> = ops
            .iter()
            .filter(|o| o.phase == Phase::Optimizer && o.op == "optimizer_step")
            .map(|o| o.blame.unwrap())
            .collect();
        assert_eq!(b.len(), 4);
        b
    };
    use amprobe::trace::record::OpBlame;
    for b in steps(0.01) {
        // Only the rounding of the new value to f32, against a change of about 10⁻⁴.
        assert!(b.introduced > 0.0 && b.introduced < 1e-4, "{b:?}");
        // The change is linear in the gradient: it inherits the gradient's error as it is.
        assert!(close(b.inherited, b.input, 1e-9), "{b:?}");
    }
    for b in steps(1e-9) {
        // Every change (or all but a few) is lost.
        assert!(b.introduced > 0.99, "{b:?}");
        assert!(b.total > 0.99, "{b:?}");
    }
    // The summary says what such a figure means.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "samples/mlp.toml", "--blame", "--lr", "1e-9"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("lost its update"), "{out}");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "samples/mlp.toml", "--blame"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("Blame (") && !out.contains("lost its update"),
        "{out}"
    );
}

#[test]
fn a_gradient_that_reads_its_ops_output_reads_it_as_the_run_saved_it() {
    // exp's gradient g·y reads y = exp(x) as the run saved it, rounded to fp16. With g = 1
    // the product is exact: the backward introduces nothing, and y's rounding (and x's)
    // comes in with y, inherited.
    let (mut e, seen) = engine();
    let w = param(vec![0.3, 1.7, -2.2, 4.1]);
    let x = e.to_dtype(&w, DType::F16).unwrap();
    let y = e.exp(&x).unwrap();
    let ones = Tensor::from_f32(vec![1.0; 4], &[4], DType::F16).unwrap();
    e.backward_with(&y, ones).unwrap();
    let ops = seen.0.lock().unwrap().clone();
    let names: Vec<&str> = ops.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["to", "exp", "exp grad input", "to grad input"]);
    let (exp, dexp) = (ops[1].1, ops[2].1);
    assert!(exp.introduced > 0.0, "{exp:?}");
    assert_eq!(dexp.introduced, 0.0, "{dexp:?}");
    assert!(close(dexp.inherited, exp.total, 1e-12), "{dexp:?} {exp:?}");
}
