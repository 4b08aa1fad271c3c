//! `amprobe compare`: an fp16 run with an overflow is named a range failure at the
//! overflowing op; bf16 against fp32 differs by rounding only; the per-precision table, the
//! overlays and the diff chart say what the traces say.

mod report_util;

use amprobe::report::compare::{compare, write_compare, Class, CompareOptions};
use amprobe::report::TraceFile;
use amprobe::trace::read_trace;
use amprobe::trace::record::Phase;
use report_util::{inject, mlp_trace, Svg};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Runs {
    _dir: tempfile::TempDir,
    root: PathBuf,
    fp16_inf: PathBuf,
    bf16: PathBuf,
    fp32: PathBuf,
}

/// Three runs of the seed MLP, 3 steps each, op records kept every step; the fp16 run gets
/// an Inf in the output of the forward `linear` of `fc2` at step 1.
fn runs() -> Runs {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let every = |c: &mut amprobe::config::RunConfig| c.probe.sample_every = Some(1);
    let fp16_inf = mlp_trace(
        &root,
        "fp16",
        "fp16",
        3,
        vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        every,
    );
    let bf16 = mlp_trace(&root, "bf16", "bf16", 3, vec![], every);
    let fp32 = mlp_trace(&root, "fp32", "fp32", 3, vec![], every);
    Runs {
        _dir: dir,
        root,
        fp16_inf,
        bf16,
        fp32,
    }
}

fn open(p: &Path) -> TraceFile {
    TraceFile::open(p).unwrap()
}

#[test]
fn fp16_overflow_is_the_first_divergence_and_a_range_failure() {
    let r = runs();
    let traces = [open(&r.fp16_inf), open(&r.fp32)];
    let cmp = compare(&traces, 0.05, None).unwrap();
    assert_eq!(cmp.reference, 1, "the fp32 run is the reference");
    let d = &cmp.diffs[0];
    assert_eq!(d.steps_compared, [0, 1, 2]);
    let ops16 = read_trace(&r.fp16_inf).unwrap().steps[1]
        .ops
        .clone()
        .unwrap();
    let ops32 = read_trace(&r.fp32).unwrap().steps[1].ops.clone().unwrap();
    // Same graph but for the casts autocast adds, and the updates of the skipped step.
    let casts = ops16.iter().filter(|o| o.op == "to").count();
    let updates = ops32.iter().filter(|o| o.op == "optimizer_step").count();
    assert!(casts > 0 && updates == 4);
    assert!(
        !ops16.iter().any(|o| o.op == "optimizer_step"),
        "step 1 was skipped"
    );
    assert_eq!(ops16.len() - casts, ops32.len() - updates);
    assert_eq!((d.only_in_run, d.only_in_ref), (0, updates));
    let fc2 = |ops: &[amprobe::trace::OpRecord]| {
        ops.iter()
            .find(|o| o.op == "linear" && o.module == "fc2" && o.phase == Phase::Forward)
            .unwrap()
            .index
    };
    let first = d.first_divergence().expect("a divergence");
    assert_eq!(first.step, 1);
    assert_eq!(
        (first.op.as_str(), first.module.as_str()),
        ("linear", "fc2")
    );
    assert_eq!(first.phase, Phase::Forward);
    assert_eq!(first.run_index, fc2(&ops16));
    assert_eq!(first.ref_index, fc2(&ops32));
    assert_ne!(
        first.run_index, first.ref_index,
        "indices differ by the casts"
    );
    assert_eq!(first.class, Class::Range);
    assert!(!first.propagated, "the overflowing op is the origin");
    assert!(
        first
            .reason
            .contains("that the reference does not have (1 value)"),
        "{}",
        first.reason
    );
    // Everything after it in step 1 that holds Inf/NaN is a propagated range failure.
    let later: Vec<_> = d
        .ops
        .iter()
        .filter(|o| o.step == 1 && o.ref_index > first.ref_index && o.class == Class::Range)
        .collect();
    assert!(!later.is_empty() && later.iter().all(|o| o.propagated));
    // Before the overflow, fp16 stays within 5% of fp32 at every op, and is not identical.
    let before: Vec<_> = d
        .ops
        .iter()
        .filter(|o| (o.step, o.ref_index) < (1, first.ref_index))
        .collect();
    assert!(before.len() > 20);
    assert!(before.iter().all(|o| !o.diverged && o.rel() <= 0.05));
    assert!(before.iter().any(|o| o.rel() > 0.0));
}

