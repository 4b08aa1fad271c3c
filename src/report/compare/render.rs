//! The comparison as a report: `compare.md`, `compare.html` and the per-op difference
//! chart of each run, plus the lines the command line prints.

use super::comparison::{compare, Class, Comparison, OpDiff, RunDiff, RunInfo};
use super::diff_chart::DiffChart;
use crate::error::{Error, Result};
use crate::report::charts::{render, MarkGroup, Rendered, StepChart, StepSeries, Symbol, PALETTE};
use crate::report::doc::{Block, Doc};
use crate::report::facts::{fmt_num, fmt_pct, module_name};
use crate::report::summary_doc::{completeness, step_ranges};
use crate::report::trace_file::TraceFile;
use crate::trace::record::{Phase, StepRecord};
use std::path::{Path, PathBuf};

/// What to put in a comparison report.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Output folder (created if missing).
    pub out_dir: PathBuf,
    /// Relative difference above which an op diverged.
    pub threshold: f64,
    /// Position of the reference run; default: the fp32 run.
    pub reference: Option<usize>,
}

/// What a comparison wrote and found.
#[derive(Debug, Clone)]
pub struct CompareOutput {
    /// The comparison.
    pub comparison: Comparison,
    /// `summary.md`.
    pub summary_md: PathBuf,
    /// `index.html`.
    pub index_html: PathBuf,
    /// The charts.
    pub charts: Vec<Rendered>,
}

/// Compares `traces` and writes charts, `summary.md` and `index.html` into `opts.out_dir`.
pub fn write_compare(traces: &[TraceFile], opts: &CompareOptions) -> Result<CompareOutput> {
    let cmp = compare(traces, opts.threshold, opts.reference)?;
    let dir = &opts.out_dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let model = &traces[0].trace.header.model;
    let mut charts = vec![
        loss_overlay(traces, &cmp, model, dir)?,
        scale_overlay(traces, &cmp, model, dir)?,
    ];
    charts.extend(op_diff_chart(&cmp, dir)?);
    let doc = build_doc(traces, &cmp, &charts);
    let summary_md = dir.join("summary.md");
    std::fs::write(&summary_md, doc.to_markdown()).map_err(|e| Error::io(&summary_md, e))?;
    let index_html = dir.join("index.html");
    let html = doc.to_html(dir)?;
    std::fs::write(&index_html, html).map_err(|e| Error::io(&index_html, e))?;
    Ok(CompareOutput {
        comparison: cmp,
        summary_md,
        index_html,
        charts: charts.into_iter().map(|c| c.0).collect(),
    })
}

/// A rendered chart and its caption.
type Chart = (Rendered, String);

/// One series per run of what `f` reads from each step.
fn run_series(
    traces: &[TraceFile],
    cmp: &Comparison,
    f: &dyn Fn(&StepRecord) -> Option<f64>,
    staircase: bool,
) -> Vec<StepSeries> {
    traces
        .iter()
        .zip(&cmp.runs)
        .enumerate()
        .map(|(i, (t, info))| StepSeries {
            label: info.label.clone(),
            color: PALETTE[i % PALETTE.len()],
            points: t
                .trace
                .steps
                .iter()
                .filter_map(|s| f(s).map(|v| (s.step, v)))
                .collect(),
            staircase,
        })
        .collect()
}

/// The loss of every run, steps with a non-finite loss marked.
fn loss_overlay(traces: &[TraceFile], cmp: &Comparison, model: &str, dir: &Path) -> Result<Chart> {
    let marks = traces
        .iter()
        .zip(&cmp.runs)
        .enumerate()
        .filter_map(|(i, (t, info))| {
            let bad: Vec<(u64, f64)> = t
                .trace
                .steps
                .iter()
                .filter(|s| s.loss.is_some_and(|l| !l.is_finite()))
                .map(|s| (s.step, f64::NAN))
                .collect();
            (!bad.is_empty()).then(|| MarkGroup {
                label: format!("{}: loss is Inf or NaN (drawn at the top edge)", info.label),
                symbol: Symbol::Cross(PALETTE[i % PALETTE.len()]),
                points: bad,
            })
        })
        .collect();
    Ok((
        render(
            &StepChart {
                title: format!("Loss per step ({model})"),
                y_desc: "loss".into(),
                log2: false,
                series: run_series(traces, cmp, &|s| s.loss, false),
                marks,
            },
            dir,
            "loss_overlay",
        )?,
        "Loss per step, every run".to_string(),
    ))
}

