//! `amprobe compare`: runs of the same model and data in different precisions, aligned op by
//! op against a reference run (fp32), with each divergence classified as a range failure
//! (overflow, underflow, Inf/NaN) or a rounding difference.
//!
//! Alignment ([`crate::diagnose::align`], the same as the terminal UI's Compare panel):
//! within a step that has op records in both runs, ops are matched by micro-batch, phase, op
//! name, module, gradient input and occurrence (the k-th `linear` of `fc1` in the backward
//! pass of micro-batch 0 matches the k-th one of the other run). Casts are left out of the
//! diff: autocast adds them to low-precision runs only, so op indices differ between runs
//! while the rest of the graph is the same. Values that carry the loss scale (backward outputs and the scaler's
//! own ops) are divided by their step's scale first, so runs with different scales compare.
//!
//! Only summary statistics are in a trace, so the per-op difference is the relative
//! difference of the output's largest |x| and of its L2 norm (finite values), not an
//! elementwise error.

use super::charts::{
    self, render, Chart, DrawResult, Legend, MarkGroup, Rendered, StepChart, StepSeries, Symbol,
    C_GREY, PALETTE,
};
use super::doc::{Block, Doc};
use super::facts::{self, fmt_num, fmt_pct, module_name, phase_name};
use super::summary::{completeness, step_ranges};
use super::TraceFile;
use crate::diagnose::align::{align, scale_of};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::trace::record::{OpRecord, Phase, StepRecord};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use crate::diagnose::align::{rel_diff, DEFAULT_THRESHOLD};

/// Share of an op's values flushed to zero (or subnormal in fp16) above which the op's
/// divergence counts as a range failure.
const RANGE_SHARE: f64 = 0.01;

/// What kind of divergence an op shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Values left the low-precision format's range: Inf/NaN where the reference is
    /// finite, overflow to Inf, or a share of values flushed to zero or subnormal.
    Range,
    /// Every value stayed in range; the difference comes from the format's precision.
    Rounding,
}

impl Class {
    /// `range failure` or `rounding difference`.
    pub fn describe(self) -> &'static str {
        match self {
            Class::Range => "range failure",
            Class::Rounding => "rounding difference",
        }
    }

    /// `range` or `rounding`.
    pub fn name(self) -> &'static str {
        match self {
            Class::Range => "range",
            Class::Rounding => "rounding",
        }
    }
}

/// One op of a run matched with the same op of the reference run.
#[derive(Debug, Clone, PartialEq)]
pub struct OpDiff {
    /// Step number.
    pub step: u64,
    /// Micro-batch.
    pub micro: u32,
    /// Phase.
    pub phase: Phase,
    /// Op name.
    pub op: String,
    /// Module path.
    pub module: String,
    /// Index of the op in the run.
    pub run_index: u64,
    /// Index of the op in the reference run.
    pub ref_index: u64,
    /// Output dtype in the run.
    pub dtype: DType,
    /// Largest finite |x| in the run (loss scale divided out).
    pub run_max_abs: f64,
    /// Largest finite |x| in the reference (loss scale divided out).
    pub ref_max_abs: f64,
    /// Relative difference of the largest |x|.
    pub rel_max_abs: f64,
    /// Relative difference of the L2 norm of the finite values.
    pub rel_l2: f64,
    /// Beyond the threshold, or Inf/NaN or overflow the reference does not have.
    pub diverged: bool,
    /// Kind of the divergence (also set for ops that did not diverge).
    pub class: Class,
    /// Why the class was chosen, one sentence.
    pub reason: String,
    /// A range failure whose Inf/NaN came from an earlier op of the same step.
    pub propagated: bool,
}

impl OpDiff {
    /// The larger of the two relative differences.
    pub fn rel(&self) -> f64 {
        self.rel_max_abs.max(self.rel_l2)
    }

    /// `step 1 forward op #7 (reference #3) `linear` in `fc2``.
    pub fn describe(&self) -> String {
        format!(
            "step {} {} op #{} (reference #{}) `{}` in `{}`",
            self.step,
            phase_name(self.phase),
            self.run_index,
            self.ref_index,
            self.op,
            module_name(&self.module)
        )
    }
}

