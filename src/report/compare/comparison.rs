//! The comparison itself: runs aligned op by op with the reference, each divergence
//! classified. A leaf of `compare`: `render.rs` and the per-op chart read what it makes.

use crate::diagnose::align::{align, scale_of};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::report::facts::{self, fmt_pct, module_name};
use crate::report::trace_file::TraceFile;
use crate::trace::record::{OpRecord, Phase, StepRecord};
use std::collections::HashMap;
use std::path::PathBuf;

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
    /// The op's blame in the run, when the run blamed its ops (`--blame`).
    pub blame: Option<crate::trace::record::OpBlame>,
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
            self.phase.name(),
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
        blame: a.blame,
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
            additive_mask: false,
            blame: None,
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