/// The loss scale of every run, skipped steps marked.
fn scale_overlay(traces: &[TraceFile], cmp: &Comparison, model: &str, dir: &Path) -> Result<Chart> {
    let skips: Vec<MarkGroup> = traces
        .iter()
        .zip(&cmp.runs)
        .enumerate()
        .filter(|(_, (t, _))| t.trace.steps.iter().any(|s| s.skipped))
        .map(|(i, (t, info))| MarkGroup {
            label: format!("{}: skipped step", info.label),
            symbol: Symbol::Triangle(PALETTE[i % PALETTE.len()]),
            points: t
                .trace
                .steps
                .iter()
                .filter(|s| s.skipped)
                .map(|s| (s.step, s.scale_before))
                .collect(),
        })
        .collect();
    Ok((
        render(
            &StepChart {
                title: format!("Loss scale per step ({model})"),
                y_desc: "loss scale (log2 axis)".into(),
                log2: true,
                series: run_series(traces, cmp, &|s| Some(s.scale_before), true),
                marks: skips,
            },
            dir,
            "scale_overlay",
        )?,
        "Loss scale per step, every run; skipped steps marked".to_string(),
    ))
}

/// Each run's per-op differences from the reference, where any run has aligned ops.
fn op_diff_chart(cmp: &Comparison, dir: &Path) -> Result<Option<Chart>> {
    if !cmp.diffs.iter().any(|d| !d.ops.is_empty()) {
        return Ok(None);
    }
    let ref_label = &cmp.runs[cmp.reference].label;
    Ok(Some((
        render(
            &DiffChart {
                title: format!("Per-op difference from {ref_label}"),
                runs: cmp
                    .diffs
                    .iter()
                    .map(|d| (cmp.runs[d.run].label.clone(), d.ops.clone()))
                    .collect(),
                threshold: cmp.threshold,
            },
            dir,
            "op_diff",
        )?,
        format!(
            "Relative difference of each aligned op's max |x| or L2 norm from the \
             reference{}",
            cmp.diffs
                .iter()
                .filter_map(
                    |d| partial_steps(cmp, d).map(|s| format!("; {}: {s}", cmp.runs[d.run].label))
                )
                .collect::<String>()
        ),
    )))
}

/// A relative difference for a table: a percentage, or `Inf/NaN` when the run's output
/// is not finite.
fn rel_text(r: f64) -> String {
    if r.is_finite() {
        fmt_pct(r)
    } else {
        "Inf/NaN".into()
    }
}

/// One line per run: its first divergence and class, as `compare` prints it.
pub fn first_divergence_lines(cmp: &Comparison) -> Vec<String> {
    let r = &cmp.runs[cmp.reference].label;
    cmp.diffs
        .iter()
        .map(|d| {
            let label = &cmp.runs[d.run].label;
            let line = match d.first_divergence() {
                Some(o) => format!(
                    "{label} vs {r}: first divergence at {}: {} ({})",
                    o.describe(),
                    o.class.describe(),
                    o.reason
                ),
                None if d.ops.is_empty() => {
                    format!("{label} vs {r}: no step with op records in both runs")
                }
                None => format!(
                    "{label} vs {r}: no divergence above {} in {} aligned ops",
                    fmt_pct(cmp.threshold),
                    d.ops.len()
                ),
            };
            let mut line = format!("{line}{}", partial_note(cmp, d));
            if let Some(b) = d.first_divergence().and_then(|o| blame_of_divergence(d, o)) {
                line.push('\n');
                line.push_str(&b);
            }
            line
        })
        .collect()
}

