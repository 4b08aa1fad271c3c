//! The records of one run, as the panels read them: header, steps, end, where the first
//! non-finite values came from, and the per-layer view of the gradients.

use crate::trace::io::{Trace, Truncation};
use crate::trace::record::{EndRecord, Header, OpRecord, OpRef, ParamRecord, Record, StepRecord};

/// Where a run stands.
#[derive(Debug, Clone, PartialEq)]
pub enum RunState {
    /// Live: no record yet.
    Waiting,
    /// Live: steps are arriving.
    Running,
    /// The run finished (an end record, or the live run returned).
    Finished,
    /// The live run stopped with an error (or the trace being followed became unreadable).
    Failed(String),
    /// A trace without an end record: the run was killed, crashed or is still going.
    Incomplete,
}

/// What the records are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceKind {
    /// A finished trace file, read once.
    Replay,
    /// A run started by the UI, on a worker thread.
    Live,
    /// A trace file another process is writing, read as it grows.
    Follow,
}

/// Non-finite values in one op's output, not counting `-inf` a mask wrote on purpose.
pub fn op_nonfinite(op: &OpRecord) -> u64 {
    op.stats.nan + op.stats.pos_inf + op.stats.neg_inf.saturating_sub(op.masked_neg_inf)
}

/// An op worth stopping at: its output holds a non-finite value (masked `-inf` aside) or
/// its rounding overflowed.
pub fn is_anomaly(op: &OpRecord) -> bool {
    op_nonfinite(op) > 0 || op.rounding.overflow > 0
}

/// A step worth stopping at: skipped, non-finite gradients, a non-finite loss, or an origin.
pub fn step_is_anomaly(s: &StepRecord) -> bool {
    s.skipped
        || s.found_inf
        || s.loss.is_some_and(|l| !l.is_finite())
        || s.origins.first_inf.is_some()
        || s.origins.first_nan.is_some()
}

/// Gradient statistics of one layer (a module's parameters together) or one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStat {
    /// Module path (or parameter name).
    pub name: String,
    /// Parameters in it.
    pub params: usize,
    /// Elements in it.
    pub numel: u64,
    /// Largest finite `|g|` of the unscaled gradients.
    pub max_abs_grad: f64,
    /// L2 norm of the finite unscaled gradient values.
    pub grad_l2: f64,
    /// Share of the finite nonzero unscaled values that fp16 would flush to zero.
    pub underflow_unscaled: f64,
    /// Share of the same values whose scaled value fp16 would flush: what the scale lost.
    pub underflow_scaled: f64,
    /// NaN and ±inf gradient values.
    pub nonfinite: u64,
}

impl LayerStat {
    fn from_params(name: String, ps: &[&ParamRecord]) -> LayerStat {
        let mut numel = 0;
        let mut max = 0f64;
        let mut sq = 0f64;
        let mut nonfinite = 0;
        let (mut nz, mut uf, mut ufs) = (0f64, 0f64, 0f64);
        for p in ps {
            numel += p.numel;
            max = max.max(p.max_abs_grad);
            sq += p.grad_l2 * p.grad_l2;
            nonfinite += p.nonfinite;
            // The fractions are over a parameter's finite nonzero values; recover that
            // count to weight them (zero_frac = zeros / numel).
            let zeros = (p.zero_frac * p.numel as f64).round();
            let n = (p.numel as f64 - zeros - p.nonfinite as f64).max(0.0);
            nz += n;
            uf += p.f16_underflow_frac_unscaled * n;
            ufs += p.f16_underflow_frac_scaled * n;
        }
        let share = |x: f64| if nz > 0.0 { x / nz } else { 0.0 };
        LayerStat {
            name,
            params: ps.len(),
            numel,
            max_abs_grad: max,
            grad_l2: sq.sqrt(),
            underflow_unscaled: share(uf),
            underflow_scaled: share(ufs),
            nonfinite,
        }
    }
}

