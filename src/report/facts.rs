//! What a trace says, derived once for the charts, the summary and the gate: the verdict,
//! origins, skip causes, headroom, underflow, the per-parameter table and remedies.

use crate::dtype::FP16;
use crate::trace::io::Trace;
use crate::trace::record::{OpRecord, OpRef, ParamRecord, Phase, StepRecord};
use std::collections::BTreeMap;

/// True for ops that only change a tensor's dtype (autocast and explicit casts): their
/// output repeats their input's values, so histograms and comparisons leave them out.
pub fn is_cast(op: &str) -> bool {
    matches!(op, "to" | "cast" | "_to_copy")
}

pub use crate::diagnose::align::is_scaler_op;

/// True for the ops whose outputs count as activations: forward ops of the model, casts
/// and scaler bookkeeping excluded.
pub fn is_activation(op: &OpRecord) -> bool {
    op.phase == Phase::Forward && !is_cast(&op.op) && !is_scaler_op(op)
}

/// True for the ops whose outputs count as activation gradients: backward ops that
/// differentiate with respect to an activation (not a `weight` or `bias`), casts and
/// scaler bookkeeping excluded.
pub fn is_activation_grad(op: &OpRecord) -> bool {
    op.phase == Phase::Backward
        && !is_cast(&op.op)
        && !is_scaler_op(op)
        && !matches!(op.wrt.as_deref(), Some("weight") | Some("bias"))
}

/// NaN and infinite values of an op's output, less the -inf a mask wrote on purpose.
pub fn unmasked_nonfinite(op: &OpRecord) -> u64 {
    let s = &op.stats;
    s.nan + s.pos_inf + s.neg_inf.saturating_sub(op.masked_neg_inf)
}

/// True when any op output of the step or any parameter gradient held an Inf or NaN, or
/// the step names an origin.
pub fn step_has_nonfinite(s: &StepRecord) -> bool {
    s.origins.first_inf.is_some()
        || s.origins.first_nan.is_some()
        || s.params.iter().any(|p| p.nonfinite > 0)
        || s.ops
            .as_ref()
            .is_some_and(|ops| ops.iter().any(|o| unmasked_nonfinite(o) > 0))
}

/// The step a per-op chart shows by default: the first step with op records and a
/// non-finite value, else the first step with op records; `None` when no step has op
/// records.
pub fn default_step(steps: &[StepRecord]) -> Option<u64> {
    let with_ops = || steps.iter().filter(|s| s.ops.is_some());
    with_ops()
        .find(|s| step_has_nonfinite(s))
        .or_else(|| with_ops().next())
        .map(|s| s.step)
}

pub use crate::trace::record::module_name;

/// `step 0 backward op #13 `to` in `loss``.
pub fn describe_op(o: &OpRef) -> String {
    format!(
        "step {} {} op #{} `{}` in `{}`",
        o.step,
        o.phase.name(),
        o.op_index,
        o.op,
        module_name(&o.module)
    )
}

/// The earlier (in execution order) of a step's first Inf and first NaN, with its kind.
pub fn first_origin(s: &StepRecord) -> Option<(&'static str, &OpRef)> {
    match (&s.origins.first_inf, &s.origins.first_nan) {
        (Some(i), Some(n)) if n.op_index < i.op_index => Some(("NaN", n)),
        (Some(i), _) => Some(("Inf", i)),
        (None, Some(n)) => Some(("NaN", n)),
        (None, None) => None,
    }
}

