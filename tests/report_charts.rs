//! `amprobe report`: every chart's SVG is parsed and checked against the trace it was drawn
//! from (titles, axis labels, series, markers where they belong); summary.md and index.html
//! state the findings; a trace cut mid-line still gives a report that says so.

mod report_util;

use amprobe::report::{write_report, ReportOptions, TraceFile};
use amprobe::trace::read_trace;
use amprobe::trace::record::Phase;
use report_util::{inject, mlp_trace, png_size, Svg};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const BLUE: &str = "#1F77B4";
const RED: &str = "#D62728";

/// fp16, 3 steps, an Inf written into the forward `linear` of `fc2` at step 1.
fn overflow_trace(dir: &Path) -> PathBuf {
    mlp_trace(
        dir,
        "fwd_inf",
        "fp16",
        3,
        vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        |_| {},
    )
}

fn report(trace: &Path, out: &Path, step: Option<u64>) -> amprobe::report::ReportOutput {
    let tf = TraceFile::open(trace).unwrap();
    write_report(
        &tf,
        &ReportOptions {
            out_dir: out.to_path_buf(),
            step,
            ..ReportOptions::default()
        },
    )
    .unwrap()
}

fn centroid(p: &[(f64, f64)]) -> (f64, f64) {
    let n = p.len() as f64;
    (
        p.iter().map(|q| q.0).sum::<f64>() / n,
        p.iter().map(|q| q.1).sum::<f64>() / n,
    )
}

#[test]
fn report_files_and_png_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    let r = report(&t, &out, None);
    let stems: Vec<&str> = r.charts.iter().map(|c| c.stem.as_str()).collect();
    assert_eq!(
        stems,
        [
            "scale",
            "loss",
            "grad_heatmap",
            "ops",
            "hist_act_grads",
            "hist_activations"
        ]
    );
    for c in &r.charts {
        let svg = Svg::open(&c.svg);
        let (w, h) = svg.size();
        assert_eq!(png_size(&c.png), (w as u32, h as u32), "{}", c.stem);
        assert!(w >= 900.0 && h >= 400.0, "{}: {w}x{h}", c.stem);
    }
    // The first step with op records and a non-finite value.
    assert_eq!(r.op_step, Some(1));
    let html = std::fs::read_to_string(&r.index_html).unwrap();
    assert_eq!(
        html.matches("src=\"data:image/png;base64,").count(),
        6,
        "every chart embedded"
    );
    assert_eq!(
        html.matches("src=\"").count(),
        6,
        "nothing loaded from outside"
    );
    assert!(!html.contains("<script"));
}

#[test]
fn scale_chart_marks_the_skipped_step_at_its_scale() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    report(&t, &out, None);
    let svg = Svg::open(&out.join("scale.svg"));
    assert!(svg.has_text("Loss scale per step"));
    assert!(svg.text_exact("step").is_some(), "x axis label");
    assert!(
        svg.text_exact("loss scale (log2 axis)").is_some(),
        "y axis label"
    );
    assert!(svg.text_exact("loss scale used in the step").is_some());
    assert!(
        svg.text_exact("skipped step: divergence").is_some(),
        "legend names the cause: {:?}",
        svg.texts().iter().map(|t| &t.content).collect::<Vec<_>>()
    );
    let y16 = svg.text_exact("2^16").expect("2^16 tick").y;
    let y15 = svg.text_exact("2^15").expect("2^15 tick").y;
    assert!(y15 > y16, "a smaller scale is lower");
    // The staircase: steps 0 and 1 at 2^16, step 2 (after the backoff) at 2^15.
    let line = svg.polylines(BLUE);
    let stair = line.iter().max_by_key(|p| p.len()).expect("the scale line");
    assert!((stair[0].1 - y16).abs() <= 1.0, "{stair:?} vs {y16}");
    assert!(
        (stair.last().unwrap().1 - y15).abs() <= 1.0,
        "{stair:?} vs {y15}"
    );
    // One skip marker in the plot (the other triangle is the legend's), over step 1.
    let x1 = svg.text_exact("1").expect("step 1 tick").x;
    let tris = svg.polygons(RED);
    assert_eq!(tris.len(), 2);
    let marker = tris
        .iter()
        .map(|p| centroid(p))
        .find(|c| c.1 < svg.text_exact("step").unwrap().y - 30.0)
        .expect("a marker inside the plot");
    assert!(
        (marker.0 - x1).abs() <= 1.5,
        "marker at x {} vs step 1 at {x1}",
        marker.0
    );
    assert!(
        (marker.1 - y16).abs() <= 6.0,
        "marker at the scale used, 2^16"
    );
}