/// The module a parameter belongs to: its name without the last dotted segment.
pub fn layer_of(param: &str) -> &str {
    param.rsplit_once('.').map_or(param, |(m, _)| m)
}

/// The records of one run and what the panels ask of them.
#[derive(Debug, Clone)]
pub struct Model {
    /// Shown in the status bar: the trace file or config.
    pub label: String,
    /// Where the records come from.
    pub source: SourceKind,
    /// The header, once read.
    pub header: Option<Header>,
    /// Steps in arrival order.
    pub steps: Vec<StepRecord>,
    /// The end record, when the run finished and wrote one.
    pub end: Option<EndRecord>,
    /// Set when the trace's last line was cut mid-record.
    pub truncated: Option<Truncation>,
    /// Where the run stands.
    pub state: RunState,
    /// Verdict handed over by a live run that ended (its channel has no end record).
    pub live_verdict: Option<String>,
    first_inf: Option<OpRef>,
    first_nan: Option<OpRef>,
    chain: Vec<OpRef>,
}

impl Model {
    /// An empty model waiting for records (live or followed).
    pub fn waiting(label: impl Into<String>, source: SourceKind) -> Model {
        Model {
            label: label.into(),
            source,
            header: None,
            steps: Vec::new(),
            end: None,
            truncated: None,
            state: RunState::Waiting,
            live_verdict: None,
            first_inf: None,
            first_nan: None,
            chain: Vec::new(),
        }
    }

    /// The model of a trace read from a file.
    pub fn from_trace(trace: Trace, label: impl Into<String>) -> Model {
        let mut m = Model::waiting(label, SourceKind::Replay);
        m.truncated = trace.truncated;
        m.push(Record::Header(trace.header));
        for s in trace.steps {
            m.push(Record::Step(s));
        }
        match trace.end {
            Some(e) => m.push(Record::End(e)),
            None => m.state = RunState::Incomplete,
        }
        m
    }

    /// Adds one record as it arrives.
    pub fn push(&mut self, rec: Record) {
        match rec {
            Record::Header(h) => {
                self.header = Some(h);
                if self.state == RunState::Waiting {
                    self.state = RunState::Running;
                }
            }
            Record::Step(s) => {
                if self.first_inf.is_none() {
                    self.first_inf = s.origins.first_inf.clone();
                }
                if self.first_nan.is_none() {
                    self.first_nan = s.origins.first_nan.clone();
                }
                if self.chain.is_empty() {
                    self.chain = s.origins.chain.clone();
                }
                self.steps.push(s);
            }
            Record::End(e) => {
                self.end = Some(e);
                self.state = RunState::Finished;
            }
        }
    }

    /// Marks how a live run or a followed trace ended: `Ok` with the run's verdict, or the
    /// error that stopped it.
    pub fn finish(&mut self, outcome: Result<Option<String>, String>) {
        match outcome {
            Ok(v) => {
                if self.live_verdict.is_none() {
                    self.live_verdict = v;
                }
                self.state = RunState::Finished;
            }
            Err(e) => self.state = RunState::Failed(e),
        }
    }

    /// The verdict and whether it is final (from the end record or the finished run) or
    /// only what the steps so far say.
    pub fn verdict(&self) -> (String, bool) {
        if let Some(e) = self.end.as_ref().filter(|e| !e.verdict.is_empty()) {
            return (e.verdict.clone(), true);
        }
        if let Some(v) = &self.live_verdict {
            return (v.clone(), true);
        }
        // The runner's rule over the steps so far; diverged parameters show as infinite
        // post-step magnitudes in the last step.
        let finite = self.steps.last().is_none_or(StepRecord::params_finite);
        (
            crate::diagnose::summary::verdict(&self.steps, finite).to_string(),
            self.end.is_some(),
        )
    }