/// One run's comparison with the reference.
#[derive(Debug, Clone)]
pub struct RunDiff {
    /// Position of the run in the inputs.
    pub run: usize,
    /// Steps with op records in both runs.
    pub steps_compared: Vec<u64>,
    /// Matched ops, in step order and reference execution order.
    pub ops: Vec<OpDiff>,
    /// Ops of the run with no match (casts excluded).
    pub only_in_run: usize,
    /// Ops of the reference with no match (casts excluded).
    pub only_in_ref: usize,
    /// Casts left out of the run.
    pub casts_in_run: usize,
}

impl RunDiff {
    /// The first diverged op.
    pub fn first_divergence(&self) -> Option<&OpDiff> {
        self.ops.iter().find(|o| o.diverged)
    }

    /// Diverged ops of a class.
    pub fn count(&self, c: Class) -> usize {
        self.ops
            .iter()
            .filter(|o| o.diverged && o.class == c)
            .count()
    }
}

/// One row of the per-precision table.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// Label (`fp16 (name)`).
    pub label: String,
    /// Trace path.
    pub path: PathBuf,
    /// Precision mode.
    pub precision: String,
    /// Steps in the trace.
    pub steps: usize,
    /// Skipped steps.
    pub skipped: usize,
    /// Loss of the last step.
    pub final_loss: Option<f64>,
    /// Mean wall time per step, ms.
    pub mean_step_ms: f64,
    /// Median wall time per step, ms.
    pub median_step_ms: f64,
    /// Verdict.
    pub verdict: String,
}

/// Runs compared against a reference.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// Every run, in input order.
    pub runs: Vec<RunInfo>,
    /// Position of the reference run.
    pub reference: usize,
    /// Relative difference above which an op diverged.
    pub threshold: f64,
    /// One per non-reference run, in input order.
    pub diffs: Vec<RunDiff>,
}

/// Compares one op of a run with the reference's.
fn diff_op(
    rs: &StepRecord,
    a: &OpRecord,
    fs: &StepRecord,
    r: &OpRecord,
    threshold: f64,
    inf_before: bool,
) -> OpDiff {
    let (sa, sr) = (scale_of(rs, a), scale_of(fs, r));
    let (ma, mr) = (a.stats.max_abs / sa, r.stats.max_abs / sr);
    let (la, lr) = (a.stats.l2() / sa, r.stats.l2() / sr);
    // More NaN, +inf or -inf than the reference: masked -inf, present in both, does not count.
    let (sa_, sr_) = (&a.stats, &r.stats);
    let extra = sa_.nan.saturating_sub(sr_.nan)
        + sa_.pos_inf.saturating_sub(sr_.pos_inf)
        + sa_.neg_inf.saturating_sub(sr_.neg_inf);
    let new_nonfinite = extra > 0;
    let (mut rel_max_abs, mut rel_l2) = (rel_diff(ma, mr), rel_diff(la, lr));
    if new_nonfinite {
        rel_max_abs = f64::INFINITY;
        rel_l2 = f64::INFINITY;
    }
    let dt = a.output.dtype;
    let before = a.stats.finite_nonzero() + a.rounding.underflow;
    let flushed = if before == 0 {
        0.0
    } else {
        a.rounding.underflow as f64 / before as f64
    };
    let sub = if dt == DType::F16 && a.stats.numel > 0 {
        a.stats.subnormal as f64 / a.stats.numel as f64
    } else {
        0.0
    };
    let (class, reason) = if new_nonfinite {
        (
            Class::Range,
            format!(
                "Inf/NaN in the {dt} output that the reference does not have ({})",
                facts::plural(extra, "value")
            ),
        )
    } else if a.rounding.overflow > 0 {
        (
            Class::Range,
            format!(
                "{} overflowed to Inf when rounded to {dt}",
                facts::plural(a.rounding.overflow, "value")
            ),
        )
    } else if flushed > RANGE_SHARE {
        (
            Class::Range,
            format!(
                "{} ({}) flushed to zero when rounded to {dt}",
                facts::plural(a.rounding.underflow, "value"),
                fmt_pct(flushed)
            ),
        )
    } else if sub > RANGE_SHARE {
        (
            Class::Range,
            format!(
                "{} of the values are subnormal in fp16 (fewer significant bits)",
                fmt_pct(sub)
            ),
        )
    } else {
        (
            Class::Rounding,
            format!("all values in the {dt} range; precision alone"),
        )
    };
    let diverged = rel_max_abs.max(rel_l2) > threshold || new_nonfinite || a.rounding.overflow > 0;
    OpDiff {
        step: rs.step,
        micro: a.micro,
        phase: a.phase,
        op: a.op.clone(),
        module: a.module.clone(),
        run_index: a.index,
        ref_index: r.index,
        dtype: dt,
        run_max_abs: ma,
        ref_max_abs: mr,
        rel_max_abs,
        rel_l2,
        diverged,
        class,
        reason,
        propagated: new_nonfinite && inf_before && a.rounding.overflow == 0,
    }
}