/// Why step `s` was skipped; `None` when it was not. `recorded` is a cause the run wrote
/// itself (see [`super::trace_file::TraceFile::skip_causes`]) and wins. Otherwise: an event that
/// mentions the skip, else the step's first Inf/NaN origin, else the first parameter with
/// a non-finite gradient, else the scaler's finding alone.
pub fn skip_cause(s: &StepRecord, recorded: Option<&str>) -> Option<String> {
    if !s.skipped {
        return None;
    }
    if let Some(r) = recorded {
        return Some(r.to_string());
    }
    if let Some(e) = s
        .events
        .iter()
        .find(|e| e.to_ascii_lowercase().contains("skip"))
    {
        return Some(e.clone());
    }
    if let Some((kind, o)) = first_origin(s) {
        let what = match o.phase {
            Phase::Forward => "forward",
            Phase::Backward => "gradient",
            Phase::Optimizer => "optimizer",
        };
        return Some(format!(
            "{what} {kind} from `{}` in `{}`",
            o.op,
            module_name(&o.module)
        ));
    }
    if let Some(p) = s.params.iter().find(|p| p.nonfinite > 0) {
        return Some(format!("non-finite gradient of `{}`", p.name));
    }
    Some("Inf/NaN in the gradients".to_string())
}

/// How close one op of step `s` came to fp16's largest value: `max|x| / 65504`, or
/// infinity when rounding the op's result to its dtype overflowed or the op is the step's
/// first Inf origin.
pub fn headroom_ratio(s: &StepRecord, op: &OpRecord) -> f64 {
    let origin = s
        .origins
        .first_inf
        .as_ref()
        .is_some_and(|o| o.op_index == op.index && o.micro == op.micro);
    if op.rounding.overflow > 0 || origin {
        f64::INFINITY
    } else {
        op.stats.max_abs / FP16.max
    }
}

/// True for the ops the headroom check looks at: forward ops, scaler bookkeeping excluded
/// (the scaled loss is meant to be large, and backward values are scaled on purpose). In a
/// run some of whose ops ran in 16 bits ([`ran_16bit`]), the check's findings are the
/// 16-bit ones: an fp32 op would reach fp16's limits only if it were cast.
pub fn headroom_checked(op: &OpRecord) -> bool {
    op.phase == Phase::Forward && !is_scaler_op(op)
}

pub use crate::diagnose::headroom::ran_in_16_bits;

/// True when an op of a step with op records ran in a 16-bit float type (see
/// [`ran_in_16_bits`]): the run's model ran in 16 bits.
pub fn ran_16bit(steps: &[StepRecord]) -> bool {
    steps
        .iter()
        .flat_map(|s| s.ops.iter().flatten())
        .any(ran_in_16_bits)
}

/// One op close to (or over) fp16's largest value.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadroomHit {
    /// The op.
    pub op: OpRef,
    /// Output dtype.
    pub dtype: crate::dtype::DType,
    /// Largest finite `|x|` of the output.
    pub max_abs: f64,
    /// [`headroom_ratio`] of the op.
    pub ratio: f64,
    /// Values that would overflow if the output were rounded to fp16.
    pub f16_overflow: u64,
    /// Inf values in the output (an attention mask's -inf left out).
    pub inf: u64,
}

impl HeadroomHit {
    /// True when the op ran in a 16-bit float type (the values the run itself risks);
    /// an fp32 op would overflow fp16 only if it were cast.
    pub fn low_precision(&self) -> bool {
        matches!(
            self.dtype,
            crate::dtype::DType::F16 | crate::dtype::DType::BF16
        )
    }
}