#[test]
fn loss_chart_has_one_point_per_finite_loss_and_marks_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    report(&t, &out, None);
    let trace = read_trace(&t).unwrap();
    let losses: Vec<f64> = trace.steps.iter().map(|s| s.loss.unwrap()).collect();
    assert!(losses[0].is_finite() && !losses[1].is_finite() && losses[2].is_finite());
    let svg = Svg::open(&out.join("loss.svg"));
    assert!(svg.has_text("Loss per step"));
    assert!(svg.text_exact("loss").is_some(), "y axis label");
    assert!(svg.text_exact("loss (unscaled)").is_some());
    assert!(svg
        .text_exact("loss is Inf or NaN (drawn at the top edge)")
        .is_some());
    let pts = svg.circles(BLUE);
    assert_eq!(pts.len(), 2, "steps 0 and 2");
    let x = |s: &str| svg.text_exact(s).unwrap().x;
    assert!((pts[0].0 - x("0")).abs() <= 1.5);
    assert!((pts[1].0 - x("2")).abs() <= 1.5);
    // The loss fell from step 0 to step 2: the second point is lower on the page.
    assert!(losses[2] < losses[0] && pts[1].1 > pts[0].1);
    // The non-finite marker (a cross: two crossing lines) over step 1, above both points.
    let purple = svg.lines("#943CBD");
    let marks: Vec<_> = purple
        .iter()
        .filter(|l| l.1 < pts[0].1.min(pts[1].1))
        .collect();
    assert!(!marks.is_empty(), "{purple:?}");
    for l in marks {
        assert!(((l.0 + l.2) / 2.0 - x("1")).abs() <= 1.5);
    }
}

#[test]
fn heatmap_rows_and_the_non_finite_column() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    report(&t, &out, None);
    let svg = Svg::open(&out.join("grad_heatmap.svg"));
    assert!(svg.has_text("Gradient magnitude per parameter"));
    let names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];
    let ys: Vec<f64> = names
        .iter()
        .map(|n| svg.text_exact(n).unwrap_or_else(|| panic!("row {n}")).y)
        .collect();
    assert!(
        ys.windows(2).all(|w| w[0] < w[1]),
        "rows top to bottom in parameter order"
    );
    for l in [
        "fp16 max 65504",
        "fp16 min normal 2^-14",
        "fp16 min subnormal 2^-24",
    ] {
        assert!(svg.text_exact(l).is_some(), "colour bar marks {l}");
    }
    assert!(svg.has_text("below 2^-24"), "underflow band in the legend");
    assert!(svg.has_text("above 65504"), "overflow band in the legend");
    // Step 1's gradients hold NaN: its column is black, the others are not.
    let black: Vec<_> = svg
        .rects("#000000")
        .into_iter()
        .filter(|r| r.2 > 40.0)
        .collect();
    assert_eq!(black.len(), 4, "one black cell per parameter");
    let x1 = svg.text_exact("1").unwrap().x;
    for r in &black {
        assert!(
            (r.0 + r.2 / 2.0 - x1).abs() <= 2.0,
            "black cell over step 1"
        );
    }
    // The finite cells show their value, e.g. fc2.bias at step 0.
    let trace = read_trace(&t).unwrap();
    let g = trace.steps[0]
        .params
        .iter()
        .find(|p| p.name == "fc2.bias")
        .unwrap()
        .max_abs_grad;
    assert!(
        svg.text_exact(&format!("{g:.3}")).is_some(),
        "cell label {g:.3}"
    );
}