/// Aligns `run` with `reference` over the steps that have op records in both.
pub fn diff_runs(run: &TraceFile, reference: &TraceFile, threshold: f64, index: usize) -> RunDiff {
    let mut d = RunDiff {
        run: index,
        steps_compared: Vec::new(),
        ops: Vec::new(),
        only_in_run: 0,
        only_in_ref: 0,
        casts_in_run: 0,
    };
    let refs: HashMap<u64, &StepRecord> = reference
        .trace
        .steps
        .iter()
        .filter(|s| s.ops.is_some())
        .map(|s| (s.step, s))
        .collect();
    for rs in &run.trace.steps {
        let (Some(a_ops), Some(fs)) = (rs.ops.as_ref(), refs.get(&rs.step)) else {
            continue;
        };
        let Some(r_ops) = fs.ops.as_ref() else {
            continue;
        };
        d.steps_compared.push(rs.step);
        let rows = align(a_ops, r_ops);
        let is_cast = |o: &OpRecord| facts::is_cast(&o.op);
        d.casts_in_run += a_ops.iter().filter(|o| is_cast(o)).count();
        d.only_in_run += rows
            .iter()
            .filter(|p| p.b.is_none() && p.a.is_some_and(|i| !is_cast(&a_ops[i])))
            .count();
        d.only_in_ref += rows
            .iter()
            .filter(|p| p.a.is_none() && p.b.is_some_and(|j| !is_cast(&r_ops[j])))
            .count();
        let mut pairs: Vec<(usize, usize)> = rows
            .iter()
            .filter_map(|p| Some((p.a?, p.b?)))
            .filter(|&(i, _)| !is_cast(&a_ops[i]))
            .collect();
        // Walk in the run's execution order so "earlier" means earlier in the run, then
        // present the ops in reference order (the same order for matched ops).
        pairs.sort_unstable();
        let mut inf_before = false;
        let mut matched: Vec<OpDiff> = Vec::with_capacity(pairs.len());
        for (i, j) in pairs {
            let od = diff_op(rs, &a_ops[i], fs, &r_ops[j], threshold, inf_before);
            inf_before |= od.class == Class::Range && od.rel().is_infinite();
            matched.push(od);
        }
        matched.sort_by_key(|o| o.ref_index);
        d.ops.extend(matched);
    }
    d
}

fn run_info(tf: &TraceFile) -> RunInfo {
    let t = &tf.trace;
    let mut ms: Vec<f64> = t
        .steps
        .iter()
        .map(|s| s.wall_ms)
        .filter(|x| x.is_finite())
        .collect();
    ms.sort_by(f64::total_cmp);
    let mean = if ms.is_empty() {
        f64::NAN
    } else {
        ms.iter().sum::<f64>() / ms.len() as f64
    };
    let median = match ms.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => ms[n / 2],
        n => (ms[n / 2 - 1] + ms[n / 2]) / 2.0,
    };
    let stem = tf
        .path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    RunInfo {
        label: format!("{} ({stem})", t.header.precision),
        path: tf.path.clone(),
        precision: t.header.precision.clone(),
        steps: t.steps.len(),
        skipped: t.steps.iter().filter(|s| s.skipped).count(),
        final_loss: t.steps.last().and_then(|s| s.loss),
        mean_step_ms: mean,
        median_step_ms: median,
        verdict: facts::verdict(t),
    }
}