/// Forward ops of all steps with op records whose [`headroom_ratio`] exceeds `threshold`
/// (a fraction of fp16's max) or whose output would overflow fp16; one entry per
/// `(op index, op, module)`, the worst step kept; ops that ran in a 16-bit type first, then
/// fp32 ops, each sorted worst first.
pub fn headroom_hits(steps: &[StepRecord], threshold: f64) -> Vec<HeadroomHit> {
    let mut best: BTreeMap<(u64, String, String), HeadroomHit> = BTreeMap::new();
    for s in steps {
        for op in s.ops.iter().flatten().filter(|o| headroom_checked(o)) {
            let ratio = headroom_ratio(s, op);
            if !(ratio > threshold || op.stats.to_f16.overflow > 0) {
                continue;
            }
            let hit = HeadroomHit {
                op: OpRef::from_op(s.step, op),
                dtype: op.output.dtype,
                max_abs: op.stats.max_abs,
                ratio,
                f16_overflow: op.stats.to_f16.overflow.max(op.rounding.overflow),
                inf: op.stats.pos_inf + op.stats.neg_inf.saturating_sub(op.masked_neg_inf),
            };
            let key = (op.index, op.op.clone(), op.module.clone());
            match best.get(&key) {
                Some(h) if h.ratio >= ratio => {}
                _ => {
                    best.insert(key, hit);
                }
            }
        }
    }
    let mut v: Vec<HeadroomHit> = best.into_values().collect();
    v.sort_by(|a, b| {
        b.low_precision()
            .cmp(&a.low_precision())
            .then(b.ratio.total_cmp(&a.ratio))
            .then(a.op.op_index.cmp(&b.op.op_index))
    });
    v
}

/// Share of a parameter's finite nonzero gradient values lost to fp16 underflow even after
/// loss scaling, with the number of such values it is a share of.
pub fn grad_underflow(p: &ParamRecord) -> (f64, f64) {
    let zeros = (p.zero_frac * p.numel as f64).round();
    let nonzero = (p.numel as f64 - zeros - p.nonfinite as f64).max(0.0);
    (p.f16_underflow_frac_scaled, nonzero)
}

/// The per-parameter table row, over every step of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamRow {
    /// Parameter name.
    pub name: String,
    /// Storage dtype.
    pub dtype: String,
    /// Gradient dtype (last step that had one).
    pub grad_dtype: String,
    /// Elements.
    pub numel: u64,
    /// Largest `|g|` (unscaled) in the last step.
    pub last_max_abs_grad: f64,
    /// L2 norm of the unscaled gradient in the last step.
    pub last_grad_l2: f64,
    /// Smallest nonzero per-step max|g| over all steps (`None` when always zero).
    pub min_max_abs_grad: Option<f64>,
    /// Largest per-step max|g| over all steps.
    pub max_max_abs_grad: f64,
    /// Share of zero gradient values in the last step.
    pub last_zero_frac: f64,
    /// Worst share of values that would flush to zero in fp16 unscaled.
    pub worst_underflow_unscaled: f64,
    /// Worst share of values that flush to zero in fp16 even after scaling.
    pub worst_underflow_scaled: f64,
    /// Steps in which the gradient held an Inf or NaN.
    pub nonfinite_steps: u64,
    /// Largest `|p|` after the last step.
    pub last_param_max_abs: f64,
}

/// One row per parameter (in order of first appearance), over all steps.
pub fn param_table(steps: &[StepRecord]) -> Vec<ParamRow> {
    let mut rows: Vec<ParamRow> = Vec::new();
    let mut at: BTreeMap<String, usize> = BTreeMap::new();
    for s in steps {
        for p in &s.params {
            let i = *at.entry(p.name.clone()).or_insert_with(|| {
                rows.push(ParamRow {
                    name: p.name.clone(),
                    dtype: p.dtype.to_string(),
                    grad_dtype: String::new(),
                    numel: p.numel,
                    last_max_abs_grad: 0.0,
                    last_grad_l2: 0.0,
                    min_max_abs_grad: None,
                    max_max_abs_grad: 0.0,
                    last_zero_frac: 0.0,
                    worst_underflow_unscaled: 0.0,
                    worst_underflow_scaled: 0.0,
                    nonfinite_steps: 0,
                    last_param_max_abs: 0.0,
                });
                rows.len() - 1
            });
            let r = &mut rows[i];
            if let Some(g) = p.grad_dtype {
                r.grad_dtype = g.to_string();
            }
            r.last_max_abs_grad = p.max_abs_grad;
            r.last_grad_l2 = p.grad_l2;
            if p.max_abs_grad > 0.0 {
                r.min_max_abs_grad = Some(
                    r.min_max_abs_grad
                        .map_or(p.max_abs_grad, |m| m.min(p.max_abs_grad)),
                );
            }
            r.max_max_abs_grad = r.max_max_abs_grad.max(p.max_abs_grad);
            r.last_zero_frac = p.zero_frac;
            r.worst_underflow_unscaled = r
                .worst_underflow_unscaled
                .max(p.f16_underflow_frac_unscaled);
            r.worst_underflow_scaled = r.worst_underflow_scaled.max(p.f16_underflow_frac_scaled);
            r.nonfinite_steps += u64::from(p.nonfinite > 0);
            r.last_param_max_abs = p.param_max_abs_after;
        }
    }
    rows
}