/// For a run that blamed its ops (`--blame`): what the diverging op introduced and
/// inherited, and the op of its step, up to it, that introduced the most.
fn blame_of_divergence(d: &RunDiff, o: &super::comparison::OpDiff) -> Option<String> {
    let b = o.blame?;
    let worst = d
        .ops
        .iter()
        .filter(|x| x.step == o.step && x.run_index <= o.run_index)
        .filter_map(|x| x.blame.map(|b| (x, b.introduced)))
        .filter(|(_, i)| i.is_finite())
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let mut s = format!(
        "  blame: that op introduces {:.2e} against f64 and inherits {:.2e}",
        b.introduced, b.inherited
    );
    if let Some((w, i)) = worst {
        s.push_str(&format!(
            "; up to it, the most was introduced by `{}`{} in `{}` (op #{}, {:.2e})",
            w.op,
            match w.phase {
                Phase::Forward => String::new(),
                p => format!(" ({})", p.name()),
            },
            super::super::facts::module_name(&w.module),
            w.run_index,
            i
        ));
    }
    Some(s)
}

/// When a run was compared in only some of its steps (op records kept in both runs in
/// those alone), which: a comparison of step 0 is not one of the whole run.
fn partial_note(cmp: &Comparison, d: &RunDiff) -> String {
    partial_steps(cmp, d).map_or(String::new(), |s| {
        format!(" (compared in {s}: where both runs kept op records; --sample-every keeps more)")
    })
}