#[test]
fn bf16_against_fp32_is_rounding_only() {
    let r = runs();
    let traces = [open(&r.bf16), open(&r.fp32)];
    // A tight threshold so that rounding differences count as divergences.
    let cmp = compare(&traces, 1e-3, None).unwrap();
    let d = &cmp.diffs[0];
    assert!(d.ops.len() > 50);
    let diverged: Vec<_> = d.ops.iter().filter(|o| o.diverged).collect();
    assert!(
        !diverged.is_empty(),
        "bf16 differs from fp32 by more than 0.1% somewhere"
    );
    assert!(diverged.iter().all(|o| o.class == Class::Rounding));
    assert_eq!(d.count(Class::Range), 0);
    assert!(d.ops.iter().all(|o| o.class == Class::Rounding));
    // Independently: the first divergence is the first op (reference order) whose max |x|
    // or L2 norm (scale divided out of backward values) differs by more than 0.1%.
    let b = read_trace(&r.bf16).unwrap();
    let f = read_trace(&r.fp32).unwrap();
    let first = d.first_divergence().unwrap();
    let step = &b.steps[first.step as usize];
    let op = step
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .find(|o| o.index == first.run_index)
        .unwrap();
    let fstep = &f.steps[first.step as usize];
    let fop = fstep
        .ops
        .as_ref()
        .unwrap()
        .iter()
        .find(|o| o.index == first.ref_index)
        .unwrap();
    let rel = |a: f64, r: f64| (a - r).abs() / r.abs();
    assert!(
        rel(op.stats.max_abs, fop.stats.max_abs) > 1e-3
            || rel(op.stats.sum_sq.sqrt(), fop.stats.sum_sq.sqrt()) > 1e-3
    );
    assert_eq!(
        (op.op.as_str(), op.module.as_str()),
        (fop.op.as_str(), fop.module.as_str())
    );
    // At the default threshold (5%) bf16 does not diverge at all on this model.
    let cmp = compare(&traces, 0.05, None).unwrap();
    assert!(cmp.diffs[0].first_divergence().is_none());
}

#[test]
fn backward_values_compare_with_the_scale_divided_out() {
    let dir = tempfile::tempdir().unwrap();
    let every = |c: &mut amprobe::config::RunConfig| c.probe.sample_every = Some(1);
    let a = mlp_trace(dir.path(), "a", "fp32", 1, vec![], |c| {
        every(c);
        c.scaler.init_scale = Some(1024.0);
    });
    let b = mlp_trace(dir.path(), "b", "fp32", 1, vec![], |c| {
        every(c);
        c.scaler.init_scale = Some(4.0);
    });
    // The same fp32 run under two power-of-two scales: scaled gradients differ by exactly
    // 256, so with the scale divided out every op matches exactly.
    let cmp = compare(&[open(&a), open(&b)], 0.0, Some(1)).unwrap();
    let d = &cmp.diffs[0];
    assert!(d.ops.iter().any(|o| o.phase == Phase::Backward));
    for o in &d.ops {
        assert_eq!(o.rel(), 0.0, "{}", o.describe());
    }
    assert!(d.first_divergence().is_none());
}