/// Compares `traces` with the reference: `reference` (a position) when given, else the
/// fp32 run (the first one whose precision is `fp32`).
pub fn compare(
    traces: &[TraceFile],
    threshold: f64,
    reference: Option<usize>,
) -> Result<Comparison> {
    if traces.len() < 2 {
        return Err(Error::Invalid(format!(
            "compare: needs at least two traces, got {}",
            traces.len()
        )));
    }
    if !(threshold.is_finite() && threshold >= 0.0) {
        return Err(Error::Invalid(format!(
            "compare --threshold {threshold}: expected a relative difference of 0 or more (0.05 = 5%)"
        )));
    }
    let first = traces[0].trace.header.model.clone();
    if let Some(t) = traces.iter().find(|t| t.trace.header.model != first) {
        return Err(Error::Invalid(format!(
            "compare: {} is model `{}`, but {} is model `{first}`: compare runs of the same model",
            t.path.display(),
            t.trace.header.model,
            traces[0].path.display()
        )));
    }
    let reference = match reference {
        Some(r) if r < traces.len() => r,
        Some(r) => {
            return Err(Error::Invalid(format!(
                "compare --reference {}: there are only {} traces",
                r + 1,
                traces.len()
            )))
        }
        None => traces
            .iter()
            .position(|t| t.trace.header.precision == "fp32")
            .ok_or_else(|| {
                Error::Invalid(
                    "compare: no fp32 run among the traces; name the reference with --reference N"
                        .into(),
                )
            })?,
    };
    let diffs = traces
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != reference)
        .map(|(i, t)| diff_runs(t, &traces[reference], threshold, i))
        .collect();
    Ok(Comparison {
        runs: traces.iter().map(run_info).collect(),
        reference,
        threshold,
        diffs,
    })
}

/// Relative differences of aligned ops: one point per op, runs by colour, range failures
/// as crosses, the threshold and each run's first divergence marked.
#[derive(Debug, Clone)]
pub struct DiffChart {
    /// Title.
    pub title: String,
    /// Per run: label and its matched ops.
    pub runs: Vec<(String, Vec<OpDiff>)>,
    /// Threshold of divergence.
    pub threshold: f64,
}

/// Floor of the y axis (log10): identical statistics are drawn here.
const DIFF_FLOOR: f64 = -8.0;

impl DiffChart {
    /// Positions of `(step, reference op index)` on the x axis, in order.
    fn positions(&self) -> Vec<(u64, u64)> {
        let mut p: Vec<(u64, u64)> = self
            .runs
            .iter()
            .flat_map(|r| r.1.iter().map(|o| (o.step, o.ref_index)))
            .collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    fn y(rel: f64) -> f64 {
        if rel > 0.0 {
            rel.log10().max(DIFF_FLOOR)
        } else {
            DIFF_FLOOR
        }
    }

    fn legend(&self) -> Legend {
        let mut l = Legend::default();
        for (i, (label, ops)) in self.runs.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            l.0.push((
                Symbol::Circle(c),
                format!("{label}: op within range (rounding)"),
            ));
            if ops.iter().any(|o| o.class == Class::Range) {
                l.0.push((
                    Symbol::Cross(c),
                    format!("{label}: range failure (Inf/NaN, overflow, underflow)"),
                ));
            }
            if let Some(o) = ops.iter().find(|o| o.diverged) {
                l.0.push((
                    Symbol::Dashed(c),
                    format!(
                        "{label}: first divergence, step {} op #{} {} in {} ({})",
                        o.step,
                        o.run_index,
                        o.op,
                        module_name(&o.module),
                        o.class.name()
                    ),
                ));
            }
        }
        l.0.push((
            Symbol::Dashed(C_GREY),
            format!("threshold {}", fmt_pct(self.threshold)),
        ));
        l
    }
}