    /// What a panel says while there is no step to show.
    pub fn no_step_note(&self) -> &'static str {
        match (&self.source, &self.state) {
            (SourceKind::Replay, _) | (_, RunState::Finished) => " the trace has no step",
            (_, RunState::Failed(_)) => " the run failed before its first step",
            _ => " waiting for the first step…",
        }
    }

    /// Steps the run was configured for, when the header's config says.
    pub fn expected_steps(&self) -> Option<u64> {
        let h = self.header.as_ref()?;
        h.config.get("train")?.get("steps")?.as_u64()
    }

    /// The run's first op whose output had an Inf none of its inputs had.
    pub fn first_inf(&self) -> Option<&OpRef> {
        self.first_inf.as_ref()
    }

    /// The run's first op whose output had a NaN none of its inputs had.
    pub fn first_nan(&self) -> Option<&OpRef> {
        self.first_nan.as_ref()
    }

    /// The ops that carried the first non-finite values on, from the origin onward.
    pub fn chain(&self) -> &[OpRef] {
        &self.chain
    }

    /// Index in [`Model::steps`] of step number `step`.
    pub fn step_index(&self, step: u64) -> Option<usize> {
        // Steps arrive in order from 0, so the number is usually the index.
        match self.steps.get(step as usize) {
            Some(s) if s.step == step => Some(step as usize),
            _ => self.steps.iter().position(|s| s.step == step),
        }
    }

    /// The op records of the step at `idx`, when the trace kept them.
    pub fn ops(&self, idx: usize) -> Option<&[OpRecord]> {
        self.steps.get(idx)?.ops.as_deref()
    }

    /// Position of op `op_index` in the step at `idx`'s op list.
    pub fn op_position(&self, idx: usize, op_index: u64) -> Option<usize> {
        let ops = self.ops(idx)?;
        match ops.get(op_index as usize) {
            Some(o) if o.index == op_index => Some(op_index as usize),
            _ => ops.iter().position(|o| o.index == op_index),
        }
    }

    /// The first non-finite op of the run as (step index, op position): the earlier of the
    /// first Inf and first NaN origins, or else the first op holding a non-finite value.
    pub fn first_nonfinite(&self) -> Option<(usize, usize)> {
        let origin = [self.first_inf.as_ref(), self.first_nan.as_ref()]
            .into_iter()
            .flatten()
            .min_by_key(|o| (o.step, o.op_index));
        if let Some(o) = origin {
            if let Some(i) = self.step_index(o.step) {
                if let Some(p) = self.op_position(i, o.op_index) {
                    return Some((i, p));
                }
            }
        }
        self.steps.iter().enumerate().find_map(|(i, s)| {
            let ops = s.ops.as_deref()?;
            ops.iter().position(|o| op_nonfinite(o) > 0).map(|p| (i, p))
        })
    }

    /// Why the step at `idx` was skipped (or found non-finite gradients), in words; `None`
    /// for a clean step.
    pub fn skip_cause(&self, idx: usize) -> Option<String> {
        let s = self.steps.get(idx)?;
        if !(s.skipped || s.found_inf) {
            return None;
        }
        let o = &s.origins;
        let cause = match (&o.first_inf, &o.first_nan) {
            (Some(i), _) => format!(
                "inf from {} #{} {}",
                super::format::phase(i.phase),
                i.op_index,
                super::format::op_at(&i.op, &i.module)
            ),
            (None, Some(n)) => format!(
                "NaN from {} #{} {}",
                super::format::phase(n.phase),
                n.op_index,
                super::format::op_at(&n.op, &n.module)
            ),
            (None, None) => "non-finite gradient".to_string(),
        };
        Some(if s.skipped {
            cause
        } else {
            format!("{cause} (step not skipped)")
        })
    }

    /// Gradient statistics of the step at `idx`, one row per layer (module) or, with
    /// `by_param`, per parameter, in the order the parameters are recorded.
    pub fn layers(&self, idx: usize, by_param: bool) -> Vec<LayerStat> {
        let Some(s) = self.steps.get(idx) else {
            return Vec::new();
        };
        if by_param {
            return s
                .params
                .iter()
                .map(|p| LayerStat::from_params(p.name.clone(), &[p]))
                .collect();
        }
        let mut order: Vec<&str> = Vec::new();
        let mut groups: std::collections::HashMap<&str, Vec<&ParamRecord>> =
            std::collections::HashMap::new();
        for p in &s.params {
            let l = layer_of(&p.name);
            let g = groups.entry(l).or_default();
            if g.is_empty() {
                order.push(l);
            }
            g.push(p);
        }
        order
            .into_iter()
            .map(|l| LayerStat::from_params(l.to_string(), &groups[l]))
            .collect()
    }

    /// `log2` of a layer's (or parameter's) largest unscaled gradient over the `n` steps
    /// up to and including `idx`: `None` where a step lacks it or it is zero, `Some(NaN)`
    /// where the gradient held non-finite values.
    pub fn layer_history(
        &self,
        name: &str,
        by_param: bool,
        idx: usize,
        n: usize,
    ) -> Vec<Option<f64>> {
        let end = (idx + 1).min(self.steps.len());
        let start = end.saturating_sub(n);
        self.steps[start..end]
            .iter()
            .map(|s| {
                let ps = s.params.iter().filter(|p| {
                    if by_param {
                        p.name == name
                    } else {
                        layer_of(&p.name) == name
                    }
                });
                let mut any = false;
                let mut max = 0f64;
                for p in ps {
                    any = true;
                    if p.nonfinite > 0 {
                        return Some(f64::NAN);
                    }
                    max = max.max(p.max_abs_grad);
                }
                (any && max > 0.0).then(|| max.log2())
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::{DType, RoundCounts};
    use crate::probe::TensorStats;
    use crate::trace::record::{Phase, TensorMeta};

    /// An op record whose output holds `values` (fp16).
    pub(crate) fn op(
        index: u64,
        phase: Phase,
        name: &str,
        module: &str,
        values: &[f32],
    ) -> OpRecord {
        OpRecord {
            micro: 0,
            index,
            phase,
            op: name.into(),
            module: module.into(),
            inputs: vec![],
            output: TensorMeta {
                dtype: DType::F16,
                shape: vec![values.len()],
            },
            stats: TensorStats::compute(DType::F16, values),
            rounding: RoundCounts::default(),
            forward_op: None,
            wrt: None,
            masked_neg_inf: 0,
            additive_mask: false,
            blame: None,
        }
    }

    fn param(
        name: &str,
        numel: u64,
        zero_frac: f64,
        nonfinite: u64,
        uf: f64,
        max: f64,
        l2: f64,
    ) -> ParamRecord {
        ParamRecord {
            name: name.into(),
            dtype: DType::F32,
            grad_dtype: Some(DType::F32),
            numel,
            grad_l2: l2,
            max_abs_grad: max,
            zero_frac,
            f16_underflow_frac_unscaled: uf,
            f16_underflow_frac_scaled: uf / 2.0,
            nonfinite,
            param_max_abs_after: 1.0,
            param_nan_after: 0,
        }
    }

    #[test]
    fn layers_group_parameters_by_module_and_weight_their_shares() {
        let mut m = Model::waiting("t", SourceKind::Replay);
        m.push(Record::Step(StepRecord {
            params: vec![
                // 80 finite nonzero values, half would flush: 40.
                param("enc.q.weight", 100, 0.2, 0, 0.5, 3.0, 3.0),
                // 50 - 10 non-finite = 40 finite nonzero, a quarter flush: 10.
                param("enc.q.bias", 50, 0.0, 10, 0.25, 7.0, 4.0),
                param("head", 10, 0.0, 0, 0.0, 0.5, 1.0),
            ],
            ..StepRecord::default()
        }));
        let l = m.layers(0, false);
        assert_eq!(l.len(), 2);
        assert_eq!(
            (l[0].name.as_str(), l[0].params, l[0].numel),
            ("enc.q", 2, 150)
        );
        assert_eq!(l[0].max_abs_grad, 7.0);
        assert_eq!(l[0].grad_l2, 5.0);
        assert_eq!(l[0].nonfinite, 10);
        assert!((l[0].underflow_unscaled - 50.0 / 120.0).abs() < 1e-15);
        assert!((l[0].underflow_scaled - 25.0 / 120.0).abs() < 1e-15);
        assert_eq!(l[1].name, "head");
        let p = m.layers(0, true);
        assert_eq!(p.len(), 3);
        assert_eq!(p[1].underflow_unscaled, 0.25);
        assert_eq!(
            layer_of("encoder.block.0.layer.0.SelfAttention.q.weight"),
            "encoder.block.0.layer.0.SelfAttention.q"
        );
        assert_eq!(layer_of("bias"), "bias");
    }

    #[test]
    fn layer_history_marks_nonfinite_and_zero() {
        let mut m = Model::waiting("t", SourceKind::Live);
        for (max, nonfinite) in [(0.25, 0), (0.0, 0), (1.0, 3), (8.0, 0)] {
            m.push(Record::Step(StepRecord {
                params: vec![param("fc.weight", 4, 0.0, nonfinite, 0.0, max, max)],
                ..StepRecord::default()
            }));
        }
        let h = m.layer_history("fc", false, 3, 10);
        assert_eq!(h.len(), 4);
        assert_eq!(h[0], Some(-2.0));
        assert_eq!(h[1], None);
        assert!(h[2].unwrap().is_nan());
        assert_eq!(h[3], Some(3.0));
        assert_eq!(m.layer_history("fc", false, 3, 2).len(), 2);
    }

    #[test]
    fn first_nonfinite_prefers_the_earlier_origin_else_scans() {
        let ops = vec![
            op(0, Phase::Forward, "linear", "fc1", &[1.0]),
            op(1, Phase::Forward, "exp", "act", &[f32::INFINITY]),
            op(2, Phase::Forward, "sub", "act", &[f32::NAN]),
        ];
        let mut s = StepRecord {
            step: 0,
            ops: Some(ops.clone()),
            ..StepRecord::default()
        };
        s.origins.first_nan = Some(OpRef::from_op(0, &ops[2]));
        s.origins.first_inf = Some(OpRef::from_op(0, &ops[1]));
        let mut m = Model::waiting("t", SourceKind::Replay);
        m.push(Record::Step(s));
        assert_eq!(m.first_nonfinite(), Some((0, 1)));
        // Without origins (e.g. a masked -inf only), the first op holding a non-finite
        // value is the answer.
        let mut m2 = Model::waiting("t", SourceKind::Replay);
        m2.push(Record::Step(StepRecord {
            step: 0,
            ops: Some(ops),
            ..StepRecord::default()
        }));
        assert_eq!(m2.first_nonfinite(), Some((0, 1)));
        assert_eq!(
            Model::waiting("t", SourceKind::Replay).first_nonfinite(),
            None
        );
    }

    #[test]
    fn masked_neg_inf_is_not_an_anomaly() {
        let mut o = op(
            0,
            Phase::Forward,
            "masked_fill",
            "attn",
            &[f32::NEG_INFINITY, 1.0],
        );
        assert!(is_anomaly(&o));
        o.masked_neg_inf = 1;
        assert_eq!(op_nonfinite(&o), 0);
        assert!(!is_anomaly(&o));
        o.rounding.overflow = 1;
        assert!(is_anomaly(&o));
    }

    #[test]
    fn verdict_so_far_then_final() {
        let mut m = Model::waiting("t", SourceKind::Live);
        m.push(Record::Header(Header::new()));
        assert_eq!(m.state, RunState::Running);
        m.push(Record::Step(StepRecord {
            skipped: true,
            found_inf: true,
            ..StepRecord::default()
        }));
        assert_eq!(m.verdict(), ("overflow-skips".to_string(), false));
        m.finish(Ok(Some("overflow-skips".into())));
        assert_eq!(m.verdict(), ("overflow-skips".to_string(), true));
        assert_eq!(m.state, RunState::Finished);
        m.finish(Err("disk full".into()));
        assert_eq!(m.state, RunState::Failed("disk full".into()));
    }
}