/// The verdict of a trace: the end record's when the run finished and its writer gave one,
/// else the runner's rule applied to the finished steps (a captured PyTorch run leaves
/// the verdict to its readers).
pub fn verdict(trace: &Trace) -> String {
    if let Some(e) = trace.end.as_ref().filter(|e| !e.verdict.is_empty()) {
        return e.verdict.clone();
    }
    let params_finite = trace.steps.last().is_none_or(StepRecord::params_finite);
    crate::diagnose::summary::verdict(&trace.steps, params_finite).to_string()
}

/// One sentence explaining a verdict.
pub fn verdict_explanation(v: &str) -> &'static str {
    match v {
        "clean" => "No Inf or NaN appeared and no optimizer step was skipped.",
        "overflow-skips" => {
            "Some optimizer steps were skipped because the scaled gradients held Inf or NaN; \
             the forward pass stayed finite. Dynamic loss scaling does this now and then by \
             design; many skips mean the scale is too high or collapsing."
        }
        "forward-nonfinite" => {
            "An Inf or NaN appeared in the forward pass. Loss scaling cannot fix this: \
             activations left the low-precision range."
        }
        "diverged" => "Parameters became Inf or NaN: non-finite updates were applied.",
        _ => "Verdict written by the run.",
    }
}

/// Everything the summary shows, derived from one trace.
#[derive(Debug, Clone)]
pub struct Facts {
    /// Verdict (`clean`, `overflow-skips`, `forward-nonfinite`, `diverged`).
    pub verdict: String,
    /// Steps with an origin: `(kind "Inf"/"NaN", origin)`, every one, in step order.
    pub origins: Vec<(&'static str, OpRef)>,
    /// The chain of the first step that has one.
    pub chain: Vec<OpRef>,
    /// Skipped steps: `(step, scale before, scale after, cause)`.
    pub skipped: Vec<(u64, f64, f64, String)>,
    /// Events with their step.
    pub events: Vec<(u64, String)>,
    /// The run's headroom findings: forward ops over half of fp16's max (or overflowing
    /// it) that ran in a 16-bit type, or in a run with none ([`Facts::ran_16bit`] false)
    /// every such forward op, as the question there is whether they would fit fp16.
    pub headroom: Vec<HeadroomHit>,
    /// In a run whose model ran in 16 bits, the forward fp32 ops (kept in fp32 by the
    /// precision mode) that would come close to or overflow fp16 only if they were cast:
    /// apart, as they are not what the run risks.
    pub headroom_fp32: Vec<HeadroomHit>,
    /// True when an op of the run ran in a 16-bit float type ([`ran_16bit`]).
    pub ran_16bit: bool,
    /// Parameters whose gradient loses values to fp16 underflow after scaling:
    /// `(name, worst share, step of it)`.
    pub underflow: Vec<(String, f64, u64)>,
    /// Per-parameter rows.
    pub params: Vec<ParamRow>,
    /// Steps that carry op records.
    pub steps_with_ops: Vec<u64>,
    /// Steps in the trace.
    pub steps: usize,
}

/// Parameters whose gradient loses values to fp16 underflow after scaling, each at its
/// worst step: `(name, share, step)`, worst first.
fn grad_underflow_worst(steps: &[StepRecord]) -> Vec<(String, f64, u64)> {
    let mut worst: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for s in steps {
        for p in &s.params {
            if p.f16_underflow_frac_scaled > 0.0 {
                let e = worst.entry(p.name.clone()).or_insert((0.0, s.step));
                if p.f16_underflow_frac_scaled > e.0 {
                    *e = (p.f16_underflow_frac_scaled, s.step);
                }
            }
        }
    }
    let mut underflow: Vec<(String, f64, u64)> =
        worst.into_iter().map(|(n, (f, s))| (n, f, s)).collect();
    underflow.sort_by(|a, b| b.1.total_cmp(&a.1));
    underflow
}

/// The headroom share above which the report warns.
pub const HEADROOM_WARN: f64 = 0.5;

impl Facts {
    /// Derives the facts of a trace; `recorded_causes` are skip causes the run wrote.
    pub fn new(trace: &Trace, recorded_causes: &BTreeMap<u64, String>) -> Facts {
        let steps = &trace.steps;
        let mut origins = Vec::new();
        for s in steps {
            if let Some(o) = &s.origins.first_inf {
                origins.push(("Inf", o.clone()));
            }
            if let Some(o) = &s.origins.first_nan {
                origins.push(("NaN", o.clone()));
            }
        }
        let chain = steps
            .iter()
            .find(|s| !s.origins.chain.is_empty())
            .map(|s| s.origins.chain.clone())
            .unwrap_or_default();
        let skipped = steps
            .iter()
            .filter_map(|s| {
                skip_cause(s, recorded_causes.get(&s.step).map(String::as_str))
                    .map(|c| (s.step, s.scale_before, s.scale_after, c))
            })
            .collect();
        let events = steps
            .iter()
            .flat_map(|s| s.events.iter().map(move |e| (s.step, e.clone())))
            .collect();
        let sixteen = ran_16bit(steps);
        let (low_hits, fp32_hits): (Vec<HeadroomHit>, Vec<HeadroomHit>) =
            headroom_hits(steps, HEADROOM_WARN)
                .into_iter()
                .partition(|h| h.low_precision() || !sixteen);
        Facts {
            verdict: verdict(trace),
            origins,
            chain,
            skipped,
            events,
            headroom: low_hits,
            headroom_fp32: fp32_hits,
            ran_16bit: sixteen,
            underflow: grad_underflow_worst(steps),
            params: param_table(steps),
            steps_with_ops: steps
                .iter()
                .filter(|s| s.ops.is_some())
                .map(|s| s.step)
                .collect(),
            steps: steps.len(),
        }
    }