impl Chart for DiffChart {
    fn size(&self) -> (u32, u32) {
        (1200, 560 + self.legend().height())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let legend = self.legend();
        let (_, h) = root.dim_in_pixel();
        let (top, bottom) = root.split_vertically(h - legend.height());
        let pos = self.positions();
        let at: HashMap<(u64, u64), usize> = pos.iter().enumerate().map(|(i, p)| (*p, i)).collect();
        let finite_hi = self
            .runs
            .iter()
            .flat_map(|r| r.1.iter().map(|o| o.rel()))
            .filter(|r| r.is_finite())
            .map(Self::y)
            .fold(self.threshold.log10().max(DIFF_FLOOR) + 1.0, f64::max);
        let y1 = finite_hi.ceil() + 2.0;
        let y0 = DIFF_FLOOR - 0.5;
        let x1 = pos.len().max(1) as f64 - 0.5;
        let mut chart = ChartBuilder::on(&top)
            .caption(
                &self.title,
                ("sans-serif", 22, FontStyle::Bold)
                    .into_font()
                    .color(&BLACK),
            )
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.5..x1, y0..y1)?;
        let top_row = y1 - 0.8;
        let multi_step = pos.first().map(|p| p.0) != pos.last().map(|p| p.0);
        let radius = match pos.len() {
            0..=300 => 4,
            301..=1000 => 3,
            _ => 2,
        };
        chart
            .configure_mesh()
            .x_desc(if multi_step {
                "aligned op (step:reference op index, in execution order)"
            } else {
                "aligned op (reference op index, in execution order)"
            })
            .y_desc("relative difference from the reference (log)")
            .axis_desc_style(("sans-serif", 16).into_font().color(&BLACK))
            .label_style(("sans-serif", 13).into_font().color(&BLACK))
            .bold_line_style(charts::C_GRID_BOLD)
            .light_line_style(charts::C_GRID_LIGHT)
            .x_labels(pos.len().clamp(2, 16))
            .y_labels(12)
            .x_label_formatter(&|v| {
                let i = v.round();
                if (v - i).abs() < 1e-9 && i >= 0.0 {
                    pos.get(i as usize).map_or_else(String::new, |p| {
                        if multi_step {
                            format!("{}:#{}", p.0, p.1)
                        } else {
                            format!("#{}", p.1)
                        }
                    })
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| {
                if (v - v.round()).abs() > 1e-9 || *v > top_row - 1.0 {
                    String::new()
                } else if *v <= DIFF_FLOOR {
                    "≤1e-8".to_string()
                } else {
                    format!("1e{}", v.round() as i64)
                }
            })
            .draw()?;
        // Step boundaries; labels thinned so they never overlap.
        let (ox, oy) = top.get_base_pixel();
        let mut prev_step = None;
        let mut label_end = i32::MIN;
        for (i, p) in pos.iter().enumerate() {
            if prev_step != Some(p.0) {
                let x = i as f64 - 0.5;
                chart.draw_series(LineSeries::new(
                    vec![(x, y0), (x, y1)],
                    C_GREY.mix(0.5).stroke_width(1),
                ))?;
                let q = chart.backend_coord(&(x, y1));
                if q.0 >= label_end {
                    let label = format!("step {}", p.0);
                    label_end = q.0 + 8 * label.len() as i32 + 12;
                    top.draw(&Text::new(
                        label,
                        (q.0 - ox + 4, q.1 - oy + 4),
                        ("sans-serif", 13)
                            .into_font()
                            .color(&C_GREY)
                            .pos(Pos::new(HPos::Left, VPos::Top)),
                    ))?;
                }
                prev_step = Some(p.0);
            }
        }
        let t = self.threshold.log10().max(DIFF_FLOOR);
        chart.draw_series(DashedLineSeries::new(
            vec![(-0.5, t), (x1, t)],
            8,
            6,
            C_GREY.stroke_width(2),
        ))?;
        for (i, (_, ops)) in self.runs.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            if let Some(o) = ops.iter().find(|o| o.diverged) {
                let x = at[&(o.step, o.ref_index)] as f64;
                chart.draw_series(DashedLineSeries::new(
                    vec![(x, y0), (x, y1)],
                    10,
                    6,
                    c.stroke_width(2),
                ))?;
            }
            let y = |o: &OpDiff| {
                if o.rel().is_finite() {
                    Self::y(o.rel())
                } else {
                    top_row
                }
            };
            chart.draw_series(ops.iter().filter(|o| o.class == Class::Rounding).map(|o| {
                Circle::new(
                    (at[&(o.step, o.ref_index)] as f64, y(o)),
                    radius,
                    c.filled(),
                )
            }))?;
            chart.draw_series(ops.iter().filter(|o| o.class == Class::Range).map(|o| {
                Cross::new(
                    (at[&(o.step, o.ref_index)] as f64, y(o)),
                    radius + 2,
                    c.stroke_width(2),
                )
            }))?;
        }
        let (l, _) = chart.plotting_area().get_pixel_range();
        legend.draw(&bottom, l.start)?;
        Ok(())
    }
}

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
    let mut charts = Vec::new();
    let series = |f: &dyn Fn(&StepRecord) -> Option<f64>, staircase: bool| -> Vec<StepSeries> {
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
    };
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
    charts.push((
        render(
            &StepChart {
                title: format!("Loss per step ({model})"),
                y_desc: "loss".into(),
                log2: false,
                series: series(&|s| s.loss, false),
                marks: traces
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
                            label: format!(
                                "{}: loss is Inf or NaN (drawn at the top edge)",
                                info.label
                            ),
                            symbol: Symbol::Cross(PALETTE[i % PALETTE.len()]),
                            points: bad,
                        })
                    })
                    .collect(),
            },
            dir,
            "loss_overlay",
        )?,
        "Loss per step, every run".to_string(),
    ));
    charts.push((
        render(
            &StepChart {
                title: format!("Loss scale per step ({model})"),
                y_desc: "loss scale (log2 axis)".into(),
                log2: true,
                series: series(&|s| Some(s.scale_before), true),
                marks: skips,
            },
            dir,
            "scale_overlay",
        )?,
        "Loss scale per step, every run; skipped steps marked".to_string(),
    ));
    let ref_label = &cmp.runs[cmp.reference].label;
    if cmp.diffs.iter().any(|d| !d.ops.is_empty()) {
        charts.push((
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
            "Relative difference of each aligned op's max |x| or L2 norm from the reference"
                .to_string(),
        ));
    }
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
            match d.first_divergence() {
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
            }
        })
        .collect()
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
    for diff in &cmp.diffs {
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
            continue;
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
                            phase_name(o.phase).into(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::TensorStats;
    use crate::trace::record::TensorMeta;

    fn op(index: u64, dtype: DType, values: &[f32], masked: u64) -> OpRecord {
        OpRecord {
            micro: 0,
            index,
            phase: Phase::Forward,
            op: "masked_fill".into(),
            module: "enc.attn".into(),
            inputs: Vec::new(),
            output: TensorMeta {
                dtype,
                shape: vec![values.len()],
            },
            stats: TensorStats::compute(dtype, values),
            rounding: Default::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: masked,
        }
    }

    fn step(scale: f64) -> StepRecord {
        StepRecord {
            scale_before: scale,
            ..StepRecord::default()
        }
    }

    #[test]
    fn masked_neg_inf_in_both_runs_is_not_a_range_failure() {
        let ni = f32::NEG_INFINITY;
        let r = op(3, DType::F32, &[1.0, ni, 2.0, ni], 2);
        let a = op(5, DType::F16, &[1.0, ni, 2.0, ni], 2);
        let d = diff_op(&step(1.0), &a, &step(1.0), &r, 0.05, false);
        assert!(!d.diverged && d.class == Class::Rounding, "{d:?}");
        // One more -inf than the reference: a range failure, counted.
        let a = op(5, DType::F16, &[1.0, ni, ni, ni], 2);
        let d = diff_op(&step(1.0), &a, &step(1.0), &r, 0.05, false);
        assert!(d.diverged && d.class == Class::Range);
        assert!(
            d.reason
                .ends_with("that the reference does not have (1 value)"),
            "{}",
            d.reason
        );
        assert!(d.rel().is_infinite());
    }

    #[test]
    fn rounding_difference_and_flush_share() {
        let r = op(0, DType::F32, &[1.0, 3.0, 1e-6, 1e-6], 0);
        let a = op(0, DType::F16, &[1.0, 3.25, 0.0, 0.0], 0);
        let mut a2 = a.clone();
        // 3.25 vs 3.0: max |x| differs by 1/12.
        let d = diff_op(&step(1.0), &a, &step(1.0), &r, 0.05, false);
        assert_eq!(d.rel_max_abs, 0.25 / 3.0);
        assert!(d.diverged && d.class == Class::Rounding);
        // The same, with two of four values flushed by rounding: a range failure.
        a2.rounding.underflow = 2;
        let d = diff_op(&step(1.0), &a2, &step(1.0), &r, 0.05, false);
        assert_eq!(d.class, Class::Range);
        assert!(
            d.reason.starts_with("2 values (50.0%) flushed to zero"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn relative_difference() {
        assert_eq!(rel_diff(2.0, 2.0), 0.0);
        assert_eq!(rel_diff(0.0, 0.0), 0.0);
        assert_eq!(rel_diff(1.0, 0.0), f64::INFINITY);
        assert_eq!(rel_diff(1.1, 1.0), (1.1f64 - 1.0) / 1.0);
        assert_eq!(rel_diff(-3.0, 2.0), 2.5);
    }
}