/// `step(s) 0 of 3 only` when a run was compared in fewer steps than it has.
fn partial_steps(cmp: &Comparison, d: &RunDiff) -> Option<String> {
    let steps = cmp.runs[d.run].steps;
    (!d.steps_compared.is_empty() && d.steps_compared.len() < steps)
        .then(|| format!("step(s) {} of {steps} only", step_ranges(&d.steps_compared)))
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn build_doc(traces: &[TraceFile], cmp: &Comparison, charts: &[(Rendered, String)]) -> Doc {
    let reference = &cmp.runs[cmp.reference];
    let others: Vec<&str> = cmp
        .diffs
        .iter()
        .map(|d| cmp.runs[d.run].precision.as_str())
        .collect();
    let mut d = Doc::new(format!(
        "amprobe compare: {} ({} vs {})",
        traces[0].trace.header.model,
        others.join(", "),
        reference.precision
    ));
    d.push(Block::Para(format!(
        "Reference: **{}** (`{}`). An op diverges when the relative difference of its largest \
         |x| or of its L2 norm from the reference exceeds {}, or when it holds an Inf/NaN or \
         overflows where the reference does not. Values carrying the loss scale are compared \
         with the scale divided out; casts are left out of the alignment.",
        reference.label,
        reference.path.display(),
        fmt_pct(cmp.threshold)
    )));
    for t in traces {
        if let Some(w) = completeness(t) {
            d.push(Block::Warning(format!("`{}`: {w}", t.path.display())));
        }
    }
    section_runs(&mut d, cmp);
    for diff in &cmp.diffs {
        section_diff(&mut d, cmp, diff, reference);
    }
    d.push(Block::Heading(1, "Charts".into()));
    for (r, caption) in charts {
        d.push(Block::Image {
            title: caption.clone(),
            png: file_name(&r.png),
            svg: file_name(&r.svg),
        });
    }
    d
}

/// One row per run: precision, steps, skips, final loss, step time, verdict.
fn section_runs(d: &mut Doc, cmp: &Comparison) {
    d.push(Block::Heading(1, "Runs".into()));
    d.push(Block::Table(
        [
            "run",
            "precision",
            "steps",
            "skipped",
            "skip rate",
            "final loss",
            "step time mean (ms)",
            "step time median (ms)",
            "verdict",
        ]
        .map(String::from)
        .to_vec(),
        cmp.runs
            .iter()
            .map(|r| {
                vec![
                    format!("`{}`", r.label),
                    r.precision.clone(),
                    r.steps.to_string(),
                    r.skipped.to_string(),
                    fmt_pct(r.skipped as f64 / r.steps.max(1) as f64),
                    r.final_loss.map_or("-".into(), fmt_num),
                    format!("{:.3}", r.mean_step_ms),
                    format!("{:.3}", r.median_step_ms),
                    r.verdict.clone(),
                ]
            })
            .collect(),
    ));
}

/// One run against the reference: where it diverged, op by op.
fn section_diff(d: &mut Doc, cmp: &Comparison, diff: &RunDiff, reference: &RunInfo) {
    let run = &cmp.runs[diff.run];
    d.push(Block::Heading(
        1,
        format!("{} vs {}", run.label, reference.label),
    ));
    if diff.steps_compared.is_empty() {
        d.push(Block::Para(
            "No step has op records in both runs, so no op could be compared (keep op \
             records in both runs with `--sample-every`)."
                .into(),
        ));
        return;
    }
    d.push(Block::Para(format!(
        "Compared steps: {}. Aligned ops: {}; only in this run: {}; only in the reference: \
         {}; casts left out: {}.",
        step_ranges(&diff.steps_compared),
        diff.ops.len(),
        diff.only_in_run,
        diff.only_in_ref,
        diff.casts_in_run
    )));
    match diff.first_divergence() {
        Some(o) => d.push(Block::Para(format!(
            "**First divergence**: {}: **{}**: {} (max |x| {} vs {}; relative \
             difference {} of max |x|, {} of the L2 norm).",
            o.describe(),
            o.class.describe(),
            o.reason,
            fmt_num(o.run_max_abs),
            fmt_num(o.ref_max_abs),
            rel_text(o.rel_max_abs),
            rel_text(o.rel_l2)
        ))),
        None => d.push(Block::Para(format!(
            "No op diverged beyond {}.",
            fmt_pct(cmp.threshold)
        ))),
    }
    let (range, rounding) = (diff.count(Class::Range), diff.count(Class::Rounding));
    let propagated = diff
        .ops
        .iter()
        .filter(|o| o.diverged && o.propagated)
        .count();
    let worst_rounding = diff
        .ops
        .iter()
        .filter(|o| o.class == Class::Rounding)
        .map(OpDiff::rel)
        .fold(0.0, f64::max);
    d.push(Block::Para(format!(
        "Diverged ops: {range} range failure(s) ({propagated} of them carrying an \
         earlier op's Inf/NaN), {rounding} rounding difference(s). Largest relative \
         difference of an op within range: {}.",
        fmt_pct(worst_rounding)
    )));
    let mut shown: Vec<&OpDiff> = diff.ops.iter().filter(|o| o.diverged).collect();
    let more = shown.len().saturating_sub(40);
    shown.truncate(40);
    if !shown.is_empty() {
        d.push(Block::Table(
            [
                "step",
                "phase",
                "op # (run / ref)",
                "op",
                "module",
                "dtype",
                "max |x| run",
                "max |x| ref",
                "rel. diff max |x|",
                "rel. diff L2",
                "class",
                "why",
            ]
            .map(String::from)
            .to_vec(),
            shown
                .iter()
                .map(|o| {
                    vec![
                        o.step.to_string(),
                        o.phase.name().into(),
                        format!("{} / {}", o.run_index, o.ref_index),
                        format!("`{}`", o.op),
                        format!("`{}`", module_name(&o.module)),
                        o.dtype.to_string(),
                        fmt_num(o.run_max_abs),
                        fmt_num(o.ref_max_abs),
                        rel_text(o.rel_max_abs),
                        rel_text(o.rel_l2),
                        if o.propagated {
                            "range (propagated)".into()
                        } else {
                            o.class.name().into()
                        },
                        o.reason.clone(),
                    ]
                })
                .collect(),
        ));
        if more > 0 {
            d.push(Block::Para(format!(
                "… and {more} more diverged ops not shown."
            )));
        }
    }
}