    /// What to try, from what the trace shows; one sentence each.
    pub fn remedies(&self, precision: &str) -> Vec<String> {
        let mut out = Vec::new();
        let fp16 = crate::amp::mode::Precision::parse(precision)
            .is_ok_and(|p| p.low_dtype() == Some(crate::dtype::DType::F16));
        if let Some((kind, o)) = self.origins.iter().find(|(_, o)| o.phase == Phase::Forward) {
            out.push(format!(
                "The forward {kind} starts at `{}` in `{}`: keep that module in fp32 \
                 (`--keep-fp32 {}`), or train in bf16 (`--precision bf16`), whose exponent \
                 range equals fp32's. A smaller loss scale does not help a forward overflow.",
                o.op,
                module_name(&o.module),
                module_name(&o.module)
            ));
        }
        if !self.skipped.is_empty() {
            let rate = self.skipped.len() as f64 / self.steps.max(1) as f64;
            let scales: Vec<f64> = self.skipped.iter().map(|s| s.1).collect();
            let same = scales.windows(2).all(|w| w[0] == w[1]);
            if same && self.skipped.len() > 1 && scales[0] > 1.0 {
                out.push(format!(
                    "Every skip ({} of {} steps, {}) happened at loss scale {}: the scaler \
                     grows into the gradients' overflow and backs off, again and again. Cap \
                     the scale below it (`--scaler maxclip --max-scale {}`) or grow it less \
                     often (`--growth-interval`).",
                    self.skipped.len(),
                    self.steps,
                    fmt_pct(rate),
                    crate::numfmt::scale_long(scales[0]),
                    fmt_num(scales[0] / 2.0)
                ));
            } else if rate > 0.05 {
                out.push(format!(
                    "{} of {} steps ({}) were skipped: more than dynamic loss scaling needs. \
                     If the skips go on after the scale has come down, the gradients overflow \
                     whatever the scale: start from the first Inf above; if they stop, start \
                     from a lower scale (`--init-scale`).",
                    self.skipped.len(),
                    self.steps,
                    fmt_pct(rate)
                ));
            } else {
                out.push(format!(
                    "{} of {} steps ({}) were skipped: occasional skips are how dynamic loss \
                     scaling finds its scale.",
                    self.skipped.len(),
                    self.steps,
                    fmt_pct(rate)
                ));
            }
        }
        if self
            .events
            .iter()
            .any(|(_, e)| e.to_ascii_lowercase().contains("collapse"))
        {
            out.push(
                "The loss scale collapsed: every step overflows whatever the scale, so the \
                 cause is upstream of the scaler (a forward overflow or a bad input)."
                    .to_string(),
            );
        }
        if let Some((name, f, step)) = self.underflow.first() {
            out.push(format!(
                "{:.1}% of `{name}`'s gradient values flush to zero in fp16 even after \
                 scaling (step {step}): raise the loss scale or keep its module in fp32.",
                f * 100.0
            ));
        }
        // An op that overflowed is the origin's business (above); this is the warning for
        // the ops one step away from it.
        if let Some(h) = self.headroom.iter().find(|h| h.ratio.is_finite()) {
            if fp16 {
                out.push(format!(
                    "`{}` in `{}` reaches {} of fp16's max: one step away from overflow. \
                     Keep it in fp32 or use bf16.",
                    h.op.op,
                    module_name(&h.op.module),
                    fmt_pct(h.ratio)
                ));
            } else if h.ratio > 1.0 {
                // A run outside fp16 holds the value; the warning is for a move to fp16.
                out.push(format!(
                    "`{}` in `{}` reaches {} of fp16's max (max |x| {}): it would overflow \
                     in fp16, so keep it out of fp16.",
                    h.op.op,
                    module_name(&h.op.module),
                    fmt_pct(h.ratio),
                    fmt_num(h.max_abs)
                ));
            }
        }
        if self.verdict == "diverged" {
            out.push(
                "Non-finite values reached the parameters: use a loss scaler (it skips such \
                 steps) and clip gradients."
                    .to_string(),
            );
        }
        if out.is_empty() {
            out.push("Nothing to fix: the run stayed in range.".to_string());
        }
        out
    }
}

pub use crate::numfmt::long as fmt_num;

/// A share as a percentage (`12.5%`, `>1000%`, `inf` for an overflow).
pub fn fmt_pct(f: f64) -> String {
    if f.is_infinite() {
        "over 100% (overflowed)".to_string()
    } else if f >= 10.0 {
        format!("{:.0}%", f * 100.0)
    } else if f > 0.0 && f < 1e-3 {
        // Three significant digits, so a small share does not read as zero.
        let p = f * 100.0;
        let d = (2 - p.log10().floor() as i32).max(0) as usize;
        format!("{p:.d$}%")
    } else {
        format!("{:.1}%", f * 100.0)
    }
}

/// `1 step`, `3 steps`.
pub fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward `addmm` in `fc` at op index `index`, output `dtype` values up to `max_abs`.
    fn forward_op(index: u64, dtype: &str, max_abs: f64) -> OpRecord {
        let op = format!(
            r#"{{"micro":0,"index":{index},"phase":"forward","op":"addmm","module":"fc",
            "inputs":[],"output":{{"dtype":"{dtype}","shape":[2]}},
            "stats":{{"numel":2,"nan":0,"pos_inf":0,"neg_inf":0,"zeros":0,"subnormal":0,
            "max_abs":{max_abs:?},"min_abs_nonzero":1.0,"sum_sq":{:?},
            "exp_hist":{{"lo":0,"counts":[1]}},"to_f16":{{"overflow":{},"underflow":0}},
            "to_bf16":{{"overflow":0,"underflow":0}}}},"rounding":{{"overflow":0,"underflow":0}},
            "forward_op":null,"wrt":null,"masked_neg_inf":0}}"#,
            max_abs * max_abs,
            u64::from(max_abs > 65504.0)
        );
        serde_json::from_str(&op).unwrap()
    }

    /// The facts of a trace of one step with these ops.
    fn ops_facts(ops: Vec<OpRecord>) -> Facts {
        let step = StepRecord {
            ops: Some(ops),
            ..StepRecord::default()
        };
        let trace = Trace {
            header: crate::trace::record::Header::new(),
            steps: vec![step],
            end: None,
            truncated: None,
        };
        Facts::new(&trace, &BTreeMap::new())
    }

    /// The facts of a trace of one step whose one op, a forward `addmm` in `fc`, output
    /// `dtype` values up to `max_abs`.
    fn one_op_facts(dtype: &str, max_abs: f64) -> Facts {
        ops_facts(vec![forward_op(4, dtype, max_abs)])
    }

    #[test]
    fn fp32_ops_are_the_finding_of_an_fp32_run_and_apart_in_a_16_bit_one() {
        // An fp32 RMSNorm `pow` past fp16's max: in a run with fp16 ops it is apart and
        // names no remedy; in an fp32 run it is the finding.
        let mixed = ops_facts(vec![
            forward_op(0, "float16", 30.0),
            forward_op(1, "float32", 100000.0),
        ]);
        assert!(mixed.ran_16bit);
        assert!(mixed.headroom.is_empty());
        assert_eq!(mixed.headroom_fp32.len(), 1);
        assert!(!mixed
            .remedies("fp16")
            .iter()
            .any(|r| r.contains("fp16's max")));
        let fp32 = one_op_facts("float32", 100000.0);
        assert!(!fp32.ran_16bit);
        assert!(fp32.headroom_fp32.is_empty());
        assert_eq!(fp32.headroom.len(), 1);
        assert!(fp32
            .remedies("fp32")
            .iter()
            .any(|r| r.contains("would overflow in fp16")));
    }

    #[test]
    fn a_forward_op_past_half_of_fp16s_max_is_one_step_away_in_every_fp16_mode() {
        // 40000 is 61% of fp16's max: a warning where the run computes in fp16 (autocast,
        // O2 or a model made fp16), none where it computes in bf16 or fp32.
        let facts = one_op_facts("float16", 40000.0);
        let warned = |p: &str| {
            facts
                .remedies(p)
                .iter()
                .any(|r| r.contains("one step away"))
        };
        for p in ["fp16", "o2", "half"] {
            assert!(warned(p), "{p}");
        }
        for p in ["bf16", "o2-bf16", "bfloat16-pure", "fp32"] {
            assert!(!warned(p), "{p}");
        }
    }

    #[test]
    fn past_fp16s_max_outside_fp16_is_a_warning_against_fp16_not_one_step_away() {
        // 1e5 in a bf16 run: held by bf16, an overflow in fp16.
        let facts = one_op_facts("bfloat16", 100000.0);
        for p in ["bf16", "fp32"] {
            let r = facts.remedies(p);
            assert!(!r.iter().any(|r| r.contains("one step away")), "{p}: {r:?}");
            assert!(
                r.iter()
                    .any(|r| r.contains("would overflow in fp16") && r.contains("max |x| 100000")),
                "{p}: {r:?}"
            );
        }
    }

    #[test]
    fn number_formats() {
        assert_eq!(fmt_num(65536.0), "65536");
        assert_eq!(fmt_num(0.5), "0.5");
        assert_eq!(fmt_num(1e30), "1.000e30");
        assert_eq!(fmt_num(f64::NAN), "NaN");
        assert_eq!(fmt_pct(0.125), "12.5%");
        assert_eq!(fmt_pct(0.0), "0.0%");
        assert_eq!(fmt_pct(3.9453125 / 65504.0), "0.00602%");
        assert_eq!(plural(1, "step"), "1 step");
        assert_eq!(plural(0, "step"), "0 steps");
        assert_eq!(fmt_pct(f64::INFINITY), "over 100% (overflowed)");
    }

    #[test]
    fn first_origin_takes_the_earlier_op() {
        let r = |i: u64| OpRef {
            step: 0,
            micro: 0,
            phase: Phase::Backward,
            op_index: i,
            op: "x".into(),
            module: "m".into(),
            forward_op: None,
        };
        let mut s = StepRecord::default();
        assert!(first_origin(&s).is_none());
        s.origins.first_nan = Some(r(5));
        assert_eq!(
            first_origin(&s).map(|(k, o)| (k, o.op_index)),
            Some(("NaN", 5))
        );
        s.origins.first_inf = Some(r(7));
        assert_eq!(
            first_origin(&s).map(|(k, o)| (k, o.op_index)),
            Some(("NaN", 5))
        );
        s.origins.first_inf = Some(r(3));
        assert_eq!(
            first_origin(&s).map(|(k, o)| (k, o.op_index)),
            Some(("Inf", 3))
        );
    }

    #[test]
    fn masked_neg_inf_is_not_a_non_finite_step() {
        use crate::probe::TensorStats;
        use crate::trace::record::TensorMeta;
        let vals = [1.0, f32::NEG_INFINITY, 2.0];
        let mut op = OpRecord {
            micro: 0,
            index: 0,
            phase: Phase::Forward,
            op: "masked_fill".into(),
            module: "attn".into(),
            inputs: Vec::new(),
            output: TensorMeta {
                dtype: crate::dtype::DType::F32,
                shape: vec![3],
            },
            stats: TensorStats::compute(crate::dtype::DType::F32, &vals),
            rounding: Default::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: 1,
            additive_mask: false,
            blame: None,
        };
        let mut s = StepRecord {
            ops: Some(vec![op.clone()]),
            ..StepRecord::default()
        };
        assert_eq!(unmasked_nonfinite(&op), 0);
        assert!(!step_has_nonfinite(&s));
        op.masked_neg_inf = 0;
        s.ops = Some(vec![op.clone()]);
        assert_eq!(unmasked_nonfinite(&op), 1);
        assert!(step_has_nonfinite(&s));
    }

    #[test]
    fn skip_cause_priority() {
        let mut s = StepRecord {
            skipped: true,
            ..StepRecord::default()
        };
        assert_eq!(
            skip_cause(&s, None).as_deref(),
            Some("Inf/NaN in the gradients")
        );
        s.origins.first_inf = Some(OpRef {
            step: 0,
            micro: 0,
            phase: Phase::Forward,
            op_index: 2,
            op: "matmul".into(),
            module: "enc.wo".into(),
            forward_op: None,
        });
        assert_eq!(
            skip_cause(&s, None).as_deref(),
            Some("forward Inf from `matmul` in `enc.wo`")
        );
        s.events.push("step skipped: scale at floor".into());
        assert_eq!(
            skip_cause(&s, None).as_deref(),
            Some("step skipped: scale at floor")
        );
        assert_eq!(
            skip_cause(&s, Some("recorded")).as_deref(),
            Some("recorded")
        );
        s.skipped = false;
        assert_eq!(skip_cause(&s, Some("recorded")), None);
    }
}