#[test]
fn op_chart_marks_the_first_inf_at_the_injected_op() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    report(&t, &out, None);
    let trace = read_trace(&t).unwrap();
    let s1 = &trace.steps[1];
    let ops = s1.ops.as_ref().unwrap();
    let k = ops
        .iter()
        .find(|o| o.op == "linear" && o.module == "fc2" && o.phase == Phase::Forward)
        .unwrap()
        .index;
    assert_eq!(s1.origins.first_inf.as_ref().unwrap().op_index, k);
    let svg = Svg::open(&out.join("ops.svg"));
    assert!(svg.has_text("Largest |output| of every op, step 1"));
    assert!(svg.text_exact("op index (execution order)").is_some());
    assert!(svg
        .text_exact("max |x| of the output (log scale)")
        .is_some());
    assert!(svg.text_exact("fp16 max 65504").is_some());
    assert!(svg.text_exact("bf16 max 3.39e38").is_some());
    assert!(
        svg.text_exact(&format!("first Inf: op #{k} linear in fc2 (forward)"))
            .is_some(),
        "{:?}",
        svg.texts().iter().map(|t| &t.content).collect::<Vec<_>>()
    );
    // Forward ops before the injection are finite: their circles give the x of op i.
    let fwd = svg.circles(BLUE);
    let finite_before = ops
        .iter()
        .filter(|o| o.index < k && o.phase == Phase::Forward && o.stats.max_abs > 0.0)
        .count();
    assert_eq!(finite_before as u64, k, "ops 0..k are finite forward ops");
    let plotted: Vec<_> = fwd.iter().take(k as usize).collect();
    let dx = (plotted[k as usize - 1].0 - plotted[0].0) / (k - 1) as f64;
    let expect = plotted[0].0 + dx * k as f64;
    // The marker: a vertical dashed red line (many short vertical segments).
    let vertical: Vec<f64> = svg
        .polylines(RED)
        .into_iter()
        .filter(|p| p.len() == 2 && p[0].0 == p[1].0 && p[0].1 != p[1].1)
        .map(|p| p[0].0)
        .collect();
    assert!(vertical.len() > 10, "a dashed vertical line");
    assert!(
        vertical.iter().all(|&x| (x - expect).abs() <= 1.5),
        "marker x {vertical:?} vs op {k} at {expect}"
    );
    // The fp16 max line is horizontal at 65504: between the 1e0 and 1e5 ticks.
    let y0 = svg.text_exact("1e0").unwrap().y;
    let y5 = svg.text_exact("1e5").unwrap().y;
    let fp16 = svg
        .polylines(RED)
        .into_iter()
        .find(|p| p.len() == 2 && p[0].1 == p[1].1 && p[1].0 - p[0].0 > 500.0)
        .expect("fp16 max line");
    let frac = (y0 - fp16[0].1) / (y0 - y5);
    assert!(
        (frac - 65504f64.log10() / 5.0).abs() < 0.02,
        "fp16 line at log10 65504"
    );
}

/// Exponent counts of the ops a histogram covers, straight from the trace JSON.
fn hist_from_json(path: &Path, forward: bool) -> BTreeMap<i64, u64> {
    let mut m = BTreeMap::new();
    for line in std::fs::read_to_string(path).unwrap().lines().skip(1) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(ops) = v.get("ops").and_then(|o| o.as_array()) else {
            continue;
        };
        for o in ops {
            let phase = o["phase"].as_str().unwrap();
            let wrt = o["wrt"].as_str().unwrap_or("");
            let keep = o["op"] != "to"
                && o["module"] != "scaler"
                && if forward {
                    phase == "forward"
                } else {
                    phase == "backward" && wrt != "weight" && wrt != "bias"
                };
            if !keep {
                continue;
            }
            let lo = o["stats"]["exp_hist"]["lo"].as_i64().unwrap();
            for (i, c) in o["stats"]["exp_hist"]["counts"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
            {
                *m.entry(lo + i as i64).or_insert(0) += c.as_u64().unwrap();
            }
        }
    }
    m.retain(|_, c| *c > 0);
    m
}