#[test]
fn compare_cli_writes_table_overlays_and_diff_chart() {
    let r = runs();
    let out = r.root.join("cmp");
    let stdout = compare_cli(&[&r.fp16_inf, &r.bf16, &r.fp32], &out);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("fp16 (fp16) vs fp32 (fp32): first divergence at step 1 forward op #")
            && lines[0].contains("`linear` in `fc2`: range failure (Inf/NaN in the float16 output"),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("bf16 (bf16) vs fp32 (fp32): no divergence above 5.0% in "),
        "{stdout}"
    );
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    // The per-precision table, with numbers from the traces.
    for (p, label) in [
        (&r.fp16_inf, "fp16 (fp16)"),
        (&r.bf16, "bf16 (bf16)"),
        (&r.fp32, "fp32 (fp32)"),
    ] {
        let t = read_trace(p).unwrap();
        let skipped = t.steps.iter().filter(|s| s.skipped).count();
        let row_start = format!(
            "| `{label}` | {} | 3 | {skipped} | {:.1}% | ",
            t.header.precision,
            skipped as f64 / 3.0 * 100.0
        );
        let row = md
            .lines()
            .find(|l| l.starts_with(&row_start))
            .unwrap_or_else(|| panic!("{row_start}\n{md}"));
        let mean = t.steps.iter().map(|s| s.wall_ms).sum::<f64>() / 3.0;
        assert!(row.contains(&format!("| {mean:.3} |")), "{row}");
    }
    assert!(md.contains("**range failure**"));
    // Overlays: one line per run.
    let loss = Svg::open(&out.join("loss_overlay.svg"));
    for l in ["fp16 (fp16)", "bf16 (bf16)", "fp32 (fp32)"] {
        assert!(loss.text_exact(l).is_some(), "{l}");
    }
    assert!(loss.text_exact("loss").is_some());
    assert!(loss
        .text_exact("fp16 (fp16): loss is Inf or NaN (drawn at the top edge)")
        .is_some());
    let scale = Svg::open(&out.join("scale_overlay.svg"));
    assert!(scale.text_exact("fp16 (fp16): skipped step").is_some());
    assert!(scale.text_exact("2^16").is_some() && scale.text_exact("2^15").is_some());
    // The diff chart: the fp16 run's first divergence named in the legend and drawn as a
    // dashed vertical line in the run's colour at that op's position.
    let diff = Svg::open(&out.join("op_diff.svg"));
    assert!(diff.has_text("Per-op difference from fp32 (fp32)"));
    assert!(diff
        .text_exact("relative difference from the reference (log)")
        .is_some());
    let legend = diff
        .texts()
        .into_iter()
        .find(|t| {
            t.content
                .starts_with("fp16 (fp16): first divergence, step 1 op #")
        })
        .expect("first divergence in the legend");
    assert!(
        legend.content.ends_with("linear in fc2 (range)"),
        "{}",
        legend.content
    );
    assert!(diff
        .text_exact("fp16 (fp16): range failure (Inf/NaN, overflow, underflow)")
        .is_some());
    assert!(
        !diff.has_text("bf16 (bf16): range failure"),
        "bf16 shows no range failure"
    );
    let blue = "#1F77B4";
    let vertical: Vec<f64> = diff
        .polylines(blue)
        .into_iter()
        .filter(|p| p.len() == 2 && p[0].0 == p[1].0 && p[0].1 != p[1].1)
        .map(|p| p[0].0)
        .collect();
    assert!(vertical.len() > 10);
    assert!(vertical.windows(2).all(|w| w[0] == w[1]), "one line");
    // Its x: the bf16 run matches every reference op, so its circles (orange, one per
    // aligned position, in order) give the x of each position.
    let bottom = diff
        .text_exact("aligned op (step:reference op index, in execution order)")
        .unwrap()
        .y;
    let mut orange: Vec<f64> = diff
        .circles("#E67800")
        .into_iter()
        .filter(|c| c.1 < bottom)
        .map(|c| c.0)
        .collect();
    orange.sort_by(f64::total_cmp);
    let cmp = compare(
        &[open(&r.fp16_inf), open(&r.bf16), open(&r.fp32)],
        0.05,
        None,
    )
    .unwrap();
    assert_eq!(
        orange.len(),
        cmp.diffs[1].ops.len(),
        "one bf16 point per aligned op"
    );
    let first = cmp.diffs[0].first_divergence().unwrap();
    let pos = cmp.diffs[1]
        .ops
        .iter()
        .filter(|o| (o.step, o.ref_index) < (first.step, first.ref_index))
        .count();
    assert!(
        (vertical[0] - orange[pos]).abs() <= 1.5,
        "{} vs {}",
        vertical[0],
        orange[pos]
    );
    let step1 = diff.text_exact("step 1").expect("step boundary label");
    assert!(vertical[0] > step1.x - 6.0, "the line lies in step 1");
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert_eq!(html.matches("data:image/png;base64,").count(), 3);
}

/// `amprobe compare TRACES --out OUT`: its stdout, after checking that it succeeded.
fn compare_cli(traces: &[&Path], out: &Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .arg("compare")
        .args(traces)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn a_run_compared_in_some_of_its_steps_says_which() {
    // The bf16 run kept op records for step 0 only (the default): it is compared there
    // alone, and the line and the chart say so.
    let r = runs();
    let bf16_first = mlp_trace(&r.root, "bf16-first", "bf16", 3, vec![], |_| {});
    let out = r.root.join("cmp-first");
    let stdout = compare_cli(&[&bf16_first, &r.fp32], &out);
    assert!(
        stdout.contains("(compared in step(s) 0 of 3 only: where both runs kept op records"),
        "{stdout}"
    );
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        md.contains("bf16 (bf16-first): step(s) 0 of 3 only"),
        "{md}"
    );
    // A run compared in every step says nothing of the kind.
    let all = compare_cli(&[&r.bf16, &r.fp32], &r.root.join("cmp-all"));
    assert!(!all.contains("compared in step(s)"), "{all}");
}

#[test]
fn compare_refuses_bad_inputs() {
    let r = runs();
    let e = compare(&[open(&r.fp16_inf), open(&r.bf16)], 0.05, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no fp32 run among the traces; name the reference with --reference N"),
        "{e}"
    );
    let e = compare(&[open(&r.fp16_inf)], 0.05, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs at least two traces"), "{e}");
    let e = compare(&[open(&r.bf16), open(&r.fp32)], -1.0, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--threshold -1"), "{e}");
    // With an explicit reference, fp16 against bf16 works.
    let out = write_compare(
        &[open(&r.fp16_inf), open(&r.bf16)],
        &CompareOptions {
            out_dir: r.root.join("c2"),
            threshold: 0.05,
            reference: Some(1),
        },
    )
    .unwrap();
    assert_eq!(out.comparison.reference, 1);
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .arg("compare")
        .arg(&r.fp32)
        .args(["--out", "never"])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "one trace is refused by the parser"
    );
}

/// `amprobe` with the working directory `dir`: exit code and stdout.
fn amprobe_in(dir: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("amprobe runs");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.code().is_some(), "killed: {err}");
    (
        o.status.code().unwrap(),
        String::from_utf8_lossy(&o.stdout).into_owned() + &err,
    )
}

/// The README's fp16-against-bf16 commands: with no fp32 trace, the fp32 reference is made
/// by re-running the recorded configuration, and each run's first divergence is named.
#[test]
fn fp16_against_bf16_makes_its_fp32_reference() {
    let d = tempfile::tempdir().unwrap();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/t5_overflow.toml");
    let sample = sample.to_str().unwrap();
    for p in ["fp16", "bf16"] {
        let trace = format!("{p}.jsonl");
        let (code, out) = amprobe_in(
            d.path(),
            &[
                "run",
                sample,
                "--precision",
                p,
                "--steps",
                "3",
                "--trace",
                &trace,
            ],
        );
        assert_eq!(code, 0, "{out}");
    }
    let (code, out) = amprobe_in(
        d.path(),
        &["compare", "fp16.jsonl", "bf16.jsonl", "--out", "cmp"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("re-ran the configuration recorded in fp16.jsonl"),
        "{out}"
    );
    let line = |out: &str, label: &str| {
        out.lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no line for {label}: {out}"))
            .to_string()
    };
    let fp16 = line(
        &out,
        "fp16 (fp16) vs fp32 (reference-fp32): first divergence at step 0",
    );
    assert!(
        fp16.contains("`linear` in `encoder.block.3.layer.1.DenseReluDense.wo`: range failure"),
        "{fp16}"
    );
    line(
        &out,
        "bf16 (bf16) vs fp32 (reference-fp32): first divergence at",
    );
    assert!(d.path().join("cmp/reference-fp32.jsonl").is_file());
    assert!(d.path().join("cmp/summary.md").is_file());

    // Files out of reach: the first trace is the reference, and the output says so.
    let fp16 = d.path().join("fp16.jsonl");
    let text = std::fs::read_to_string(&fp16).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let mut header: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    header["config_dir"] = serde_json::json!("/nonexistent-amprobe-dir");
    lines[0] = header.to_string();
    std::fs::write(&fp16, lines.join("\n") + "\n").unwrap();
    let (code, out) = amprobe_in(
        d.path(),
        &["compare", "fp16.jsonl", "bf16.jsonl", "--out", "cmp2"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("cannot be re-run")
            && out.contains("against fp16.jsonl (fp16) as the reference"),
        "{out}"
    );
    line(&out, "bf16 (bf16) vs fp16 (fp16): ");
    // --reference still decides.
    let (code, out) = amprobe_in(
        d.path(),
        &[
            "compare",
            "fp16.jsonl",
            "bf16.jsonl",
            "--out",
            "cmp3",
            "--reference",
            "2",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("no fp32 trace given"), "{out}");
    assert!(out.contains("fp16 (fp16) vs bf16 (bf16)"), "{out}");
}