#[test]
fn histograms_have_one_bar_per_exponent_and_fp16_shares() {
    let dir = tempfile::tempdir().unwrap();
    // A clean run: every step keeps its ops.
    let t = mlp_trace(dir.path(), "clean", "fp16", 2, vec![], |c| {
        c.probe.sample_every = Some(1)
    });
    let out = dir.path().join("rep");
    report(&t, &out, None);
    for (stem, forward, title) in [
        ("hist_activations", true, "Exponents of activations"),
        ("hist_act_grads", false, "Exponents of activation gradients"),
    ] {
        let svg = Svg::open(&out.join(format!("{stem}.svg")));
        assert!(svg.has_text(title), "{stem}");
        assert!(svg.text_exact("exponent: floor(log2 |x|)").is_some());
        assert!(svg.text_exact("share of values (%)").is_some());
        let h = hist_from_json(&t, forward);
        let bars = svg
            .rects(BLUE)
            .len()
            .checked_sub(1)
            .expect("bars and the legend swatch");
        assert_eq!(bars, h.len(), "{stem}: one bar per exponent present");
        let total: u64 = h.values().sum();
        let normal: u64 = h.range(-14..16).map(|e| e.1).sum();
        let sub: u64 = h.range(-24..-14).map(|e| e.1).sum();
        let pct = |n: u64| format!("{:.2}%", n as f64 / total as f64 * 100.0);
        assert!(
            svg.text_exact(&format!(
                "fp16 normal range [2^-14, 65504]: {}",
                pct(normal)
            ))
            .is_some(),
            "{stem}: {:?}",
            svg.texts().iter().map(|t| &t.content).collect::<Vec<_>>()
        );
        assert!(svg
            .text_exact(&format!(
                "fp16 subnormal range [2^-24, 2^-14): {}",
                pct(sub)
            ))
            .is_some());
        if !forward {
            // Scale 2^16 is a power of two: the unscaled outline is drawn, 16 binades lower.
            assert!(svg.has_text("the same values with the loss scale divided out"));
            let below: u64 = h.range(..(-24 + 16)).map(|e| e.1).sum();
            assert!(svg.has_text(&format!("divided out: {} below 2^-24", pct(below))));
        }
    }
}

#[test]
fn summary_states_verdict_origin_and_skip_cause() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let out = dir.path().join("rep");
    let r = report(&t, &out, None);
    let md = std::fs::read_to_string(&r.summary_md).unwrap();
    assert!(md.contains("**forward-nonfinite**"), "{md}");
    let k = read_trace(&t).unwrap().steps[1]
        .origins
        .first_inf
        .clone()
        .unwrap()
        .op_index;
    assert!(
        md.contains(&format!("| Inf | forward | {k} | `linear` | `fc2` | 1 |")),
        "{md}"
    );
    assert!(md.contains("1 of 3 step(s) skipped (33.3%)."));
    // The run classified the skip: the injected Inf happens in an fp32 re-run too.
    assert!(md.contains("| 1 | 2^16 | 2^15 | divergence |"), "{md}");
    assert!(md.contains("`--keep-fp32 fc2`"), "remedy names the module");
    assert!(md.contains("| `fc2.bias` | float32 / float32 | 10 |"));
    assert!(!md.contains("trace was cut"));
    let html = std::fs::read_to_string(&r.index_html).unwrap();
    assert!(html.contains("<strong>forward-nonfinite</strong>"));
    assert!(html.contains("<td><code>linear</code></td><td><code>fc2</code></td>"));
}

#[test]
fn truncated_trace_reports_finished_steps_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let t = mlp_trace(dir.path(), "full", "fp16", 4, vec![], |_| {});
    let text = std::fs::read(&t).unwrap();
    // Drop the end record and cut the last step's line in the middle.
    let lines: Vec<&[u8]> = text.split_inclusive(|&b| b == b'\n').collect();
    assert_eq!(lines.len(), 6);
    let mut cut: Vec<u8> = lines[..4].concat();
    let half = lines[4].len() / 2;
    cut.extend_from_slice(&lines[4][..half]);
    let cut_path = dir.path().join("cut.jsonl");
    std::fs::write(&cut_path, &cut).unwrap();
    let out = dir.path().join("rep");
    let r = report(&cut_path, &out, None);
    let md = std::fs::read_to_string(&r.summary_md).unwrap();
    assert!(
        md.contains(&format!(
            "The trace was cut: line 5 holds only {half} bytes of an unfinished record"
        )),
        "{md}"
    );
    assert!(md.contains("This report covers the 3 finished step(s)."));
    let html = std::fs::read_to_string(&r.index_html).unwrap();
    assert!(html.contains("class=\"warn\""));
    assert!(html.contains("The trace was cut"));
    // The charts cover steps 0–2 only.
    let svg = Svg::open(&out.join("loss.svg"));
    assert_eq!(svg.circles(BLUE).len(), 3);
    assert!(svg.text_exact("3").is_none(), "no step 3 on the axis");

    // Through the binary: exit 0, the note on stdout.
    let out2 = dir.path().join("rep2");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args([
            "report",
            cut_path.to_str().unwrap(),
            "--out",
            out2.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("note: The trace was cut"), "{stdout}");
    assert!(out2.join("index.html").exists());
}

#[test]
fn step_without_ops_is_refused_with_the_steps_that_have_them() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    let tf = TraceFile::open(&t).unwrap();
    let e = write_report(
        &tf,
        &ReportOptions {
            out_dir: dir.path().join("rep"),
            step: Some(2),
            ..ReportOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--step 2: that step has no op records"), "{e}");
    assert!(e.contains("steps with op records: 0–1 (2 steps)"), "{e}");
    // An explicit step with ops is taken.
    let r = report(&t, &dir.path().join("rep0"), Some(0));
    assert_eq!(r.op_step, Some(0));
    let svg = Svg::open(&dir.path().join("rep0/ops.svg"));
    assert!(svg.has_text("step 0"));
    assert!(!svg.has_text("first Inf"), "step 0 has no Inf");
}

#[test]
fn a_skip_cause_written_by_the_run_wins() {
    let dir = tempfile::tempdir().unwrap();
    let t = overflow_trace(dir.path());
    // The run records its classification in the step record; the report shows that one,
    // not a cause derived from the origins.
    let text = std::fs::read_to_string(&t).unwrap();
    let edited: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with("{\"type\":\"step\",\"step\":1,") {
                l.replacen("\"kind\":\"divergence\"", "\"kind\":\"scale-too-high\"", 1)
            } else {
                l.to_string()
            }
        })
        .collect();
    assert_ne!(edited.join("\n") + "\n", text, "the step line was found");
    let p = dir.path().join("with_cause.jsonl");
    std::fs::write(&p, edited.join("\n") + "\n").unwrap();
    let out = dir.path().join("rep");
    let r = report(&p, &out, None);
    let md = std::fs::read_to_string(&r.summary_md).unwrap();
    assert!(md.contains("| 1 | 2^16 | 2^15 | scale-too-high |"), "{md}");
    let svg = Svg::open(&out.join("scale.svg"));
    assert!(svg.text_exact("skipped step: scale-too-high").is_some());
}

#[test]
fn recurring_skips_at_one_scale_get_a_cap_remedy() {
    let dir = tempfile::tempdir().unwrap();
    // Growth every 5 clean steps drives the scale into the gradients' overflow at 2^19.
    let t = mlp_trace(dir.path(), "grow", "fp16", 30, vec![], |c| {
        c.scaler.growth_interval = Some(5)
    });
    let trace = read_trace(&t).unwrap();
    let skipped: Vec<f64> = trace
        .steps
        .iter()
        .filter(|s| s.skipped)
        .map(|s| s.scale_before)
        .collect();
    assert!(
        skipped.len() >= 2 && skipped.iter().all(|&s| s == 524288.0),
        "{skipped:?}"
    );
    let r = report(&t, &dir.path().join("rep"), None);
    let md = std::fs::read_to_string(&r.summary_md).unwrap();
    let want = format!(
        "Every skip ({} of 30 steps, {:.1}%) happened at loss scale 2^19",
        skipped.len(),
        skipped.len() as f64 / 30.0 * 100.0
    );
    assert!(md.contains(&want), "{want}\n{md}");
    assert!(md.contains("`--scaler maxclip --max-scale 262144`"));
}
